"""Config: OmegaConf groups under conf/ (dflash_ray/conf/, package data: an installed wheel carries its
presets), composed with Hydra's compose API and override grammar, validated against typed dataclasses before
anything else starts. $DFLASH_RAY_CONF points it at another directory of groups (a cluster's own presets).
(Long on purpose: every key of every group, its one default and its line, is the schema, and is read here.)

The dataclasses below hold every key and its one default, each with a line saying what it is. The YAML
under conf/ sets only what differs: conf/config.yaml picks the group options, and each option
(conf/cluster/8gpu.yaml, conf/model/qwen3_8b.yaml, ...) names only the keys whose value differs from the
default (tests/test_config_defaults.py). Hydra composes the YAML and the overrides; the schema's defaults
fill in every key the YAML leaves out (an override of such a key is applied as `++key=value`).

Every check of the config's own values is made here, when the config is composed: unknown keys
(`a.typo=1`), wrong types (`train.lr=abc`), choices (CHOICES), minimums (MINIMUM) and the rules between
keys (`_check_rules`: bucket boundaries vs the batch budget, by check_plan_rules, which the plan's
PlanSpec.validate calls too; the flight window vs the batches of one step; ...) raise UserError with one line that names the key (and the
closest known one). Values are typed once, here: whatever reads the composed config (or the dataclasses)
gets ints, floats, bools and strs and casts nothing. What needs the data or the target (vocabulary sizes,
layer ids against the target's depth) is checked where those are read (runtime/spec.py). The typed
groups (model, data, cluster, train, ...) take no new keys: nothing would read them. `+name=value` adds a
key at the root (for your own interpolations: `+corpus=/data data.shards=${corpus}/shards`).
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from dflash_ray.errors import UserError
from dflash_ray.required import require  # noqa: F401  (re-exported: config.require, the value at a key or one line naming it)

CONF_DIR = Path(os.environ.get("DFLASH_RAY_CONF", Path(__file__).resolve().parent / "conf"))


# ----------------------------------------------------------------------------- typed schema
# The defaults are the DFlash recipe's (the real presets and data share them); the embedded demo's options
# (model=tiny, data=synthetic, cluster=local) set their own values for what they do differently.
@dataclass
class ModelConfig:
    name: str = "tiny"                           # the preset's name (recorded with the run)
    target_path: Optional[str] = None            # the target's Hugging Face directory (or hub id); null: built from target_config
    target_config: Dict[str, Any] = field(default_factory=dict)  # the target's config fields: a synthetic target's (target_path null), or a preset's copy of its real target's shape for `plan` before a download
    num_draft_layers: int = 5                    # drafter decoder layers
    target_layer_ids: Optional[List[int]] = None  # target layers tapped for features (null: round(1 + i*(L-4)/(n-1)))
    block_size: int = 16                         # tokens per draft block (the anchor and its B-1 masked positions)
    mask_token_id: Optional[int] = None          # null: the tokenizer's mask token, else a reserved id past its vocabulary
    num_anchors: int = 512                       # anchors (draft blocks) per row at most
    # the drafter's budget: block tokens (anchors x block_size) a batch trains at most; the plan cuts batches of
    # short, dense rows smaller so every row keeps the recipe's density (null: no bound: memory grows with it)
    max_block_tokens_per_batch: Optional[int] = None
    anchors_per_batch: Optional[int] = None      # thinning: blocks per batch over all its rows, fewer than they hold (null: none)
    loss_gamma: Optional[float] = None           # loss decay over a block's positions (null: 7 for B=16, 5 for B=10, 4 for B=8)
    drafter_intermediate_size: Optional[int] = None     # drafter MLP width (null: the target's intermediate_size)
    drafter_num_attention_heads: Optional[int] = None   # drafter heads (null: the target's); head_dim stays the target's
    drafter_num_key_value_heads: Optional[int] = None   # drafter key/value heads (null: the target's)
    init_from: Optional[str] = None              # an exported drafter to start from (step 0 only; its shape must match)
    # the target's forwards (training, regeneration) and the drafter's autocast (null: bfloat16 on GPUs; on CPUs
    # bfloat16 where this processor multiplies bf16 fast, measured once per machine (dflash_ray/processor.py:
    # ~4x with AMX, 58x slower on an AVX2-only one), else float32); eval stays float32 on CPUs
    compute_dtype: Optional[str] = None


@dataclass
class SyntheticConfig:
    num_conversations: int = 600     # conversations of the generated corpus (data.input null)
    min_tokens: int = 48             # conversation lengths, about min..max tokens (log-normal, long-tailed)
    max_tokens: int = 512            # (see min_tokens)
    target_steps: int = 1200         # train the synthesised target this many steps on the corpus (0: random)
    regenerate: bool = True          # train the drafter on the target's own answers (dflash-ray regenerate)
    # walks: word-cycle conversations a tiny target learns in seconds (the demo); instructions: real
    # instruction prompts (data/instructions.py) for a real target to answer (held-out kinds and topics apart)
    corpus: str = "walks"
    heldout_prompts: int = 16        # prompts of a held-out corpus in <run.dir>/heldout.jsonl (tau)
    # the world built once per machine and copied into each run (keyed by its config and seed; no tokenizer or
    # target given): <cache_dir>/<key>/, cache_dir null: $DFLASH_RAY_CACHE/demo-worlds, else ~/.cache/dflash-ray/demo-worlds
    cache: bool = True
    cache_dir: Optional[str] = None


@dataclass
class DataConfig:
    input: Optional[str] = None      # conversations (.jsonl/.json/.parquet, dir, glob) for `prepare`; null: a synthetic corpus
    tokenizer: Optional[str] = None  # tokenizer directory; null: one trained on the synthetic corpus
    output: Optional[str] = "${run.dir}/shards"   # where `prepare` writes parquet shards
    shards: Optional[str] = "${data.output}"      # where `plan` and training read them
    prompts: Optional[str] = None    # prompts .jsonl for `eval` and the main job's held-out tau (null: <shards>/heldout.jsonl if any)
    # share of the conversations (by id) `prepare` keeps out of the shards; their prompts go to <output>/heldout.jsonl
    # and the main job reports tau on them (0: none held out)
    heldout_fraction: float = 0.01
    shard_size: int = 10000          # samples per parquet shard
    vocab_size: Optional[int] = None  # when known, token ids >= vocab_size are rejected
    # upper bounds (inclusive) of the length buckets (the seed run's six)
    bucket_boundaries: List[int] = field(default_factory=lambda: [512, 1024, 1536, 2304, 3296, 8192])
    max_tokens_per_batch: int = 16384  # the target's budget: padded tokens (rows x longest row) per batch
    overlong: str = "truncate"       # samples over the last boundary: truncate | drop
    interleave: str = "default"      # order of the buckets' batches: default | stride | sequential | random | diversity
    chunk_batches: int = 64          # batches formed per length-sorted chunk (more: less padding, less mixing)
    # La: the row length where a token's attention work equals its linear work; fewer rows for long-row batches
    # so every bucket's batch costs the target about the same (null: from the target's shape by FLOP count;
    # 0: token budget only)
    attention_tokens: Optional[float] = None
    format: str = "auto"             # prepare's input rows: auto | sharegpt | openai | conversations (auto: per row)
    on_bad_row: str = "fail"         # prepare: fail (one line naming file and row) | skip (counted by reason)
    turns: str = "all"               # history-rewriting templates (Qwen3): a row per assistant turn (all) or the last only
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # the served template's arguments, e.g. {enable_thinking: false}
    prepare_engine: str = "local"    # prepare: local (one process) | ray (a Ray Data job on cluster.*: for large inputs)
    prepare_rows_per_task: int = 2000  # ray: conversations per task
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)  # the generated corpus (data.input null)


@dataclass
class CpuThreadsConfig:              # torch's threads per process kind on CPUs (dflash_ray/threads.py: measured)
    driver: Optional[int] = None     # the job's own compute (the demo target's training); null: every core
    regenerate: int = 1              # a regeneration actor (generate: small matmuls, one token a step per row)
    target: int = 1                  # a target actor during training (beside the trainers)
    trainer: int = 1                 # a Ray Train drafter worker (beside the target actors)
    evaluate: int = 1                # held-out tau tasks (speculative decoding: a token or a block a forward)


@dataclass
class ClusterConfig:
    name: str = "local"              # the option's name (recorded with the run)
    address: Optional[str] = None    # Ray address: auto (a running cluster) | null ($RAY_ADDRESS, else a local Ray)
    num_cpus: Optional[int] = 4      # logical CPUs of a local Ray (oversubscribed on purpose: Ray Data starves otherwise)
    object_store_memory: Optional[int] = None  # bytes of a local Ray's object store (null: Ray's default)
    use_gpu: bool = False            # GPUs for the target actors and drafter workers (false: CPU, gloo DDP)
    target_workers: int = 1          # target actors (one per target GPU)
    drafter_workers: int = 2         # Ray Train workers (one per drafter GPU)
    target_resource: str = "target_slot"  # custom resource each target actor takes when use_gpu is false
    target_gpus: float = 1.0         # GPU share of each target actor (use_gpu; < 1 shares a GPU)
    # GPUs one target replica spans: its layers split over that many actors on one node, each with a target
    # actor's share, in a pipeline (model/target.py load_target_stage, replica_features; a 70B target on 80 GB GPUs)
    target_gpus_per_replica: int = 1
    drafter_gpus: float = 1.0        # GPU share of each drafter worker (use_gpu; < 1 shares a GPU)
    max_batches_in_flight: int = 4   # plan batches between the target actors and the trainers at most
    nodes: int = 1                   # nodes the cluster has (the capacity model's per-node split; the runtime sees them)
    token_block_mb: float = 8.0      # the token store's blocks (Ray Data, in the object stores): the transfer unit
    token_cache_mb: float = 256.0    # blocks each join process keeps (LRU)
    stream_block_mb: float = 32.0    # Ray Data blocks of the stream: as many plan batches as fit (0: one a block)
    device_memory_gb: float = 139.0  # GiB per GPU, as torch.cuda reports it (H200: ~139); the memory model's bound
    # measured rates for the capacity model (plan), each side in its unit (null: a measured run's summary, else
    # the seed run): the target's context tokens/s per device, the drafter's trained block tokens/s per device
    target_tokens_per_gpu: Optional[float] = None
    drafter_block_tokens_per_gpu: Optional[float] = None
    cpu_threads: CpuThreadsConfig = field(default_factory=CpuThreadsConfig)


@dataclass
class TrainConfig:
    epochs: int = 1                  # passes over the data (every model option sets its own)
    max_steps: Optional[int] = None  # stop early after this many optimizer steps (null: all epochs)
    lr: float = 6e-4                 # AdamW's peak learning rate
    weight_decay: float = 0.0        # AdamW's weight decay
    warmup_ratio: float = 0.04       # share of the steps with a linear warm-up (then cosine decay)
    grad_clip: float = 1.0           # gradient norm clip
    grad_accum: int = 1              # optimizer step = drafter_workers x grad_accum consecutive plan batches
    checkpoint_every: Optional[int] = None          # optimizer steps (0/null: off); also at each epoch's end and the end
    checkpoint_every_minutes: Optional[float] = 30.0  # rank 0's clock since the last checkpoint (0/null: off)
    checkpoint_upload: str = "async"               # async: Ray Train uploads while training goes on; sync: waits
    num_to_keep: int = 2             # checkpoints kept
    max_failures: int = 3            # worker-group restarts (from the last checkpoint) before the run fails
    # Ray Data stream blocks per stream (~25 KB of split-coordinator state each); longer runs train as fits of
    # this many blocks, each resuming from the last one's checkpoint; 0: one stream
    stream_segment_blocks: int = 50000
    max_nonfinite_steps: int = 10    # stop after this many NaN/Inf steps in a row (skipped, counted; 0: never stop)
    storage_path: Optional[str] = None  # Ray Train storage (null: <run.dir>/ray_train; shared on multi-node)
    tensorboard: bool = False        # the older switch: the same as adding tensorboard to trackers
    trackers: Optional[List[str]] = None   # any of tensorboard, mlflow, wandb (null/[]: metrics.jsonl only)
    tracker_project: str = "dflash-ray"    # MLflow experiment / W&B project
    mlflow_tracking_uri: Optional[str] = None  # null: $MLFLOW_TRACKING_URI, else sqlite:///<run.root>/mlflow.db
    wandb_mode: Optional[str] = None       # online | offline | disabled; null: $WANDB_MODE, else online when logged in
    heldout_every: int = 0           # held-out tau every N steps during training (0: only after training)
    compile: bool = True             # CUDA: torch.compile the drafter's layers (flex attention fuses in them)
    # the drafter across ranks: ddp (whole on each) | fsdp (sharded) | auto (ddp when the memory model says
    # the step fits the drafter's GPU share, else fsdp)
    parallelism: str = "auto"
    recompute_layers: bool = False  # activation checkpointing of the drafter's layers: recompute in backward
    # the target's features: online (every epoch through the target actors) | hybrid (each sample's computed
    # once, cached on the node, read back after) | offline (hybrid, every sample computed first, before the
    # drafter starts, on every target slot) | auto (hybrid for runs of 2+ epochs whose cache fits; the real
    # presets' choice). Online by default: the
    # cache's features equal online's up to float rounding (another batch shape), and the embedded default's
    # runs stay bit for bit reproducible
    features: str = "online"
    feature_cache_dir: Optional[str] = None   # node-local (null: $DFLASH_RAY_CACHE/features, ~/.cache/dflash-ray)
    feature_cache_gb: float = 64.0            # the cache's disk budget per node: over it, a run stays online
    # the drafter's label: ce (the next token, hard) | distill (the target's next-token distribution, its
    # top-k renormalised, computed by the target actors beside the features and cached with them)
    loss: str = "ce"
    distill_top_k: int = 8           # distill: the target's most likely tokens kept per position
    distill_hard_weight: float = 0.0  # distill: the hard label's share of each slot's label (0: pure distillation)


@dataclass
class RunConfig:
    name: str = "default"            # the run's name: its directory, its Ray Train experiment
    root: str = "runs"               # where run directories live
    dir: str = "${run.root}/${run.name}"  # the run's directory (record, shards, exports)


@dataclass
class PlanConfig:
    epoch: int = 0                   # the epoch the `plan` command lays out


@dataclass
class EvalConfig:                    # prompts rendered with data.chat_template_kwargs, as prepare renders
    max_new_tokens: int = 64         # tokens generated per prompt (`dflash-ray eval`, the held-out tau)
    max_prompts: int = 32            # prompts of data.prompts evaluated at most
    # the held-out evaluations during training (train.heldout_every) measure the first N of those prompts, the
    # final one all of them (null: all): on a CPU an evaluation shares the cores with training
    during_training_prompts: Optional[int] = None


@dataclass
class RegenerateConfig:              # renders with data.chat_template_kwargs: give prepare the same
    output: Optional[str] = None     # the regenerated conversations .jsonl
    # tokens per assistant turn at most: the recipe's longest bucket (data.bucket_boundaries), where training
    # rows are cut anyway; thinking answers run to thousands of tokens, and greedy thinking can loop
    max_new_tokens: int = 8192
    on_max_tokens: str = "drop"      # a turn that hits max_new_tokens: drop (it and the rest of its conversation) | keep
    batch_size: int = 32             # conversations per generate() call on a target actor (continuous: rows in flight)
    # batched: generate() over batches of like-length prompts, each running to its longest row; continuous:
    # transformers' continuous batching, a finished row's slot taken by the next prompt (model/generation.py)
    engine: str = "batched"


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0                    # seeds the plan's order, the synthetic world and the drafter's initialisation
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    drafter: Optional[str] = None    # `dflash-ray eval`: an exported drafter directory
    target: Optional[str] = None     # `dflash-ray eval`: a Hugging Face target directory
    eval: EvalConfig = field(default_factory=EvalConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


# the choices the data layer reads (data/formats.py, data/interleave.py): here, below the data layer, so the
# config checks them at composition without importing it
FORMATS = ("auto", "sharegpt", "openai", "conversations")
ON_BAD_ROW = ("fail", "skip")
STRATEGIES = ("default", "stride", "sequential", "random", "diversity")   # data/interleave.py's orders
ENGINES = ("batched", "continuous")   # regeneration's (model/generation.py Regenerator)

CHOICES = {"data.overlong": ("truncate", "drop"), "data.format": FORMATS, "data.on_bad_row": ON_BAD_ROW,
           "data.turns": ("all", "last"), "data.prepare_engine": ("local", "ray"), "data.interleave": STRATEGIES,
           "train.checkpoint_upload": ("async", "sync"), "train.parallelism": ("auto", "ddp", "fsdp"),
           "train.features": ("auto", "online", "hybrid", "offline"), "train.loss": ("ce", "distill"), "regenerate.on_max_tokens": ("drop", "keep"),
           "regenerate.engine": ENGINES,
           "data.synthetic.corpus": ("walks", "instructions"), "model.compute_dtype": (None, "bfloat16", "float32")}
MINIMUM = {"model.block_size": 2, "model.num_draft_layers": 1, "model.num_anchors": 1, "model.anchors_per_batch": 1,
           "model.max_block_tokens_per_batch": 1,
           "model.drafter_intermediate_size": 1, "model.drafter_num_attention_heads": 1,
           "model.drafter_num_key_value_heads": 1,
           "data.shard_size": 1, "data.max_tokens_per_batch": 1, "data.chunk_batches": 1, "data.attention_tokens": 0,
           "data.prepare_rows_per_task": 1, "data.synthetic.target_steps": 0, "data.synthetic.heldout_prompts": 0,
           "cluster.target_workers": 1, "cluster.drafter_workers": 1, "cluster.target_gpus_per_replica": 1, "cluster.target_gpus": 0.01,
           "cluster.drafter_gpus": 0.01, "cluster.max_batches_in_flight": 1, "cluster.nodes": 1,
           "cluster.stream_block_mb": 0, "cluster.device_memory_gb": 0.1, "train.feature_cache_gb": 0,
           "data.heldout_fraction": 0.0, "train.epochs": 1, "train.lr": 0.0, "train.warmup_ratio": 0.0, "train.grad_accum": 1,
           "train.checkpoint_every": 0, "train.checkpoint_every_minutes": 0.0, "train.num_to_keep": 1,
           "train.max_failures": 0, "train.stream_segment_blocks": 0, "train.max_nonfinite_steps": 0,
           "train.heldout_every": 0, "train.distill_top_k": 1, "train.distill_hard_weight": 0.0,
           "eval.max_new_tokens": 1, "eval.during_training_prompts": 1, "regenerate.max_new_tokens": 1, "regenerate.batch_size": 1}
# what the least value means, where it means more than a number (said with the minimum)
AT_LEAST = {"data.attention_tokens": "0: no attention term", "cluster.stream_block_mb": "0: one plan batch a block",
            "train.stream_segment_blocks": "0: one stream for the whole run", "train.max_nonfinite_steps": "0: never stop"}


# ----------------------------------------------------------------------------- composition
def compute_dtype(cfg) -> str:
    """model.compute_dtype answered (see `compute_dtype_why`)."""
    return compute_dtype_why(cfg)[0]


def compute_dtype_why(cfg) -> tuple[str, str]:
    """(model.compute_dtype answered, why): the user's value, else bfloat16 on GPUs, else what this processor
    computes fast (dflash_ray/processor.py: measured once per machine)."""
    if cfg.model.compute_dtype:
        return cfg.model.compute_dtype, "model.compute_dtype"
    if cfg.cluster.use_gpu:
        return "bfloat16", "GPUs compute in bfloat16"
    from dflash_ray.processor import cpu_compute_dtype

    return cpu_compute_dtype()


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


# keys renamed, with their new names: an old config gets the new name in its error line
RENAMED = {"train.checkpoint_layers": "train.recompute_layers",        # activation recompute, not checkpoints
           "train.stream_window_rows": "train.stream_segment_blocks",  # "window" is the flight window's word
           # the bound is on what grows (Ray Data's state per block), not on rows (64 tiny ones share a block)
           "train.stream_segment_rows": "train.stream_segment_blocks",
           # the drafter's rate is in its own unit now (context tokens/s depends on the plan's density)
           "cluster.drafter_tokens_per_gpu": "cluster.drafter_block_tokens_per_gpu"}


def _closest(key: str, known: List[str]) -> str:
    if key in RENAMED:
        return f" (renamed: use '{RENAMED[key]}')"
    best = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not best:  # compare last components, e.g. `train.lrr` vs `train.lr`
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in known}
        m = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
        best = [leaves[m[0]]] if m else []
    return f" (did you mean '{best[0]}'?)" if best else ""


def _known_keys() -> List[str]:
    """The schema's keys and those the default YAML adds inside them (model.target_config.*)."""
    schema = OmegaConf.structured(RootConfig)
    OmegaConf.set_struct(schema, False)
    return _flat_keys(OmegaConf.merge(schema, _compose_raw([])))


