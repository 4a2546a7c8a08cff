"""The epoch plan: a pure, seeded function of the samples' lengths and the config.

plan = buckets -> token-budget batches -> interleaved global order. Anything that needs the order (the
Ray Data stream, a resume, the `plan` command) calls `build_plan` with the same inputs and gets the same
plan, on any machine, before or after a restart. No torch here.

A batch has two budgets. The target's: rows x longest row <= max_tokens_per_batch (weighted by the
attention term, buckets.rows_per_batch), enforced here by the cut. The drafter's: the block tokens it
trains (anchors x block_size). Each row trains min(num_anchors, its valid anchors) — the recipe's density —
and `max_block_tokens_per_batch` bounds their sum per batch, also enforced here by the cut (short-row
batches get fewer rows), so the drafter's memory and step time stay flat at full density. Thinning
(`anchors_per_batch`: fewer anchors than the rows hold, shared out by drafter.anchor_quota at the step)
is a separate, explicit choice. The plan knows each sample's supervised tokens (shards from `prepare`),
so it reports both budgets' work per bucket in their own units (context tokens, block tokens, the anchor
density) and drops samples that cannot hold an anchor (fewer than two supervised tokens), counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dflash_ray.config import DataConfig, ModelConfig, check_plan_rules
from dflash_ray.data.buckets import assign_buckets, form_batches
from dflash_ray.data.interleave import interleave_order, order_measures
from dflash_ray.errors import UserError
from dflash_ray.hf_config import text_config


@dataclass
class PlanSpec:
    boundaries: list[int]
    max_tokens_per_batch: int
    # the config's defaults (config.py), for a PlanSpec built by hand
    overlong: str = DataConfig.overlong
    chunk_batches: int = DataConfig.chunk_batches
    min_tokens: int = 0           # 2 * block_size: shorter samples cannot hold two blocks
    strategy: str = DataConfig.interleave
    attention_tokens: float | None = None   # La of buckets.rows_per_batch; None: token budget only
    block_size: int = ModelConfig.block_size   # the drafter's side of a batch (reported; the step enforces it)
    num_anchors: int | None = None          # anchors per row at most
    anchors_per_batch: int | None = None    # thinning: anchors per batch at most (None: num_anchors per row only)
    max_block_tokens_per_batch: int | None = None  # the drafter's budget per batch, cut by the plan (None: none)
    step_batches: int = 1                   # batches of one optimizer step (drafter_workers x grad_accum): see step_order

    def row_anchors(self, valid: np.ndarray) -> np.ndarray:
        """Anchors each row trains at the recipe's density: its valid anchors, num_anchors at most."""
        return valid if self.num_anchors is None else np.minimum(valid, self.num_anchors)

    def batch_anchor_cap(self) -> int | None:
        """Anchors a batch trains at most: the thinning cap and the drafter's budget, whichever is lower (a
        single row with more valid anchors than the budget is thinned to it, the only case the cut cannot
        keep whole). The step's drafter.anchor_quota takes the same cap (runtime/spec.py)."""
        return batch_anchor_cap(self.anchors_per_batch, self.max_block_tokens_per_batch, self.block_size)

    def validate(self) -> None:
        """The rules between the plan's keys (config.check_plan_rules, which also checks them at composition)."""
        check_plan_rules(self.boundaries, self.max_tokens_per_batch, self.block_size,
                         self.max_block_tokens_per_batch, self.step_batches)

    @classmethod
    def from_config(cls, cfg) -> "PlanSpec":
        """From a composed config (typed: nothing to cast)."""
        d, m = cfg.data, cfg.model
        plan_spec = cls(
            boundaries=list(d.bucket_boundaries),
            max_tokens_per_batch=d.max_tokens_per_batch,
            overlong=d.overlong,
            chunk_batches=d.chunk_batches,
            min_tokens=2 * m.block_size,
            strategy=d.interleave,
            attention_tokens=_attention_tokens(cfg),
            block_size=m.block_size,
            num_anchors=m.num_anchors,
            anchors_per_batch=m.anchors_per_batch,
            max_block_tokens_per_batch=m.max_block_tokens_per_batch,
            step_batches=cfg.cluster.drafter_workers * cfg.train.grad_accum,
        )
        plan_spec.validate()
        return plan_spec


