"""RunSpec: everything the Ray side needs, resolved once on the driver from the composed config.

The composed config holds choices (`mask_token_id: null` = the tokenizer's mask token,
`target_layer_ids: null` = the reference formula); the spec holds their answers
in typed parts — the plan spec, the drafter config, the train and cluster configs — so the controller,
the data pipeline and every train worker see the same values, and a pickled spec has no OmegaConf in it.
The config's own checks (types, ranges, cross-field rules) happened in `config.py`; what is checked
here needs the data or the target (vocabulary sizes, layer ids against the target's depth). The inputs a
run makes itself (`data.input: null` = the demo world, `model.target_path: null` = a synthesised target,
shards not prepared yet) are made before, by demo/world.py; a resume's check of its inputs against the
run's first start is runtime/record/run_inputs.py.
"""
from __future__ import annotations

import dataclasses

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from dflash_ray.config import ClusterConfig, EvalConfig, TrainConfig, compute_dtype_why, require
from dflash_ray.data.plan import Plan, PlanSpec, batch_anchor_cap, build_plan
from dflash_ray.errors import UserError
from dflash_ray.model.drafter import DrafterConfig
from dflash_ray.run_layout import RunLayout


@dataclass
class RunSpec:
    name: str
    run_dir: str                    # absolute; ledger.jsonl, metrics.jsonl, summary.json, export/ live here
    storage_path: str               # Ray Train storage (checkpoints): <storage_path>/<name>/checkpoint_*
    seed: int
    shards: str                     # absolute
    tokenizer: str
    target_path: str
    vocab_size: int                 # the target's
    pad_token_id: int
    plan: PlanSpec
    drafter: DrafterConfig          # answers filled in: target_layer_ids, mask_token_id
    train: TrainConfig
    cluster: ClusterConfig
    coordinator: str                # name of the RunCoordinator actor
    heldout: str | None = None      # held-out prompts (.jsonl) for tau after training; None: not measured
    heldout_max_new_tokens: int = EvalConfig.max_new_tokens
    heldout_max_prompts: int = 1 << 30   # eval.max_prompts: the held-out prompts measured at most
    heldout_training_prompts: int | None = None   # eval.during_training_prompts: the in-training evaluations' (None: all)
    chat_template_kwargs: dict | None = None   # data.chat_template_kwargs: conversation prompts rendered as served
    namespace: str = "dflash"
    init_from: str | None = None    # an exported drafter the run starts from at step 0 (checked against the run)
    target_hidden_size: int = 0     # the target's width: sizes the stream's blocks (0: unknown, one batch a block)
    compute_dtype: str = "float32"  # the target's forwards and the drafter's autocast (model.compute_dtype resolved)
    feature_cache: str | None = None   # train.features resolved: the cache's key (hybrid, offline), None (online)
    features: str = "online"        # train.features resolved: online | hybrid | offline (the target's pass first)
    features_why: str = ""          # why that mode (printed at the start, summary.json)

    @property
    def batches_per_step(self) -> int:
        """Plan batches per optimizer step: drafter workers x gradient-accumulation steps."""
        return self.cluster.drafter_workers * self.train.grad_accum

    @property
    def experiment_dir(self) -> str:
        """Ray Train's directory of this run: checkpoints and its record of them."""
        return f"{self.storage_path.rstrip('/')}/{self.name}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


class RunPlans:
    """The run's epoch plans (data/plan.py: a pure function of the shards' lengths, the config, the seed and
    the epoch), each built once per process from the lengths, read once in the driver (resolve_spec's scan
    of the shards reads them too, for the run's record). Handed on to the stream's factory in Ray Train's
    controller and to the summary with the lengths, not the plans, so nothing re-reads the shards to plan
    again. `plans(epoch)` is the epoch's plan, as `dflash-ray plan` builds it."""

    def __init__(self, spec: RunSpec, lengths=None):
        self.spec, self._lengths, self._plans = spec, lengths, {}

    def __call__(self, epoch: int) -> Plan:
        if epoch not in self._plans:
            if self._lengths is None:
                from dflash_ray.data.shards import read_lengths

                self._lengths = read_lengths(self.spec.shards)
            n = self._lengths
            self._plans[epoch] = build_plan(n.sample_ids, n.num_tokens, self.spec.plan, num_supervised=n.num_supervised,
                                            seed=self.spec.seed, epoch=epoch)
        return self._plans[epoch]

    def __getstate__(self) -> dict:
        # The lengths travel (24 bytes a sample), the built plans do not: every epoch's plan is the samples
        # again (24 bytes each an epoch, 17 MB for 60K samples x 10 epochs, against 1.4 MB of lengths) and
        # rebuilding one costs ~7 ms per 60K samples. Pickled into Ray Train's controller's arguments, the
        # plans sat in the object store beside the token store's blocks: with a store nearly full (a corpus
        # larger than it, reliability/test_big_corpus.py) the controller waited for plasma memory forever.
        return {**self.__dict__, "_plans": {}}


