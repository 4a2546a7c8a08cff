"""Config: OmegaConf groups under conf/ (dflash_ray/conf/, package data: an installed wheel carries its
presets), composed with Hydra's compose API and override grammar, validated against typed dataclasses before
anything else starts. $DFLASH_RAY_CONF points it at another directory of groups (a cluster's own presets).
(Long on purpose: every key of every group, its one default and its line, is the schema, and is read here.)

The dataclasses below hold every key: its one default, a line saying what it is and what composition
accepts of it (`knob`: choices, a minimum), which `dflash-ray config` and docs/configuration.md print. The YAML
under conf/ sets only what differs: conf/config.yaml picks the group options, and each option
(conf/cluster/8gpu.yaml, conf/model/qwen3_8b.yaml, ...) names only the keys whose value differs from the
default (tests/test_config_defaults.py). Hydra composes the YAML and the overrides; the schema's defaults
fill in every key the YAML leaves out (an override of such a key is applied as `++key=value`).

Every check of the config's own values is made here, when the config is composed: unknown keys
(`a.typo=1`), wrong types (`train.lr=abc`), choices and minimums (the knobs'; CHOICES, MINIMUM) and the rules between
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
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from dflash_ray.errors import UserError
from dflash_ray.required import require  # noqa: F401  (re-exported: config.require, the value at a key or one line naming it)

CONF_DIR = Path(os.environ.get("DFLASH_RAY_CONF", Path(__file__).resolve().parent / "conf"))


# ----------------------------------------------------------------------------- the schema's own vocabulary
_NO_DEFAULT = object()


def knob(default: Any = _NO_DEFAULT, doc: str = "", *, factory=None, choices: tuple | None = None,
         minimum: float | None = None, at_least: str | None = None):
    """A key of the typed schema: its one default (`factory` for a mutable one), what it is (the line
    `dflash-ray config` and docs/configuration.md print), and what composition checks of its value: one of
    `choices`, at least `minimum` (`at_least`: what that least value means, where it means more than a number)."""
    meta = {"doc": doc, "choices": choices, "minimum": minimum, "at_least": at_least}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    assert default is not _NO_DEFAULT, "a knob needs a default or a factory"
    return field(default=default, metadata=meta)


def group(cls, doc: str = ""):
    """A group of keys (a dataclass of its own) inside another, with its line."""
    return field(default_factory=cls, metadata={"doc": doc})


# the choices the data layer reads (data/formats.py, data/interleave.py): here, below the data layer, so the
# config checks them at composition without importing it
FORMATS = ("auto", "sharegpt", "openai", "conversations")
ON_BAD_ROW = ("fail", "skip")
STRATEGIES = ("default", "stride", "sequential", "random", "diversity")   # data/interleave.py's orders
# regeneration's: transformers in the job's own actors (model/generation.py Regenerator), any OpenAI-compatible
# server (model/http_engine.py), vLLM or SGLang as Ray Data LLM stages (runtime/jobs/regenerate.py)
ENGINES = ("batched", "continuous", "http", "vllm", "sglang")


# ----------------------------------------------------------------------------- typed schema
# The defaults are the DFlash recipe's (the real presets and data share them); the embedded demo's options
# (model=tiny, data=synthetic, cluster=local) set their own values for what they do differently.
@dataclass
class ModelConfig:
    name: str = knob("tiny", "the preset's name (recorded with the run)")
    target_path: Optional[str] = knob(None,
        doc="the target's Hugging Face directory (or hub id); null: built from target_config")
    target_config: Dict[str, Any] = knob(factory=dict,
        doc="the target's config fields: a synthetic target's (target_path null), or a preset's copy of its real "
            "target's shape for `plan` before a download")
    num_draft_layers: int = knob(5, 'drafter decoder layers', minimum=1)
    target_layer_ids: Optional[List[int]] = knob(None,
        doc='target layers tapped for features (null: round(1 + i*(L-4)/(n-1)))')
    block_size: int = knob(16, 'tokens per draft block (the anchor and its B-1 masked positions)', minimum=2)
    mask_token_id: Optional[int] = knob(None,
        doc="null: the tokenizer's mask token, else a reserved id past its vocabulary")
    num_anchors: int = knob(512, 'anchors (draft blocks) per row at most', minimum=1)
    max_block_tokens_per_batch: Optional[int] = knob(None, minimum=1,
        doc="the drafter's budget: block tokens (anchors x block_size) a batch trains at most; the plan cuts "
            "batches of short, dense rows smaller so every row keeps the recipe's density (null: no bound: memory "
            'grows with it)')
    anchors_per_batch: Optional[int] = knob(None, minimum=1,
        doc='thinning: blocks per batch over all its rows, fewer than they hold (null: none)')
    loss_gamma: Optional[float] = knob(None,
        doc="loss decay over a block's positions (null: 7 for B=16, 5 for B=10, 4 for B=8)")
    drafter_intermediate_size: Optional[int] = knob(None, minimum=1,
        doc="drafter MLP width (null: the target's intermediate_size)")
    drafter_num_attention_heads: Optional[int] = knob(None, minimum=1,
        doc="drafter heads (null: the target's); head_dim stays the target's")
    drafter_num_key_value_heads: Optional[int] = knob(None, "drafter key/value heads (null: the target's)", minimum=1)
    init_from: Optional[str] = knob(None, 'an exported drafter to start from (step 0 only; its shape must match)')
    compute_dtype: Optional[str] = knob(None, choices=(None, 'bfloat16', 'float32'),
        doc="the target's forwards (training, regeneration) and the drafter's autocast (null: bfloat16 on GPUs; "
            'on CPUs bfloat16 where this processor multiplies bf16 fast, measured once per machine '
            '(dflash_ray/processor.py: ~4x with AMX, 58x slower on an AVX2-only one), else float32); eval stays '
            'float32 on CPUs')


@dataclass
class SyntheticConfig:
    num_conversations: int = knob(600, 'conversations of the generated corpus (data.input null)')
    min_tokens: int = knob(48, 'conversation lengths, about min..max tokens (log-normal, long-tailed)')
    max_tokens: int = knob(512, 'conversation lengths: the upper end (see min_tokens)')
    target_steps: int = knob(1200, minimum=0,
        doc='train the synthesised target this many steps on the corpus (0: random)')
    regenerate: bool = knob(True, "train the drafter on the target's own answers (dflash-ray regenerate)")
    corpus: str = knob("walks", choices=('walks', 'instructions'),
        doc='walks: word-cycle conversations a tiny target learns in seconds (the demo); instructions: real '
            'instruction prompts (data/instructions.py) for a real target to answer (held-out kinds and topics '
            'apart)')
    heldout_prompts: int = knob(16, 'prompts of a held-out corpus in <run.dir>/heldout.jsonl (tau)', minimum=0)
    cache: bool = knob(True, "build the world once per machine and copy it into each run (keyed by its config and "
                             "seed; when no tokenizer or target is given)")
    cache_dir: Optional[str] = knob(None, "where the worlds are kept, <cache_dir>/<key>/ (null: "
                                          "$DFLASH_RAY_CACHE/demo-worlds, else ~/.cache/dflash-ray/demo-worlds)")


@dataclass
class DataConfig:
    input: Optional[str] = knob(None,
        doc='conversations (.jsonl/.json/.parquet, dir, glob) for `prepare`; null: a synthetic corpus')
    tokenizer: Optional[str] = knob(None, 'tokenizer directory; null: one trained on the synthetic corpus')
    output: Optional[str] = knob("${run.dir}/shards", 'where `prepare` writes parquet shards')
    shards: Optional[str] = knob("${data.output}", 'where `plan` and training read them')
    prompts: Optional[str] = knob(None,
        doc="prompts .jsonl for `eval` and the main job's held-out tau (null: <shards>/heldout.jsonl if any)")
    heldout_fraction: float = knob(0.01, minimum=0.0,
        doc='share of the conversations (by id) `prepare` keeps out of the shards; their prompts go to '
            '<output>/heldout.jsonl and the main job reports tau on them (0: none held out)')
    shard_size: int = knob(10000, 'samples per parquet shard', minimum=1)
    vocab_size: Optional[int] = knob(None, 'when known, token ids >= vocab_size are rejected')
    bucket_boundaries: List[int] = knob(factory=lambda: [512, 1024, 1536, 2304, 3296, 8192],
        doc="upper bounds (inclusive) of the length buckets (the recipe's six, up to 8K tokens)")
    max_tokens_per_batch: int = knob(16384, minimum=1,
        doc="the target's budget: padded tokens (rows x longest row) per batch")
    overlong: str = knob("truncate", 'samples over the last boundary: truncate | drop', choices=('truncate', 'drop'))
    interleave: str = knob("default", choices=STRATEGIES,
        doc="order of the buckets' batches: default | stride | sequential | random | diversity")
    chunk_batches: int = knob(64, minimum=1,
        doc='batches formed per length-sorted chunk (more: less padding, less mixing)')
    attention_tokens: Optional[float] = knob(None, minimum=0, at_least='0: no attention term',
        doc="La: the row length where a token's attention work equals its linear work; fewer rows for long-row "
            "batches so every bucket's batch costs the target about the same (null: from the target's shape by "
            'FLOP count; 0: token budget only)')
    format: str = knob("auto", choices=FORMATS,
        doc="prepare's input rows: auto | sharegpt | openai | conversations (auto: per row)")
    on_bad_row: str = knob("fail", choices=ON_BAD_ROW,
        doc='prepare: fail (one line naming file and row) | skip (counted by reason)')
    turns: str = knob("all", choices=('all', 'last'),
        doc='history-rewriting templates (Qwen3): a row per assistant turn (all) or the last only')
    chat_template_kwargs: Optional[Dict[str, Any]] = knob(None,
        doc="the served template's arguments, e.g. {enable_thinking: false}")
    prepare_engine: str = knob("local", choices=('local', 'ray'),
        doc='prepare: local (one process) | ray (a Ray Data job on cluster.*: for large inputs)')
    prepare_rows_per_task: int = knob(2000, 'ray: conversations per task', minimum=1)
    synthetic: SyntheticConfig = group(SyntheticConfig, 'the generated corpus (data.input null)')


@dataclass
class CpuThreadsConfig:
    """torch's threads per process kind on CPUs (dflash_ray/threads.py: measured)"""
    driver: Optional[int] = knob(None, "the job's own compute (the demo target's training); null: every core")
    regenerate: int = knob(1, 'a regeneration actor (generate: small matmuls, one token a step per row)')
    target: int = knob(1, 'a target actor during training (beside the trainers)')
    trainer: int = knob(1, 'a Ray Train drafter worker (beside the target actors)')
    evaluate: int = knob(1, 'held-out tau tasks (speculative decoding: a token or a block a forward)')


