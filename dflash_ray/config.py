"""Config: OmegaConf groups under conf/, composed with Hydra's compose API and override grammar,
validated against typed dataclasses before anything else starts.

Every check of the config's own values lives here: unknown keys (`a.typo=1`), wrong types
(`train.lr=abc`), choices, minimums and the rules between keys (bucket boundaries vs the batch budget,
the flight window vs the batches of one step) raise UserError with one line that names the key (and the
closest known one). The typed groups (model, data, cluster, train, ...) take no new keys: nothing would
read them. `+name=value` adds a key at the root (for your own interpolations: `+corpus=/data
data.shards=${corpus}/shards`).
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from dflash_ray.errors import UserError

CONF_DIR = Path(os.environ.get("DFLASH_RAY_CONF", Path(__file__).resolve().parent.parent / "conf"))


# ----------------------------------------------------------------------------- typed schema
@dataclass
class ModelConfig:
    name: str = "tiny"
    target_path: Optional[str] = None
    target_config: Dict[str, Any] = field(default_factory=dict)
    num_draft_layers: int = 5
    target_layer_ids: Optional[List[int]] = None
    block_size: int = 16
    mask_token_id: Optional[int] = None
    num_anchors: int = 512
    anchors_per_batch: Optional[int] = None   # blocks per batch over all its rows (None: num_anchors per row only)
    loss_gamma: Optional[float] = None
    drafter_intermediate_size: Optional[int] = None     # drafter MLP width (None: the target's intermediate_size)
    drafter_num_attention_heads: Optional[int] = None   # drafter heads (None: the target's); head_dim stays the target's
    drafter_num_key_value_heads: Optional[int] = None
    init_from: Optional[str] = None                     # an exported drafter directory to start from (step 0 only)


@dataclass
class SyntheticConfig:
    num_conversations: int = 600
    min_tokens: int = 48
    max_tokens: int = 512
    target_steps: int = 400          # train the synthesised target this many steps on the corpus (0: random)
    regenerate: bool = True          # train the drafter on the target's own answers (dflash-ray regenerate)
    heldout_prompts: int = 16        # prompts of a held-out corpus in <run.dir>/heldout.jsonl (tau)


@dataclass
class DataConfig:
    input: Optional[str] = None
    tokenizer: Optional[str] = None
    output: Optional[str] = None
    shards: Optional[str] = None
    prompts: Optional[str] = None
    shard_size: int = 10000
    vocab_size: Optional[int] = None
    bucket_boundaries: List[int] = field(default_factory=lambda: [512, 1024, 1536, 2304, 3296, 8192])
    max_tokens_per_batch: int = 16384
    overlong: str = "truncate"
    interleave: str = "default"
    chunk_batches: int = 64
    attention_tokens: Optional[float] = None   # La of the target's cost per row (None: from the target's shape; 0: off)
    format: str = "auto"             # prepare's input rows: auto | sharegpt | openai | conversations
    on_bad_row: str = "fail"         # prepare: fail (one line naming file and row) | skip (counted by reason)
    turns: str = "all"               # history-rewriting templates: a row per assistant turn (all) or the last only
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # e.g. {enable_thinking: false}
    prepare_engine: str = "local"    # prepare: local (one process) | ray (a Ray Data job on cluster.*)
    prepare_rows_per_task: int = 2000  # ray: conversations per task
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class ClusterConfig:
    name: str = "local"
    address: Optional[str] = None
    num_cpus: Optional[int] = 4
    object_store_memory: Optional[int] = None
    use_gpu: bool = False
    target_workers: int = 1
    drafter_workers: int = 2
    target_resource: str = "target_slot"
    target_gpus: float = 1.0         # GPU share of each target actor (use_gpu; < 1 shares a GPU)
    drafter_gpus: float = 1.0        # GPU share of each drafter worker (use_gpu; < 1 shares a GPU)
    max_batches_in_flight: int = 4
    nodes: int = 1                   # nodes the cluster has (the capacity model's per-node split; the runtime sees them)
    token_block_mb: float = 8.0      # the token store's blocks (Ray Data, in the object stores): the transfer unit
    token_cache_mb: float = 256.0    # blocks each join process keeps (LRU)
    stream_block_mb: float = 32.0    # Ray Data blocks of the stream: as many plan batches as fit (0: one a block)
    device_memory_gb: float = 139.0  # GiB per GPU, as torch.cuda reports it (H200: ~139); the memory model's bound
    target_tokens_per_gpu: Optional[float] = None   # measured rates for the capacity model (plan)
    drafter_tokens_per_gpu: Optional[float] = None


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: Optional[int] = None
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    grad_accum: int = 1
    checkpoint_every: Optional[int] = None          # optimizer steps (0/None: off)
    checkpoint_every_minutes: Optional[float] = 30.0  # rank 0's clock since the last checkpoint (0/None: off)
    checkpoint_upload: str = "async"               # async: Ray Train uploads while training goes on; sync: waits
    num_to_keep: int = 2
    max_failures: int = 3
    stream_window_rows: int = 20000  # feed rows per Ray Data stream (a fit of its own, from a checkpoint); 0: one
    max_nonfinite_steps: int = 10    # stop after this many NaN/Inf steps in a row (skipped, counted; 0: never stop)
    storage_path: Optional[str] = None
    tensorboard: bool = False        # the older switch: the same as adding tensorboard to trackers
    trackers: Optional[List[str]] = None   # any of tensorboard, mlflow, wandb (null/[]: metrics.jsonl only)
    tracker_project: str = "dflash-ray"    # MLflow experiment / W&B project
    mlflow_tracking_uri: Optional[str] = None  # null: $MLFLOW_TRACKING_URI, else sqlite:///<run.root>/mlflow.db
    wandb_mode: Optional[str] = None       # online | offline | disabled; null: $WANDB_MODE, else online when logged in
    heldout_every: int = 0           # held-out tau every N steps during training (0: only after training)
    compile: bool = True             # CUDA: torch.compile the drafter's layers (flex attention fuses in them)
    checkpoint_layers: bool = False  # activation checkpointing of the drafter's layers: recompute in backward


@dataclass
class RunConfig:
    name: str = "default"
    root: str = "runs"
    dir: str = "runs/default"


@dataclass
class PlanConfig:
    epoch: int = 0


@dataclass
class EvalConfig:
    max_new_tokens: int = 64
    max_prompts: int = 32


@dataclass
class RegenerateConfig:
    output: Optional[str] = None     # the regenerated conversations .jsonl
    max_new_tokens: int = 200        # per assistant turn
    batch_size: int = 32             # conversations per generate() call on a target actor


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    drafter: Optional[str] = None
    target: Optional[str] = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


CHOICES = {"data.overlong": ("truncate", "drop"),
           "data.format": ("auto", "sharegpt", "openai", "conversations"), "data.on_bad_row": ("fail", "skip"),
           "data.turns": ("all", "last"), "data.prepare_engine": ("local", "ray"),
           "data.interleave": ("default", "stride", "sequential", "random", "diversity"),
           "train.checkpoint_upload": ("async", "sync")}
MINIMUM = {"model.anchors_per_batch": 1, "cluster.target_gpus": 0.01, "cluster.device_memory_gb": 0.1, "cluster.drafter_gpus": 0.01, "model.block_size": 2, "model.num_draft_layers": 1, "model.num_anchors": 1,
           "model.drafter_intermediate_size": 1, "model.drafter_num_attention_heads": 1,
           "model.drafter_num_key_value_heads": 1,
           "data.shard_size": 1, "data.prepare_rows_per_task": 1, "data.max_tokens_per_batch": 1, "data.chunk_batches": 1,
           "cluster.target_workers": 1, "cluster.drafter_workers": 1, "cluster.max_batches_in_flight": 1,
           "train.epochs": 1, "train.grad_accum": 1, "train.checkpoint_every": 0,
           "train.checkpoint_every_minutes": 0.0, "train.num_to_keep": 1,
           "train.max_failures": 0, "train.max_nonfinite_steps": 0, "train.heldout_every": 0, "train.lr": 0.0, "train.warmup_ratio": 0.0, "eval.max_new_tokens": 1,
           "regenerate.max_new_tokens": 1, "regenerate.batch_size": 1, "data.synthetic.target_steps": 0,
           "data.synthetic.heldout_prompts": 0}


# ----------------------------------------------------------------------------- composition
def _flat_keys(cfg: Any, prefix: str = "") -> List[str]:
    keys = []
    if isinstance(cfg, DictConfig):
        for k in cfg.keys():
            full = f"{prefix}.{k}" if prefix else str(k)
            keys.append(full)
            node = cfg._get_node(k)
            if isinstance(node, (DictConfig, ListConfig)) and not node._is_missing() and not node._is_none():
                keys.extend(_flat_keys(node, full) if isinstance(node, DictConfig) else [])
    return keys


def _closest(key: str, known: List[str]) -> str:
    best = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not best:  # compare last components, e.g. `train.lrr` vs `train.lr`
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in known}
        m = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
        best = [leaves[m[0]]] if m else []
    return f" (did you mean '{best[0]}'?)" if best else ""


def _known_keys() -> List[str]:
    return _flat_keys(_compose_raw([]))


def _compose_raw(overrides: List[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def compose_config(overrides: List[str] | None = None) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides, validate types, return a resolved DictConfig."""
    overrides = list(overrides or [])
    try:
        cfg = _compose_raw(overrides)
    except Exception as e:  # Hydra's errors are multi-line; reduce to one line that names the key
        raise UserError(_explain_compose_error(e, overrides)) from e
    schema = OmegaConf.structured(RootConfig)
    OmegaConf.set_struct(schema, False)  # keys added on purpose with `+key=...` are kept
    try:
        merged = OmegaConf.merge(schema, cfg)
        # a merge lets the schema's default win over `???`: mark required values missing again
        for key in OmegaConf.missing_keys(cfg):
            OmegaConf.update(merged, key, "???", force_add=True)
        OmegaConf.to_container(merged, resolve=True, throw_on_missing=False)  # errors name the key
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        if isinstance(e, ConfigKeyError):  # `+train.new_key=1`: a typed group has no place for it
            raise UserError(f"unknown config key '{key}'{_closest(key, _known_keys())}: the group "
                            f"'{key.split('.')[0]}' is typed and nothing would read a new key in it "
                            f"(`+name=value` adds keys at the root only)") from e
        raise UserError(f"config key '{key}': {msg}") from e
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(merged, key)
        if value not in allowed:
            raise UserError(f"config key '{key}': '{value}' is not one of {', '.join(allowed)}")
    for key, least in MINIMUM.items():
        value = OmegaConf.select(merged, key, default=None)
        if isinstance(value, (int, float)) and value < least:
            raise UserError(f"config key '{key}': must be >= {least}, got {value}")
    _check_rules(merged)
    return merged  # `???` values stay missing; `require()` names them where they are needed