def resolve_spec(cfg, log=print, *, inputs: bool = True, record: bool = True) -> RunSpec:
    """Answer the config's choices: the target's depth and vocabulary against the tokenizer, the tapped
    layers, the mask id, the drafter's shape; check the shards against the target and, at a resume, the
    run's record of its inputs (runtime/record/run_inputs.py). Driver side only; nothing is made here: the
    inputs the config leaves to be made (the demo world, a synthesised target, shards) are made before, by
    demo/world.py (train.py's recipe), which fills the config's nulls with them.

    inputs=False (`dflash-ray export`): nothing of the data is read or checked (a run's checkpoint and the
    drafter's shape are all an export needs; the shards may have changed or be gone since), and no warm
    start (model.init_from) is read; the checkpoint's drafter shape is still compared with the run's record.
    Nulls then name what the run's first start made: data.tokenizer the demo world's tokenizer (with
    data.input null), model.target_path the synthesised target. record=False (compare-orders' shared base):
    the data is checked, but the run's record (run_inputs.json) is neither written nor compared: the runs
    trained from it check their own."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_ray.hf_config import text_config

    from dflash_ray.data.shards import scan_shards
    from dflash_ray.model.target import default_mask_token_id, default_target_layer_ids, missing_weights
    from dflash_ray.runtime.record.run_inputs import check_run_inputs, first_start
    from dflash_ray.runtime.checkpoints import RunCheckpoints

    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = RunLayout(run_dir)
    d = cfg.data
    if inputs and not OmegaConf.is_missing(d, "input") and d.input is None:
        raise ValueError("data.input is null: make the demo world first (demo.world.make_demo_inputs)")
    if not inputs and not OmegaConf.is_missing(d, "input") and d.input is None \
            and not OmegaConf.is_missing(d, "tokenizer") and d.tokenizer is None:
        tokenizer = layout.tokenizer   # the demo world's, made by the run's first start (make_demo_inputs)
    else:
        tokenizer = require(cfg, "data.tokenizer")
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    vocab = len(tok)
    m = cfg.model
    target_path = m.target_path
    if target_path is None:
        if inputs:
            raise ValueError("model.target_path is null: synthesise the target first (demo.world.make_missing_inputs)")
        target_path = layout.target    # the synthesised target, made by the run's first start
    heldout = _heldout_prompts(d) if inputs else None
    target_path = Path(target_path).resolve() if "://" not in str(target_path) else target_path
    if not (Path(target_path) / "config.json").exists():
        raise UserError(f"{target_path}: not a Hugging Face model directory (no config.json) "
                        f"(config key 'model.target_path')")
    if "://" not in str(target_path):
        reason = missing_weights(str(target_path))
        if reason:
            raise UserError(f"{target_path}: {reason} (config key 'model.target_path')")
    try:
        tcfg = AutoConfig.from_pretrained(str(target_path))
        tcfg = text_config(tcfg)
        n_layers, target_vocab = int(tcfg.num_hidden_layers), int(tcfg.vocab_size)
    except (ValueError, TypeError, AttributeError, OSError) as e:  # no model_type, a field missing, bad JSON
        raise UserError(f"{target_path}/config.json: not a usable model config ({str(e).strip().splitlines()[0]}) "
                        f"(config key 'model.target_path')") from e
    if m.target_layer_ids is not None:
        layer_ids = [int(i) for i in m.target_layer_ids]
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= n_layers:
            raise UserError(f"config key 'model.target_layer_ids': {layer_ids} out of range for a "
                            f"{n_layers}-layer target (ids 0..{n_layers - 1}, at least one)")
    else:
        layer_ids = default_target_layer_ids(n_layers, m.num_draft_layers)
    if vocab > target_vocab:
        raise UserError(f"{cfg.data.tokenizer}: tokenizer has {vocab} tokens but the target's vocabulary is "
                        f"{target_vocab} (config key 'model.target_path')")
    train = OmegaConf.to_object(cfg.train)
    storage = train.storage_path or str(layout.ray_train)
    if "://" not in str(storage):
        storage = str(Path(storage).resolve())
    checkpoints = RunCheckpoints(f"{storage.rstrip('/')}/{cfg.run.name}")
    resuming = None   # read once, when first needed
    scan = None
    if inputs:
        # one pass over the shards, each footer read once: shards prepared with another tokenizer (ids past
        # the target's embedding, from footer statistics; the full per-row validation runs again when
        # training reads the tokens), the samples' lengths and the files' layout for the run's record, and
        # at a run's first start the tokens' digest too (run_inputs.check_run_inputs)
        resuming = record and checkpoints.exists()
        first = record and first_start(run_dir, resuming)
        scan = scan_shards(cfg.data.shards, target_vocab, contents=first,
                           hint=f" of the target at {target_path}: were the shards prepared with another tokenizer?")
    mask_id = m.mask_token_id if m.mask_token_id is not None else default_mask_token_id(target_vocab, tok)
    dtype, why = compute_dtype_why(cfg)
    if inputs:
        log(f"compute dtype: {dtype} ({why})")
    drafter = DrafterConfig(num_draft_layers=m.num_draft_layers, block_size=m.block_size,
                            num_anchors=m.num_anchors, target_layer_ids=tuple(layer_ids),
                            loss_gamma=None if m.loss_gamma is None else m.loss_gamma,
                            mask_token_id=int(mask_id),
                            # the step's per-batch cap is the plan's (thinning or the block-token budget)
                            anchors_per_batch=batch_anchor_cap(m.anchors_per_batch, m.max_block_tokens_per_batch,
                                                               m.block_size),
                            intermediate_size=_opt_int(m.drafter_intermediate_size),
                            num_attention_heads=_opt_int(m.drafter_num_attention_heads),
                            num_key_value_heads=_opt_int(m.drafter_num_key_value_heads))
    init_from = _check_drafter_shape(drafter, tcfg, m.init_from if inputs else None)
    shards = OmegaConf.select(cfg, "data.shards", default=None, throw_on_missing=False)
    spec = RunSpec(
        name=cfg.run.name, run_dir=str(run_dir), storage_path=storage, seed=cfg.seed,
        shards="" if shards is None else str(shards) if "://" in str(shards) else str(Path(shards).resolve()),
        tokenizer=str(tokenizer), target_path=str(target_path),
        vocab_size=target_vocab, pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else 0),
        plan=PlanSpec.from_config(cfg), drafter=drafter, train=train, cluster=OmegaConf.to_object(cfg.cluster),
        coordinator=coordinator_name(cfg.run.name), heldout=heldout,
        heldout_max_new_tokens=cfg.eval.max_new_tokens, heldout_max_prompts=cfg.eval.max_prompts,
        heldout_training_prompts=cfg.eval.during_training_prompts,
        chat_template_kwargs=OmegaConf.to_container(d.chat_template_kwargs) if d.chat_template_kwargs else None,
        init_from=init_from,
        target_hidden_size=int(getattr(tcfg, "hidden_size", 0) or 0),
        compute_dtype=dtype)
    if record:
        check_run_inputs(spec, tcfg, scan, log=log,
                         resuming=checkpoints.exists() if resuming is None else resuming)
    if scan is not None:
        spec = with_feature_cache(spec, scan, log)
    return spec


def with_feature_cache(spec: RunSpec, scan, log=print) -> RunSpec:
    """train.features answered (runtime/stream/feature_cache.py): hybrid with the cache's key, or online, and
    why; printed. The cache's size is the corpus's tokens at the taps (its disk: this node's, where the
    driver runs)."""
    from dflash_ray.runtime.record.run_inputs import read_run_inputs
    from dflash_ray.runtime.stream.feature_cache import cache_bytes, cache_disk, cache_key, choose_features

    t = spec.train
    need = cache_bytes(int(scan.lengths.num_tokens.sum()), len(spec.drafter.target_layer_ids),
                       spec.target_hidden_size, spec.compute_dtype, t.distill_top_k if t.loss == "distill" else 0)
    root, free = cache_disk(t.feature_cache_dir)
    mode, why = choose_features(t.features, t.epochs, need, t.feature_cache_gb, free)
    key = None
    if mode in ("hybrid", "offline"):
        contents = scan.contents or ((read_run_inputs(spec.run_dir) or {}).get("shards") or {}).get("contents")
        if not contents:
            from dflash_ray.data.shards import contents_digest

            contents = contents_digest(spec.shards)
        key = cache_key(spec.target_path, spec.drafter.target_layer_ids, spec.compute_dtype, contents)
        why = f"{why} at {root / key}"
    log(f"target features: {mode} ({why})")
    return dataclasses.replace(spec, feature_cache=key, features=mode, features_why=f"{mode}: {why}")


def with_parallelism(spec: RunSpec, parallelism: str, log=print) -> RunSpec:
    """The spec with train.parallelism resolved (auto -> what runtime/plan_sizing.choose_parallelism says)."""
    if parallelism != spec.train.parallelism and parallelism == "fsdp":
        log("drafter parallelism: fsdp (train.parallelism=auto: the memory model's DDP step does not fit the "
            "drafter's GPU share)")
    if parallelism == "fsdp" and spec.train.oom_split:   # auto chose fsdp (an explicit fsdp: config.py refuses)
        log("train.oom_split: off under FSDP (its forward gathers weights: a batch cannot be trained again in "
            "slices on one rank alone)")
        spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, oom_split=False))
    if parallelism == "fsdp" and spec.train.heldout_every:
        log("train.heldout_every: no held-out tau during training with a sharded drafter (the one after training runs)")
    return dataclasses.replace(spec, train=dataclasses.replace(spec.train, parallelism=parallelism))


def _heldout_prompts(d) -> str | None:
    """The held-out prompts: data.prompts, else the held-out slice `prepare` wrote beside the shards
    (data.heldout_fraction: <shards>/heldout.jsonl), else none (no tau is measured)."""
    from dflash_ray.data.prepare import HELDOUT

    if d.prompts:
        return str(d.prompts) if "://" in str(d.prompts) else str(Path(d.prompts).resolve())
    if not d.shards:
        return None
    import pyarrow.fs as pafs

    from dflash_ray.data.shards import filesystem_of

    uri = str(d.shards) if "://" in str(d.shards) else str(Path(d.shards).resolve())
    fs, where = filesystem_of(f"{uri.rstrip('/')}/{HELDOUT}")
    return f"{uri.rstrip('/')}/{HELDOUT}" if fs.get_file_info(where).type == pafs.FileType.File else None


def _opt_int(value):
    return None if value is None else int(value)


def _check_drafter_shape(drafter: DrafterConfig, tcfg, init_from) -> str | None:
    """The drafter knobs against the target, and model.init_from against the run's drafter, on the driver
    (one line naming the key, before any worker starts). Returns init_from made absolute."""
    from dflash_ray.model.drafter import drafter_config
    from dflash_ray.model.export import export_mismatch

    heads = drafter.num_attention_heads or int(tcfg.num_attention_heads)
    kv = drafter.num_key_value_heads or int(getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads)
    if heads % kv:
        raise UserError(f"config key 'model.drafter_num_key_value_heads': the drafter's {heads} attention heads "
                        f"are not a multiple of its {kv} key/value heads")
    if drafter.intermediate_size is None and not getattr(tcfg, "intermediate_size", None):
        raise UserError("config key 'model.drafter_intermediate_size' must be set: the target's config has no "
                        "intermediate_size")
    if init_from is None:
        return None
    init_from = str(Path(init_from).resolve()) if "://" not in str(init_from) else str(init_from)
    config = drafter_config(tcfg, drafter.num_draft_layers, drafter.block_size, drafter.mask_token_id,
                            drafter.target_layer_ids, drafter.intermediate_size, drafter.num_attention_heads,
                            drafter.num_key_value_heads)
    reason = export_mismatch(init_from, config)
    if reason:
        raise UserError(f"config key 'model.init_from': {reason}")
    return init_from


def coordinator_name(run_name: str) -> str:
    """The RunCoordinator actor's name (one per run and driver process)."""
    return f"dflash-coordinator-{run_name}-{os.getpid()}"