@dataclass
class ClusterConfig:
    name: str = knob("local", "the option's name (recorded with the run)")
    address: Optional[str] = knob(None,
        doc='Ray address: auto (a running cluster) | null ($RAY_ADDRESS, else a local Ray)')
    num_cpus: Optional[int] = knob(4,
        doc='logical CPUs of a local Ray (oversubscribed on purpose: Ray Data starves otherwise)')
    object_store_memory: Optional[int] = knob(None, "bytes of a local Ray's object store (null: Ray's default)")
    use_gpu: bool = knob(False, 'GPUs for the target actors and drafter workers (false: CPU, gloo DDP)')
    target_workers: int = knob(1, 'target actors (one per target GPU)', minimum=1)
    drafter_workers: int = knob(2, 'Ray Train workers (one per drafter GPU)', minimum=1)
    target_resource: str = knob("target_slot", 'custom resource each target actor takes when use_gpu is false')
    target_gpus: float = knob(1.0, 'GPU share of each target actor (use_gpu; < 1 shares a GPU)', minimum=0.01)
    target_gpus_per_replica: int = knob(1, minimum=1,
        doc='GPUs one target replica spans: its layers split over that many actors on one node, each with a '
            "target actor's share, in a pipeline (model/target.py load_target_stage, replica_features; a 70B "
            'target on 80 GB GPUs)')
    drafter_gpus: float = knob(1.0, 'GPU share of each drafter worker (use_gpu; < 1 shares a GPU)', minimum=0.01)
    max_batches_in_flight: int = knob(4, 'plan batches between the target actors and the trainers at most', minimum=1)
    nodes: int = knob(1, minimum=1,
        doc="nodes the cluster has (the capacity model's per-node split; the runtime sees them)")
    token_block_mb: float = knob(8.0, "the token store's blocks (Ray Data, in the object stores): the transfer unit")
    token_cache_mb: float = knob(256.0, 'blocks each join process keeps (LRU)')
    stream_block_mb: float = knob(32.0, minimum=0, at_least='0: one plan batch a block',
        doc='Ray Data blocks of the stream: as many plan batches as fit (0: one a block)')
    device_memory_gb: float = knob(139.0, minimum=0.1,
        doc="GiB per GPU, as torch.cuda reports it (H200: ~139); the memory model's bound")
    target_tokens_per_gpu: Optional[float] = knob(
        None, "the capacity model's (plan) measured rate of the target: context tokens/s per device (null: a "
              "measured run's summary, else a reference 8-GPU Qwen3-8B run's)")
    drafter_block_tokens_per_gpu: Optional[float] = knob(
        None, "the capacity model's measured rate of the drafter: trained block tokens/s per device (null: a "
              "measured run's summary, else a reference 8-GPU Qwen3-8B run's)")
    cpu_threads: CpuThreadsConfig = group(CpuThreadsConfig)


