"""RunSpec: everything the Ray side needs, resolved once on the driver from the config, as plain values.

The composed config holds choices (`target_path: null` = synthesise one, `mask_token_id: null` = the
tokenizer's mask token, `target_layer_ids: null` = the reference formula); the spec holds their answers,
so the controller, the data pipeline and every train worker see the same numbers, and a pickled spec is
small and has no OmegaConf in it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_ray.errors import UserError


@dataclass
class RunSpec:
    run_name: str
    run_dir: str                    # absolute; ledger.jsonl, metrics.jsonl, summary.json, export/ live here
    storage_path: str               # Ray Train storage (checkpoints): <storage_path>/<run_name>/checkpoint_*
    seed: int
    epochs: int
    max_steps: int | None
    # data
    shards: str
    tokenizer: str
    vocab_size: int
    pad_token_id: int
    plan_cfg: dict                  # the `data` and `model.block_size` keys the planner reads
    # model
    target_path: str
    target_layer_ids: list[int]
    model_cfg: dict                 # num_draft_layers, block_size, num_anchors, loss_gamma, target_layer_ids
    mask_token_id: int
    # cluster
    use_gpu: bool
    drafter_workers: int
    target_workers: int
    target_resource: str
    max_batches_in_flight: int
    # optimisation
    lr: float
    weight_decay: float
    warmup_ratio: float
    grad_clip: float
    grad_accum: int
    checkpoint_every: int
    num_to_keep: int
    max_failures: int
    log_every: int
    tensorboard: bool
    coordinator: str = ""           # name of the RunCoordinator actor
    namespace: str = "dflash"
    extra: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        """Plan batches per optimizer step: W = drafter workers x gradient-accumulation steps."""
        return self.drafter_workers * self.grad_accum

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def plan_config(spec_or_cfg) -> dict:
    """The keys `PlanSpec.from_config` reads, as a plain nested dict (so workers need no OmegaConf)."""
    if isinstance(spec_or_cfg, RunSpec):
        return spec_or_cfg.plan_cfg
    cfg = spec_or_cfg
    d = cfg.data
    return {
        "seed": int(cfg.seed),
        "data": {"bucket_boundaries": [int(x) for x in d.bucket_boundaries],
                 "max_tokens_per_batch": int(d.max_tokens_per_batch), "overlong": str(d.overlong),
                 "chunk_batches": int(d.chunk_batches), "interleave": str(d.interleave),
                 "shards": str(d.shards)},
        "model": {"block_size": int(cfg.model.block_size)},
    }


def build_plan_for(plan_cfg: dict, epoch: int, lengths=None):
    """The epoch plan from a plan_cfg dict: the same pure function `dflash-ray plan` uses."""
    from omegaconf import OmegaConf

    from dflash_ray.data.plan import PlanSpec, build_plan
    from dflash_ray.data.shards import read_lengths

    cfg = OmegaConf.create(plan_cfg)
    spec = PlanSpec.from_config(cfg)
    if lengths is None:
        sample_ids, num_tokens, _ = read_lengths(plan_cfg["data"]["shards"])
    else:
        sample_ids, num_tokens = lengths
    return build_plan(sample_ids, num_tokens, spec, seed=int(plan_cfg["seed"]), epoch=int(epoch))


def resolve_spec(cfg, log=print) -> RunSpec:
    """Fill the config's nulls with their answers: data (ensure_data), the target (synthesised under
    run.dir/target when model.target_path is null), the mask id, the tapped layers. Driver side only."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_ray.data.default import ensure_data
    from dflash_ray.model.target import build_synthetic_target, default_mask_token_id, default_target_layer_ids

    ensure_data(cfg, log=log)
    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(cfg.data.tokenizer))
    vocab = len(tok)
    target_path = cfg.model.target_path
    if target_path is None:
        target_path = run_dir / "target"
        if not (target_path / "config.json").exists():
            build_synthetic_target(dict(cfg.model.target_config), vocab, str(target_path), seed=int(cfg.seed))
            log(f"built a synthetic target ({dict(cfg.model.target_config).get('num_hidden_layers')} layers, "
                f"vocab {vocab}) -> {target_path}")
    target_path = Path(target_path).resolve() if "://" not in str(target_path) else target_path
    if not (Path(target_path) / "config.json").exists():
        raise UserError(f"{target_path}: not a Hugging Face model directory (no config.json) "
                        f"(config key 'model.target_path')")
    tcfg = AutoConfig.from_pretrained(str(target_path))
    tcfg = getattr(tcfg, "text_config", None) or tcfg
    n_layers = int(tcfg.num_hidden_layers)
    if cfg.model.target_layer_ids is not None:
        layer_ids = [int(i) for i in cfg.model.target_layer_ids]
        if min(layer_ids) < 0 or max(layer_ids) >= n_layers:
            raise UserError(f"config key 'model.target_layer_ids': {layer_ids} out of range for a "
                            f"{n_layers}-layer target")
    else:
        layer_ids = default_target_layer_ids(n_layers, int(cfg.model.num_draft_layers))
    target_vocab = int(tcfg.vocab_size)
    if vocab > target_vocab:
        raise UserError(f"{cfg.data.tokenizer}: tokenizer has {vocab} tokens but the target's vocabulary is "
                        f"{target_vocab} (config key 'model.target_path')")
    mask_id = cfg.model.mask_token_id
    if mask_id is None:
        mask_id = default_mask_token_id(target_vocab, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    c, t = cfg.cluster, cfg.train
    if int(c.drafter_workers) < 1 or int(c.target_workers) < 1:
        raise UserError("config keys 'cluster.drafter_workers' and 'cluster.target_workers' must be >= 1")
    if int(t.grad_accum) < 1:
        raise UserError("config key 'train.grad_accum' must be >= 1")
    world = int(c.drafter_workers) * int(t.grad_accum)
    if int(c.max_batches_in_flight) < world:
        raise UserError(f"config key 'cluster.max_batches_in_flight': {c.max_batches_in_flight} is less than "
                        f"the {world} batches one optimizer step needs (drafter_workers x grad_accum)")
    if int(t.checkpoint_every) < 1:
        raise UserError("config key 'train.checkpoint_every' must be >= 1")
    storage = t.storage_path or str(run_dir / "ray_train")
    if "://" not in str(storage):
        storage = str(Path(storage).resolve())
    model_cfg = {"num_draft_layers": int(cfg.model.num_draft_layers), "block_size": int(cfg.model.block_size),
                 "num_anchors": int(cfg.model.num_anchors), "target_layer_ids": layer_ids,
                 "loss_gamma": None if cfg.model.loss_gamma is None else float(cfg.model.loss_gamma)}
    return RunSpec(
        run_name=str(cfg.run.name), run_dir=str(run_dir), storage_path=storage, seed=int(cfg.seed),
        epochs=int(t.epochs), max_steps=None if t.max_steps is None else int(t.max_steps),
        shards=str(Path(cfg.data.shards).resolve()), tokenizer=str(cfg.data.tokenizer), vocab_size=target_vocab,
        pad_token_id=int(pad), plan_cfg=_abs_shards(plan_config(cfg)),
        target_path=str(target_path), target_layer_ids=layer_ids, model_cfg=model_cfg, mask_token_id=int(mask_id),
        use_gpu=bool(c.use_gpu), drafter_workers=int(c.drafter_workers), target_workers=int(c.target_workers),
        target_resource=str(c.target_resource), max_batches_in_flight=int(c.max_batches_in_flight),
        lr=float(t.lr), weight_decay=float(t.weight_decay), warmup_ratio=float(t.warmup_ratio),
        grad_clip=float(t.grad_clip), grad_accum=int(t.grad_accum), checkpoint_every=int(t.checkpoint_every),
        num_to_keep=int(t.num_to_keep), max_failures=int(t.max_failures), log_every=int(t.log_every),
        tensorboard=bool(t.tensorboard),
        coordinator=coordinator_name(str(cfg.run.name)),
    )


def coordinator_name(run_name: str) -> str:
    """The RunCoordinator actor's name (one per run and driver process)."""
    return f"dflash-coordinator-{run_name}-{os.getpid()}"


def _abs_shards(pc: dict) -> dict:
    pc["data"]["shards"] = str(Path(pc["data"]["shards"]).resolve())
    return pc