def _compose_raw(overrides: List[str]) -> DictConfig:
    """dflash_ray/conf/config.yaml with its options and the overrides, untyped: only the keys the YAML names (the
    schema's defaults are merged in by compose_config). For the user every key of the schema exists: an
    override of a key the YAML leaves at its default is applied as `++key=value` (set or add), and `~key`
    of such a key deletes what the YAML set, if anything (the key then takes the schema's default)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    hydra_overrides, deletes = _typed_overrides(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=hydra_overrides)
    with open_dict(cfg):
        for key in deletes:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if isinstance(node, DictConfig) and leaf in node.keys():  # `in node` is False for `???`
                del node[leaf]
    return cfg


def _schema_keys(node: DictConfig | None = None, prefix: str = "") -> List[str]:
    """The keys the schema types: every field that is not a group (a dataclass) of its own."""
    node = OmegaConf.structured(RootConfig) if node is None else node
    keys = []
    for k in node.keys():
        child = node._get_node(k)
        if isinstance(child, DictConfig) and is_dataclass(child._metadata.object_type):
            keys.extend(_schema_keys(child, f"{prefix}{k}."))
        else:
            keys.append(f"{prefix}{k}")
    return keys


def _typed_overrides(overrides: List[str]) -> tuple[List[str], List[str]]:
    """(the overrides for Hydra, the schema's keys to delete after it): `key=value` of a schema key as
    `++key=value` (the YAML may leave the key out), `~key` of a schema key taken out; anything else as given
    (group choices, `+new=1`, unknown keys: Hydra names those)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # Hydra's compose raises the same error, explained by _explain_compose_error
        return list(overrides), []
    typed = set(_schema_keys())
    kept, deletes = [], []
    for o, line in zip(parsed, overrides):
        key = o.key_or_group if o.package is None else None
        if key in typed and o.type == OverrideType.CHANGE:
            kept.append(f"++{line}")
        elif key in typed and o.type == OverrideType.DEL and o.value() is None:
            deletes.append(key)
        else:
            kept.append(line)
    return kept, deletes


KNOWN_TRACKERS = ("tensorboard", "mlflow", "wandb")   # train.trackers' choices (runtime/record/trackers.py)


def chosen_trackers(train) -> list[str]:
    """The trackers a train config asks for: train.trackers, plus tensorboard when the older
    `train.tensorboard: true` is set (an alias). Names checked (UserError naming train.trackers)."""
    names = list(getattr(train, "trackers", None) or [])
    if getattr(train, "tensorboard", False):
        names.append("tensorboard")
    out = []
    for n in names:
        n = str(n).strip().lower()
        if n not in KNOWN_TRACKERS:
            raise UserError(f"config key 'train.trackers': '{n}' is not one of {', '.join(KNOWN_TRACKERS)}")
        if n not in out:
            out.append(n)
    return out


def compose_config(overrides: List[str] | None = None) -> DictConfig:
    """Compose dflash_ray/conf/config.yaml with Hydra overrides, validate types, return a resolved DictConfig."""
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
            raise UserError(f"config key '{key}': '{value}' is not one of {', '.join(map(str, allowed))}")
    for key, least in MINIMUM.items():
        value = OmegaConf.select(merged, key, default=None)
        if isinstance(value, (int, float)) and value < least:
            meaning = f" ({AT_LEAST[key]})" if key in AT_LEAST else ""
            raise UserError(f"config key '{key}': must be >= {least}{meaning}, got {value}")
    _check_rules(merged)
    return merged  # `???` values stay missing; `require()` names them where they are needed


def check_plan_rules(boundaries, max_tokens_per_batch: int, block_size: int,
                     max_block_tokens_per_batch: int | None, step_batches: int) -> None:
    """The rules between the plan's keys (at composition, and data/plan.py PlanSpec.validate for a plan made
    without a config); the keys' own minimums are MINIMUM."""
    b = list(boundaries)
    if not b or any(x <= 0 for x in b) or any(y <= x for x, y in zip(b, b[1:])):
        raise UserError(f"config key 'data.bucket_boundaries': must be positive and ascending, got {b}")
    if max_block_tokens_per_batch is not None and max_block_tokens_per_batch < block_size:
        raise UserError(f"config key 'model.max_block_tokens_per_batch': {max_block_tokens_per_batch} is "
                        f"smaller than one block (model.block_size {block_size})")
    if step_batches < 1:
        raise UserError(f"the plan's batches per step must be >= 1, got {step_batches}")
    if max_tokens_per_batch < b[-1]:
        raise UserError(
            f"config key 'data.max_tokens_per_batch': {max_tokens_per_batch} is smaller than the last "
            f"bucket boundary {b[-1]}, so the longest samples fit in no batch")


def _check_rules(cfg: DictConfig) -> None:
    """Rules between keys (and choices a table does not say)."""
    c, t = cfg.cluster, cfg.train
    check_plan_rules(cfg.data.bucket_boundaries, cfg.data.max_tokens_per_batch, cfg.model.block_size,
                     cfg.model.max_block_tokens_per_batch, c.drafter_workers * t.grad_accum)
    if cfg.data.heldout_fraction >= 1:
        raise UserError(f"config key 'data.heldout_fraction': {cfg.data.heldout_fraction} would hold out every "
                        "conversation (a share below 1; 0: none)")
    if t.distill_hard_weight > 1:
        raise UserError(f"config key 'train.distill_hard_weight': {t.distill_hard_weight} is the hard label's share "
                        "of each label, between 0 and 1")
    if t.loss == "distill" and c.target_gpus_per_replica > 1:
        raise UserError("config key 'train.loss': distill needs each target replica in one process "
                        "(cluster.target_gpus_per_replica 1): the soft labels come from the target's head")
    if not t.checkpoint_every and not t.checkpoint_every_minutes:
        raise UserError("config key 'train.checkpoint_every_minutes': checkpoints are off (it and "
                        "train.checkpoint_every are both 0/null): set one of them (a restart would retrain "
                        "whole epochs)")
    chosen_trackers(t)  # unknown tracker names
    if t.wandb_mode is not None and t.wandb_mode not in ("online", "offline", "disabled"):
        raise UserError(f"config key 'train.wandb_mode': '{t.wandb_mode}' is not one of online, offline, disabled")
    per_step = c.drafter_workers * t.grad_accum
    if c.max_batches_in_flight < per_step:
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