@dataclass
class TrainConfig:
    epochs: int = knob(1, 'passes over the data (every model option sets its own)', minimum=1)
    max_steps: Optional[int] = knob(None, 'stop early after this many optimizer steps (null: all epochs)')
    lr: float = knob(6e-4, "AdamW's peak learning rate", minimum=0.0)
    weight_decay: float = knob(0.0, "AdamW's weight decay")
    warmup_ratio: float = knob(0.04, 'share of the steps with a linear warm-up (then cosine decay)', minimum=0.0)
    grad_clip: float = knob(1.0, 'gradient norm clip')
    grad_accum: int = knob(1, 'optimizer step = drafter_workers x grad_accum consecutive plan batches', minimum=1)
    checkpoint_every: Optional[int] = knob(None, minimum=0,
        doc="optimizer steps (0/null: off); also at each epoch's end and the end")
    checkpoint_every_minutes: Optional[float] = knob(30.0, minimum=0.0,
        doc="rank 0's clock since the last checkpoint (0/null: off)")
    checkpoint_upload: str = knob("async", choices=('async', 'sync'),
        doc='async: Ray Train uploads while training goes on; sync: waits')
    num_to_keep: int = knob(2, 'checkpoints kept', minimum=1)
    max_failures: int = knob(3, 'worker-group restarts (from the last checkpoint) before the run fails', minimum=0)
    stream_segment_blocks: int = knob(50000, minimum=0, at_least='0: one stream for the whole run',
        doc='Ray Data stream blocks per stream (~25 KB of split-coordinator state each); longer runs train as '
            "fits of this many blocks, each resuming from the last one's checkpoint; 0: one stream")
    max_nonfinite_steps: int = knob(10, minimum=0, at_least='0: never stop',
        doc='stop after this many NaN/Inf steps in a row (skipped, counted; 0: never stop)')
    oom_split: Optional[bool] = knob(None,
        doc="a drafter batch that runs out of GPU memory is trained again in 2, 4, ... slices of its rows, at "
            "the whole batch's anchors (the same update); under DDP the gradient all-reduce then runs after every "
            "rank's backward instead of inside it. null: on for GPU workers (DDP or one worker), off on CPUs; "
            "FSDP refuses it (its forward gathers weights: one rank's retry would leave the others waiting)")
    max_skipped_batches: int = knob(3, minimum=0, at_least='0: never stop',
        doc="stop after this many steps in a row whose batch did not fit even as single rows (skipped, "
            "counted: ledger 'skipped': 'oom'; 0: never stop)")
    quarantine_after: int = knob(2, minimum=0, at_least='0: off',
        doc="a plan batch whose training ends its worker group this many times in a row is set aside (ledger "
            "'quarantined', summary.json, quarantine.json) and the run goes on; the restarts count against "
            "train.max_failures. 0: off (the run fails after train.max_failures)")
    storage_path: Optional[str] = knob(None, 'Ray Train storage (null: <run.dir>/ray_train; shared on multi-node)')
    tensorboard: bool = knob(False, 'the older switch: the same as adding tensorboard to trackers')
    trackers: Optional[List[str]] = knob(None, 'any of tensorboard, mlflow, wandb (null/[]: metrics.jsonl only)')
    tracker_project: str = knob("dflash-ray", 'MLflow experiment / W&B project')
    mlflow_tracking_uri: Optional[str] = knob(None, 'null: $MLFLOW_TRACKING_URI, else sqlite:///<run.root>/mlflow.db')
    wandb_mode: Optional[str] = knob(None,
        doc='online | offline | disabled; null: $WANDB_MODE, else online when logged in')
    heldout_every: int = knob(0, 'held-out tau every N steps during training (0: only after training)', minimum=0)
    compile: bool = knob(True, "CUDA: torch.compile the drafter's layers (flex attention fuses in them)")
    parallelism: str = knob("auto", choices=('auto', 'ddp', 'fsdp'),
        doc='the drafter across ranks: ddp (whole on each) | fsdp (sharded) | auto (ddp when the memory model '
            "says the step fits the drafter's GPU share, else fsdp)")
    recompute_layers: bool = knob(False, "activation checkpointing of the drafter's layers: recompute in backward")
    features: str = knob("online", choices=('auto', 'online', 'hybrid', 'offline'),
        doc="the target's features: online (every epoch through the target actors) | hybrid (each sample's "
            'computed once, cached on the node, read back after) | offline (hybrid, every sample computed first, '
            'before the drafter starts, on every target slot) | auto (hybrid for runs of 2+ epochs whose cache '
            "fits; the real presets' choice). Online by default: the cache's features equal online's up to float "
            "rounding (another batch shape), and the embedded default's runs stay bit for bit reproducible")
    feature_cache_dir: Optional[str] = knob(None,
        doc='node-local (null: $DFLASH_RAY_CACHE/features, ~/.cache/dflash-ray)')
    feature_cache_gb: float = knob(64.0, "the cache's disk budget per node: over it, a run stays online", minimum=0)
    loss: str = knob("ce", choices=('ce', 'distill'),
        doc="the drafter's label: ce (the next token, hard) | distill (the target's next-token distribution, its "
            'top-k renormalised, computed by the target actors beside the features and cached with them)')
    distill_top_k: int = knob(8, "distill: the target's most likely tokens kept per position", minimum=1)
    distill_hard_weight: float = knob(0.0, minimum=0.0,
        doc="distill: the hard label's share of each slot's label (0: pure distillation)")


