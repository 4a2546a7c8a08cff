"""RunSpec: everything the Ray side needs, resolved once on the driver from the composed config.

The composed config holds choices (`target_path: null` = synthesise one, `mask_token_id: null` = the
tokenizer's mask token, `target_layer_ids: null` = the reference formula); the spec holds their answers
in typed parts — the plan spec, the drafter config, the train and cluster configs — so the controller,
the data pipeline and every train worker see the same values, and a pickled spec has no OmegaConf in it.
The config's own checks (types, ranges, cross-field rules) happened in `config.py`; what is checked
here needs the data or the target (vocabulary sizes, layer ids against the target's depth).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from dflash_ray.config import ClusterConfig, TrainConfig
from dflash_ray.data.plan import Plan, PlanSpec, build_plan
from dflash_ray.errors import UserError
from dflash_ray.model.drafter import DrafterConfig


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
    namespace: str = "dflash"

    @property
    def batches_per_step(self) -> int:
        """Plan batches per optimizer step: drafter workers x gradient-accumulation steps."""
        return self.cluster.drafter_workers * self.train.grad_accum

    @property
    def experiment_dir(self) -> str:
        """Ray Train's directory of this run: checkpoints and its record of them."""
        return f"{self.storage_path.rstrip('/')}/{self.name}"

    def build_plan(self, epoch: int, lengths=None) -> Plan:
        """The epoch plan: the same pure function `dflash-ray plan` uses. lengths: (sample_ids,
        num_tokens) when already read, else read from the shards."""
        if lengths is None:
            from dflash_ray.data.shards import read_lengths

            lengths = read_lengths(self.shards)[:2]
        sample_ids, num_tokens = lengths
        return build_plan(sample_ids, num_tokens, self.plan, seed=self.seed, epoch=int(epoch))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


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
    m = cfg.model
    target_path = m.target_path
    if target_path is None:
        target_path = run_dir / "target"
        if not (target_path / "config.json").exists():
            build_synthetic_target(dict(m.target_config), vocab, str(target_path), seed=int(cfg.seed))
            log(f"built a synthetic target ({dict(m.target_config).get('num_hidden_layers')} layers, "
                f"vocab {vocab}) -> {target_path}")
    target_path = Path(target_path).resolve() if "://" not in str(target_path) else target_path
    if not (Path(target_path) / "config.json").exists():
        raise UserError(f"{target_path}: not a Hugging Face model directory (no config.json) "
                        f"(config key 'model.target_path')")
    tcfg = AutoConfig.from_pretrained(str(target_path))
    tcfg = getattr(tcfg, "text_config", None) or tcfg
    n_layers = int(tcfg.num_hidden_layers)
    if m.target_layer_ids is not None:
        layer_ids = [int(i) for i in m.target_layer_ids]
        if min(layer_ids) < 0 or max(layer_ids) >= n_layers:
            raise UserError(f"config key 'model.target_layer_ids': {layer_ids} out of range for a "
                            f"{n_layers}-layer target")
    else:
        layer_ids = default_target_layer_ids(n_layers, int(m.num_draft_layers))
    target_vocab = int(tcfg.vocab_size)
    if vocab > target_vocab:
        raise UserError(f"{cfg.data.tokenizer}: tokenizer has {vocab} tokens but the target's vocabulary is "
                        f"{target_vocab} (config key 'model.target_path')")
    mask_id = m.mask_token_id if m.mask_token_id is not None else default_mask_token_id(target_vocab, tok)
    train = OmegaConf.to_object(cfg.train)
    storage = train.storage_path or str(run_dir / "ray_train")
    if "://" not in str(storage):
        storage = str(Path(storage).resolve())
    drafter = DrafterConfig(num_draft_layers=int(m.num_draft_layers), block_size=int(m.block_size),
                            num_anchors=int(m.num_anchors), target_layer_ids=tuple(layer_ids),
                            loss_gamma=None if m.loss_gamma is None else float(m.loss_gamma),
                            mask_token_id=int(mask_id))
    return RunSpec(
        name=str(cfg.run.name), run_dir=str(run_dir), storage_path=storage, seed=int(cfg.seed),
        shards=str(Path(cfg.data.shards).resolve()), tokenizer=str(cfg.data.tokenizer), target_path=str(target_path),
        vocab_size=target_vocab, pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else 0),
        plan=PlanSpec.from_config(cfg), drafter=drafter, train=train, cluster=OmegaConf.to_object(cfg.cluster),
        coordinator=coordinator_name(str(cfg.run.name)))


def coordinator_name(run_name: str) -> str:
    """The RunCoordinator actor's name (one per run and driver process)."""
    return f"dflash-coordinator-{run_name}-{os.getpid()}"