def _check_rules(cfg: DictConfig) -> None:
    """Rules between keys."""
    from dflash_ray.data.plan import PlanSpec

    PlanSpec.from_config(cfg)  # bucket boundaries ascending, the batch budget holds the longest bucket
    c, t = cfg.cluster, cfg.train
    if not t.checkpoint_every and not t.checkpoint_every_minutes:
        raise UserError("config key 'train.checkpoint_every_minutes': checkpoints are off (it and "
                        "train.checkpoint_every are both 0/null): set one of them (a restart would retrain "
                        "whole epochs)")
    from dflash_ray.runtime.record.trackers import chosen

    chosen(t)  # unknown tracker names
    if t.wandb_mode is not None and t.wandb_mode not in ("online", "offline", "disabled"):
        raise UserError(f"config key 'train.wandb_mode': '{t.wandb_mode}' is not one of online, offline, disabled")
    if int(t.stream_window_rows) < 0:
        raise UserError(f"config key 'train.stream_window_rows': must be >= 0 (0: one stream for the whole run), "
                        f"got {t.stream_window_rows}")
    if float(c.stream_block_mb) < 0:
        raise UserError(f"config key 'cluster.stream_block_mb': must be >= 0 (0: one plan batch a block), "
                        f"got {c.stream_block_mb}")
    per_step = int(c.drafter_workers) * int(t.grad_accum)
    if int(c.max_batches_in_flight) < per_step:
        raise UserError(f"config key 'cluster.max_batches_in_flight': {c.max_batches_in_flight} is less than "
                        f"the {per_step} batches one optimizer step needs (drafter_workers x grad_accum)")