@dataclass
class RunConfig:
    name: str = knob("default", "the run's name: its directory, its Ray Train experiment")
    root: str = knob("runs", 'where run directories live')
    dir: str = knob("${run.root}/${run.name}", "the run's directory (record, shards, exports)")


@dataclass
class PlanConfig:
    epoch: int = knob(0, 'the epoch the `plan` command lays out')


@dataclass
class EvalConfig:
    """prompts rendered with data.chat_template_kwargs, as prepare renders"""
    max_new_tokens: int = knob(64, 'tokens generated per prompt (`dflash-ray eval`, the held-out tau)', minimum=1)
    max_prompts: int = knob(32, 'prompts of data.prompts evaluated at most')
    during_training_prompts: Optional[int] = knob(None, minimum=1,
        doc='the held-out evaluations during training (train.heldout_every) measure the first N of those prompts, '
            'the final one all of them (null: all): on a CPU an evaluation shares the cores with training')


@dataclass
class RegenerateConfig:
    """renders with data.chat_template_kwargs: give prepare the same"""
    output: Optional[str] = knob(None, 'the regenerated conversations .jsonl')
    max_new_tokens: int = knob(8192, minimum=1,
        doc="tokens per assistant turn at most: the recipe's longest bucket (data.bucket_boundaries), where "
            'training rows are cut anyway; thinking answers run to thousands of tokens, and greedy thinking can '
            'loop')
    on_max_tokens: str = knob("drop", choices=('drop', 'keep'),
        doc='a turn that hits max_new_tokens: drop (it and the rest of its conversation) | keep')
    batch_size: int = knob(32, minimum=1,
        doc='conversations per generate() call on a target actor (continuous: rows in flight)')
    engine: str = knob("batched", choices=ENGINES,
        doc='batched: generate() over batches of like-length prompts, each running to its longest row; '
            "continuous: transformers' continuous batching, a finished row's slot taken by the next prompt "
            "(both in the job's own target actors); http: an OpenAI-compatible server you run (regenerate.url); "
            "vllm, sglang: the engine as a Ray Data LLM stage over the cluster's GPUs (pip install "
            "dflash-ray[vllm] or [sglang])")
    url: Optional[str] = knob(None, "http: the server's OpenAI-compatible base URL, e.g. http://host:8000/v1 (its "
                                    "/completions answers the prompts)")
    served_model: Optional[str] = knob(None, "http: the model name the server serves (null: the first of its /models)")
    api_key_env: str = knob("OPENAI_API_KEY", "http: the environment variable that holds the server's API key, sent "
                                              "as a bearer token (never in a config file or a log); unset: none sent")
    concurrency: int = knob(8, "http: requests in flight per actor (vllm, sglang: one engine replica per GPU, or per "
                              "tensor x pipeline parallel GPUs)", minimum=1)
    max_retries: int = knob(5, "http: retries, with backoff, of a request the server answered 429 or 5xx or could "
                               "not be reached at", minimum=0)
    timeout_s: float = knob(600.0, "http: seconds one request may take", minimum=1.0)
    temperature: float = knob(0.0, "0: greedy, the answer a drafter served at temperature 0 must predict; above 0: "
                                   "sampled at this temperature (docs/data.md: the trade-off)", minimum=0.0)
    top_p: float = knob(1.0, "sampling's nucleus: the smallest set of tokens whose probability reaches it "
                             "(temperature > 0)", minimum=0.0)
    seed: Optional[int] = knob(None, "seeds the sampled draws (temperature > 0; null: unseeded)")
    engine_kwargs: Dict[str, Any] = knob(factory=dict, doc="vllm, sglang: the engine's own arguments "
                                         "(tensor_parallel_size, max_model_len, gpu_memory_utilization, ...), passed through")