def batch_anchor_cap(anchors_per_batch: int | None, max_block_tokens_per_batch: int | None,
                     block_size: int) -> int | None:
    caps = [c for c in (anchors_per_batch,
                        None if max_block_tokens_per_batch is None else max_block_tokens_per_batch // block_size)
            if c is not None]
    return min(caps) if caps else None


def attention_tokens_of(target: dict) -> float | None:
    """La for a decoder of this shape, by FLOP count: a token's linear work per layer is 2 x the layer's
    projection parameters; its causal attention over a row of L tokens averages 2 x L x heads x head_dim;
    the two are equal at L = La = projection parameters / (heads x head_dim). Qwen3-8B: ~47K tokens (an
    8K row costs ~17% more per token than a short one); the tiny demo target: 576."""
    t = text_config(target)
    try:
        h, heads, inter = int(t["hidden_size"]), int(t["num_attention_heads"]), int(t["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return None
    kv = int(t.get("num_key_value_heads") or heads)
    hd = int(t.get("head_dim") or h // heads)
    projections = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter
    return projections / (heads * hd)


def target_fields(cfg) -> dict | None:
    """The target's config.json fields (the plan's attention term, the memory model), never another
    target's:
      model.target_path set: its config.json when it is a local directory, else None (a hub id not
        resolved yet, a path this machine cannot read: the shape is unknown);
      model.target_path `???` (a real preset's, not given yet): model.target_config, the preset's copy of
        its target's config.json values ({} in a preset without one: None);
      model.target_path null (a synthesised target): the one the job built (<run.dir>/target), else
        model.target_config, what it will be built from (no vocab_size until the tokenizer gives one)."""
    import json
    from pathlib import Path

    from omegaconf import OmegaConf

    m = cfg.model
    if not OmegaConf.is_missing(m, "target_path"):
        built = m.target_path is None
        # <run.dir>/target: run_layout.py's TARGET (the data layer imports nothing above it)
        config_json = (Path(cfg.run.dir) / "target" if built else Path(m.target_path)) / "config.json"
        if config_json.is_file():
            return json.loads(config_json.read_text())
        if not built:
            return None
    return OmegaConf.to_container(m.target_config) if m.target_config else None


def _attention_tokens(cfg) -> float | None:
    """data.attention_tokens when set (0 turns the term off), else from the target's shape."""
    value = cfg.data.attention_tokens
    if value is not None:
        return value or None
    fields = target_fields(cfg)
    return attention_tokens_of(fields) if fields else None


@dataclass
class Plan:
    """Batch at position k: bucket[k], samples sample_ids[offsets[k]:offsets[k+1]] (longest first)."""
    epoch: int
    seed: int
    plan_spec: PlanSpec
    bucket: np.ndarray       # int32 [N]
    offsets: np.ndarray      # int64 [N+1]
    sample_ids: np.ndarray   # int64 [M]
    lengths: np.ndarray      # int64 [M], after truncation
    max_len: np.ndarray      # int64 [N], padded row length of each batch
    anchors: np.ndarray      # int64 [M], valid anchors of each planned sample (at most)
    counts: dict = field(default_factory=dict)  # samples in / kept / truncated / dropped

    @property
    def num_batches(self) -> int:
        return int(self.bucket.size)

    def batch(self, k: int) -> np.ndarray:
        return self.sample_ids[self.offsets[k]:self.offsets[k + 1]]

    def batch_tokens(self) -> np.ndarray:
        """Real tokens of every batch."""
        csum = np.concatenate([[0], np.cumsum(self.lengths)])
        return csum[self.offsets[1:]] - csum[self.offsets[:-1]]

    def padded_tokens(self) -> np.ndarray:
        return np.diff(self.offsets) * self.max_len

    def target_cost(self) -> np.ndarray:
        """Each batch's target work in padded-token units, with the attention term when the spec has one."""
        la = self.plan_spec.attention_tokens
        padded = self.padded_tokens().astype(np.float64)
        return padded * (1.0 + self.max_len / la) if la else padded

    def drafter_anchors(self) -> tuple[np.ndarray, np.ndarray]:
        """(anchors the drafter trains, valid anchors) per batch: each row contributes min(num_anchors,
        its valid anchors), the batch at most anchors_per_batch (the step's anchor_quota)."""
        valid = self.anchors
        per_row = self.plan_spec.row_anchors(valid)
        csum = np.concatenate([[0], np.cumsum(per_row)])
        wanted = csum[self.offsets[1:]] - csum[self.offsets[:-1]]
        vsum = np.concatenate([[0], np.cumsum(valid)])
        total = vsum[self.offsets[1:]] - vsum[self.offsets[:-1]]
        cap = self.plan_spec.batch_anchor_cap()
        return (wanted if cap is None else np.minimum(wanted, cap)), total

    def to_arrow(self, start: int = 0) -> pa.Table:
        """Plan rows from position `start` on: position, bucket, sample_ids, num_tokens (real tokens)."""
        off = self.offsets[start:] - self.offsets[start]
        values = pa.array(self.sample_ids[self.offsets[start]:], type=pa.int64())
        return pa.table({
            "position": pa.array(np.arange(start, self.num_batches, dtype=np.int64)),
            "bucket": pa.array(self.bucket[start:].astype(np.int32)),
            "sample_ids": pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), values),
            "num_tokens": pa.array(self.batch_tokens()[start:].astype(np.int64)),
        })

    def summary(self) -> dict:
        ps = self.plan_spec
        k = len(ps.boundaries)
        sizes = np.diff(self.offsets)
        tokens = self.batch_tokens()
        padded = self.padded_tokens()
        cost = self.target_cost()
        trained, valid = self.drafter_anchors()
        cap = ps.batch_anchor_cap()
        lower = [0] + list(ps.boundaries[:-1])
        rows = []
        n = max(self.num_batches, 1)
        mean_cost = float(cost.mean()) if cost.size else 0.0

        def mean(x, sel):
            return float(x[sel].mean()) if sel.any() else None

        for b in range(k):
            sel = self.bucket == b
            rows.append({
                "bucket": b,
                "range": f"{lower[b] + 1}-{ps.boundaries[b]}",
                "samples": int(sizes[sel].sum()),
                "batches": int(sel.sum()),
                "tokens": int(tokens[sel].sum()),
                "share": float(sel.sum() / n),
                "padding_efficiency": float(tokens[sel].sum() / padded[sel].sum()) if sel.any() else None,
                "rows_per_batch": mean(sizes, sel),
                # the target's budget: padded tokens per batch over max_tokens_per_batch, and the batch's
                # work (attention term included) relative to the epoch's mean batch
                "target_fill": mean(padded / ps.max_tokens_per_batch, sel),
                "target_cost": (mean(cost, sel) / mean_cost) if sel.any() and mean_cost else None,
                # the drafter's budget: anchors trained per batch (x block_size = block tokens), their
                # share of anchors_per_batch, and of the batch's valid anchors (anchor density)
                "anchors_per_batch": mean(trained.astype(np.float64), sel),
                "block_tokens_per_batch": mean(trained.astype(np.float64) * ps.block_size, sel),
                "drafter_fill": mean(trained / cap, sel) if cap else None,
                "anchor_density": float(trained[sel].sum() / max(valid[sel].sum(), 1)) if sel.any() else None,
                # the drafter's work per context token the target computes (the unit that makes trainers'
                # throughputs comparable: SpecForge's recipe trains min(512, valid) anchors a row)
                "block_tokens_per_token": float(trained[sel].sum() * ps.block_size / max(tokens[sel].sum(), 1))
                if sel.any() else None,
            })
        used = [r for r in rows if r["batches"]]

        def spread(key):
            vals = [r[key] for r in used if r[key]]
            return max(vals) / min(vals) if vals else None

        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "strategy": self.plan_spec.strategy,
            "samples": self.counts,
            "batches": self.num_batches,
            "tokens": int(tokens.sum()),
            "padded_tokens": int(padded.sum()),
            "padding_efficiency": float(tokens.sum() / max(padded.sum(), 1)),
            "max_tokens_per_batch": ps.max_tokens_per_batch,
            "attention_tokens": ps.attention_tokens,
            "anchors_per_batch": ps.anchors_per_batch,
            "max_block_tokens_per_batch": ps.max_block_tokens_per_batch,
            "num_anchors": ps.num_anchors,
            "block_size": ps.block_size,
            "block_tokens": int(trained.sum()) * ps.block_size,
            "block_tokens_per_token": float(trained.sum() * ps.block_size / max(tokens.sum(), 1)),
            "anchor_density": float(trained.sum() / max(valid.sum(), 1)),
            "target_cost_max_over_min": spread("target_cost"),
            "drafter_block_tokens_max_over_min": spread("block_tokens_per_batch"),
            "buckets": rows,
            "step_batches": ps.step_batches,
            "order": self.order_measures(),
        }

    def step_labels(self) -> np.ndarray:
        """The bucket of each whole optimizer step (step_order: its W batches share it), or
        len(boundaries) for a step of the buckets' leftovers; a partial last step is left out."""
        w = self.plan_spec.step_batches
        steps = self.bucket[: self.bucket.size // w * w].reshape(-1, w)
        pure = (steps == steps[:, :1]).all(axis=1)
        return np.where(pure, steps[:, 0], len(self.plan_spec.boundaries)).astype(np.int32)

    def order_measures(self) -> dict:
        """interleave.order_measures of the order in its units: batches, or steps when a step holds several
        (step_batches > 1; then counts and runs are in steps, with leftover steps a bucket of their own)."""
        w, k = self.plan_spec.step_batches, len(self.plan_spec.boundaries)
        if w == 1:
            return {**order_measures(self.bucket, k), "unit": "batches"}
        labels = self.step_labels()
        return {**order_measures(labels, k + 1 if (labels == k).any() else k), "unit": f"steps of {w} batches"}


def build_plan(sample_ids, num_tokens, plan_spec: PlanSpec, *, num_supervised=None, seed: int = 0,
               epoch: int = 0) -> Plan:
    """num_supervised: each sample's supervised tokens (None: every token counts as supervised)."""
    plan_spec.validate()
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    sup = num_tokens if num_supervised is None else np.asarray(num_supervised, dtype=np.int64)
    if sample_ids.size > 1 and not (np.diff(sample_ids) > 0).all():
        # the plan must not depend on shard file order: work in sample_id order
        o = np.argsort(sample_ids, kind="stable")
        sample_ids, num_tokens, sup = sample_ids[o], num_tokens[o], sup[o]
    bk = assign_buckets(num_tokens, plan_spec.boundaries, overlong=plan_spec.overlong, min_tokens=plan_spec.min_tokens)
    # an anchor a needs supervised a and a+1: fewer than two supervised tokens train nothing
    unsupervised = (sup < 2) & (bk.bucket >= 0)
    bk.bucket[unsupervised] = -1
    # valid anchors (at most): supervised tokens after truncation, less one
    anchors = np.maximum(np.minimum(sup, bk.length) - 1, 0)
    rng = np.random.default_rng([int(seed), int(epoch), 1000])  # its own stream: interleave salts are 0..4
    budget = plan_spec.max_block_tokens_per_batch
    batches = form_batches(bk.length, bk.bucket, plan_spec.boundaries, plan_spec.max_tokens_per_batch,
                           plan_spec.chunk_batches, rng, attention_tokens=plan_spec.attention_tokens,
                           row_anchors=None if budget is None else plan_spec.row_anchors(anchors),
                           max_anchors=None if budget is None else budget // plan_spec.block_size)
    if batches.bucket.size == 0:
        raise UserError(f"no samples left to plan: {sample_ids.size} in, {bk.dropped_short} shorter than "
                        f"{plan_spec.min_tokens} tokens (2 x block_size), {bk.dropped_overlong} over the last "
                        f"bucket boundary {plan_spec.boundaries[-1]} (data.overlong=drop), "
                        f"{int(unsupervised.sum())} with fewer than 2 supervised tokens")
    counts_per_bucket = np.bincount(batches.bucket, minlength=len(plan_spec.boundaries))
    pick = step_order(counts_per_bucket, batches.shuffled, plan_spec.step_batches, strategy=plan_spec.strategy,
                      seed=seed, epoch=epoch)
    order = batches.bucket[pick]
    sizes = batches.sizes[pick]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    gather = np.repeat(batches.offsets[:-1][pick] - offsets[:-1], sizes) + np.arange(offsets[-1])
    return Plan(
        epoch=int(epoch), seed=int(seed), plan_spec=plan_spec,
        bucket=order, offsets=offsets,
        sample_ids=sample_ids[batches.members[gather]], lengths=batches.lengths[gather],
        max_len=batches.max_len[pick],
        counts={"in": int(sample_ids.size), "kept": int(offsets[-1]), "truncated": bk.truncated,
                "dropped_overlong": bk.dropped_overlong, "dropped_too_short": bk.dropped_short,
                "dropped_unsupervised": int(unsupervised.sum())},
        anchors=anchors[batches.members[gather]],
    )


def step_order(counts_per_bucket, shuffled, step_batches: int, *, strategy: str, seed: int, epoch: int) -> np.ndarray:
    """The epoch's batches in order (indices into `shuffled`'s batches), interleaved in whole optimizer steps:
    every W = step_batches consecutive positions (one step: the trainers' ranks and accumulation micro-steps)
    come from one bucket, so a step's batches cost its ranks about the same and none waits for another at the
    all-reduce (batches of one bucket hold about equal rows, tokens and anchors; batches of different buckets
    differ up to several-fold in the drafter's work: benchmarks/cpu_by_process.py, docs/notes/performance.md).
    Steps of one bucket are the units the strategy interleaves, so the order's guarantees (proportional,
    buckets run out together, short same-bucket runs) hold in steps. The batches a bucket leaves over (its
    count mod W) make mixed steps, interleaved as one more bucket would be; the last, partial one ends the
    epoch, so every step before it is whole. W = 1, or the `sequential` strategy (bucket after bucket: its
    steps already share a bucket but where one bucket ends): the batch order of `interleave_order` itself.

    shuffled: batch indices grouped by bucket (bucket-major, shuffled within), as data/buckets.form_batches
    gives them."""
    counts = np.asarray(counts_per_bucket, dtype=np.int64)
    shuffled = np.asarray(shuffled, dtype=np.int64)
    w = 1 if strategy == "sequential" else int(step_batches)
    starts = np.cumsum(counts) - counts
    whole = counts // w
    rest = np.concatenate([shuffled[s + f * w: s + n] for s, f, n in zip(starts, whole, counts)]) \
        if counts.size else np.zeros(0, np.int64)
    mixed, tail = divmod(rest.size, w)
    units = [shuffled[s: s + f * w].reshape(f, w) for s, f in zip(starts, whole)]
    unit_counts = whole
    if mixed:   # (no empty label: the strategies draw per label, and W = 1 must give interleave_order's order)
        units, unit_counts = units + [rest[:mixed * w].reshape(mixed, w)], np.append(whole, mixed)
    order = interleave_order(unit_counts, strategy=strategy, seed=seed, epoch=epoch)
    # position k takes the next unused step of label order[k]; `units` is grouped by label, so a stable sort
    # of the order lines positions up with it
    unit_pick = np.empty(order.size, dtype=np.int64)
    unit_pick[np.argsort(order, kind="stable")] = np.arange(order.size)
    return np.concatenate([np.concatenate(units)[unit_pick].reshape(-1), rest[mixed * w:]])


def plan_from_config(cfg, epoch: int | None = None) -> Plan:
    from dflash_ray.data.shards import read_lengths
    from dflash_ray.required import require

    plan_spec = PlanSpec.from_config(cfg)
    lengths = read_lengths(require(cfg, "data.shards"))
    return build_plan(lengths.sample_ids, lengths.num_tokens, plan_spec, num_supervised=lengths.num_supervised,
                      seed=cfg.seed, epoch=cfg.plan.epoch if epoch is None else epoch)