def _explain_compose_error(e: Exception, overrides: List[str]) -> str:
    text = str(e)
    m = re.search(r"full_key: ([\w.\[\]]+)", text) or re.search(r"Could not (?:override|delete) '([^']+)'", text)
    if "Could not find '" in text or "Could not load '" in text:
        m2 = re.search(r"Could not (?:find|load) '([^']+)'", text)
        avail = re.search(r"Available options in '[^']+':\s*((?:\n\s+\S+)+)", text)
        opts = ", ".join(avail.group(1).split()) if avail else ""
        group = (m2.group(1) if m2 else "?").split("/")[0]
        return f"config group '{group}' has no option '{(m2.group(1) if m2 else '?').split('/', 1)[-1]}'" + (
            f" (options: {opts})" if opts else "")
    if m:
        key = m.group(1)
        known = _known_keys()
        if "not in struct" in text or "Key '" in text or "Could not override" in text or "Could not delete" in text:
            return f"unknown config key '{key}'{_closest(key, known)}"
        return f"config key '{key}': {text.splitlines()[0]}"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"bad override ({' '.join(overrides)}): {first}"


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def require(cfg: DictConfig, key: str) -> Any:
    """The value at `key`, or a UserError naming the key when it is unset (??? or null)."""
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException:
        value = None
    if value is None:
        raise UserError(f"config key '{key}' must be set (e.g. {key}=...)")
    return value