@dataclass
class RootConfig:
    model: ModelConfig = group(ModelConfig)
    data: DataConfig = group(DataConfig)
    cluster: ClusterConfig = group(ClusterConfig)
    train: TrainConfig = group(TrainConfig)
    seed: int = knob(0, "seeds the plan's order, the synthetic world and the drafter's initialisation")
    run: RunConfig = group(RunConfig)
    plan: PlanConfig = group(PlanConfig)
    drafter: Optional[str] = knob(None, '`dflash-ray eval`: an exported drafter directory')
    target: Optional[str] = knob(None, '`dflash-ray eval`: a Hugging Face target directory')
    eval: EvalConfig = group(EvalConfig)
    regenerate: RegenerateConfig = group(RegenerateConfig)


# ----------------------------------------------------------------------------- the reference
@dataclass(frozen=True)
class Key:
    """One key of the typed schema, as `dflash-ray config` and docs/configuration.md show it."""
    key: str
    type: str
    default: Any
    doc: str
    choices: tuple | None = None
    minimum: float | None = None
    at_least: str | None = None

    def checks(self) -> str:
        """What composition accepts, in words ('' when any value of the type)."""
        if self.choices is not None:
            return "one of " + ", ".join("null" if c is None else str(c) for c in self.choices)
        if self.minimum is not None:
            return f">= {self.minimum}" + (f" ({self.at_least})" if self.at_least else "")
        return ""


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if origin in (list, List):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in (dict, Dict):
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def schema_keys(cls=None, prefix: str = "") -> List[Key]:
    """Every key of the typed schema (groups walked), in the order the dataclasses declare them."""
    cls = cls or RootConfig
    hints = typing.get_type_hints(cls)
    keys = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            keys.extend(schema_keys(hints[f.name], f"{prefix}{f.name}."))
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        m = f.metadata
        keys.append(Key(f"{prefix}{f.name}", _type_name(hints[f.name]), default, m.get("doc", ""),
                        m.get("choices"), m.get("minimum"), m.get("at_least")))
    return keys


def _option_line(path: Path) -> str:
    """An option's one-line summary: the first comment line of its YAML (after Hydra's `# @package`)."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("#").strip()
    return ""


def reference_markdown() -> str:
    """docs/configuration.md: every key with its type, default and meaning, and each group's options (made from
    the schema and dflash_ray/conf/; tests/test_config_reference.py keeps the file equal to this)."""
    import json

    out = ["# Configuration reference", "",
           "Generated from the typed schema (`dflash_ray/config.py`) and the presets (`dflash_ray/conf/`) by",
           "`dflash-ray config --markdown > docs/configuration.md`; `dflash-ray config [PREFIX]` prints the same in a",
           "terminal. Set any key on the command line (`train.lr=3e-4`), pick a group's option by name",
           "(`model=qwen3_8b`), `--cfg job` prints the composed config. An unknown key, a wrong type or a value",
           "outside what the key accepts is one line naming the key, exit code 2.", "",
           "## Groups and their options", "",
           "| group | option | what it is |", "|---|---|---|"]
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        for option in sorted(d.glob("*.yaml")):
            out.append(f"| `{d.name}` | `{option.stem}` | {_option_line(option)} |")
    by_group: Dict[str, List[Key]] = {}
    for k in schema_keys():
        by_group.setdefault(k.key.split(".")[0] if "." in k.key else "(root)", []).append(k)
    for name, keys in by_group.items():
        out += ["", f"## `{name}`" if name != "(root)" else "## Keys at the root", "",
                "| key | type | default | what it is |", "|---|---|---|---|"]
        for k in keys:
            meaning = k.doc + (f" ({k.checks()})" if k.checks() else "")
            out.append(f"| `{k.key}` | {k.type} | `{json.dumps(k.default)}` | {meaning.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def reference_lines(prefix: str = "") -> List[str]:
    """`dflash-ray config [PREFIX]`: the keys under PREFIX, each as `key (type, default D): meaning`."""
    import json

    return [f"{k.key} ({k.type}, default {json.dumps(k.default)}): {k.doc}" + (f" [{k.checks()}]" if k.checks() else "")
            for k in schema_keys() if k.key == prefix or k.key.startswith(prefix.rstrip(".") + ".") or not prefix]



# what composition checks of each key's value, from the schema's knobs: one of its choices, at least its minimum
# (and what that least value means, where it means more than a number)
CHOICES = {k.key: k.choices for k in schema_keys() if k.choices is not None}
MINIMUM = {k.key: k.minimum for k in schema_keys() if k.minimum is not None}
AT_LEAST = {k.key: k.at_least for k in schema_keys() if k.at_least}


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
    if t.oom_split and t.parallelism == "fsdp":
        raise UserError("config key 'train.oom_split': true needs train.parallelism=ddp: FSDP gathers each layer's "
                        "weights inside the forward, so one rank training a batch again in slices would leave the "
                        "others waiting in a collective")
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
