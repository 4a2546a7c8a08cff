"""The epoch plan: a pure, seeded function of the samples' lengths and the config.

plan = buckets -> token-budget batches -> interleaved global order. Anything that needs the order (the
Ray Data stream, a resume, the `plan` command) calls `build_plan` with the same inputs and gets the same
plan, on any machine, before or after a restart. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dflash_ray.data.buckets import assign_buckets, form_batches
from dflash_ray.data.interleave import interleave_order, order_measures
from dflash_ray.errors import UserError


@dataclass
class PlanSpec:
    boundaries: list[int]
    max_tokens_per_batch: int
    overlong: str = "truncate"
    chunk_batches: int = 64
    min_tokens: int = 0           # 2 * block_size: shorter samples cannot hold two blocks
    strategy: str = "default"

    def validate(self) -> None:
        b = list(self.boundaries)
        if not b or any(x <= 0 for x in b) or any(y <= x for x, y in zip(b, b[1:])):
            raise UserError(f"config key 'data.bucket_boundaries': must be positive and ascending, got {b}")
        if self.max_tokens_per_batch < b[-1]:
            raise UserError(
                f"config key 'data.max_tokens_per_batch': {self.max_tokens_per_batch} is smaller than the last "
                f"bucket boundary {b[-1]}, so the longest samples fit in no batch")
        if self.chunk_batches < 1:
            raise UserError("config key 'data.chunk_batches': must be >= 1")

    @classmethod
    def from_config(cls, cfg) -> "PlanSpec":
        plan_spec = cls(
            boundaries=[int(x) for x in cfg.data.bucket_boundaries],
            max_tokens_per_batch=int(cfg.data.max_tokens_per_batch),
            overlong=str(cfg.data.overlong),
            chunk_batches=int(cfg.data.chunk_batches),
            min_tokens=2 * int(cfg.model.block_size),
            strategy=str(cfg.data.interleave),
        )
        plan_spec.validate()
        return plan_spec


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
        k = len(self.plan_spec.boundaries)
        sizes = np.diff(self.offsets)
        tokens = self.batch_tokens()
        padded = self.padded_tokens()
        lower = [0] + list(self.plan_spec.boundaries[:-1])
        rows = []
        n = max(self.num_batches, 1)
        for b in range(k):
            sel = self.bucket == b
            rows.append({
                "bucket": b,
                "range": f"{lower[b] + 1}-{self.plan_spec.boundaries[b]}",
                "samples": int(sizes[sel].sum()),
                "batches": int(sel.sum()),
                "tokens": int(tokens[sel].sum()),
                "share": float(sel.sum() / n),
                "padding_efficiency": float(tokens[sel].sum() / padded[sel].sum()) if sel.any() else None,
            })
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "strategy": self.plan_spec.strategy,
            "samples": self.counts,
            "batches": self.num_batches,
            "tokens": int(tokens.sum()),
            "padded_tokens": int(padded.sum()),
            "padding_efficiency": float(tokens.sum() / max(padded.sum(), 1)),
            "max_tokens_per_batch": self.plan_spec.max_tokens_per_batch,
            "buckets": rows,
            "order": order_measures(self.bucket, k),
        }


def build_plan(sample_ids, num_tokens, plan_spec: PlanSpec, *, seed: int = 0, epoch: int = 0) -> Plan:
    plan_spec.validate()
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    if sample_ids.size > 1 and not (np.diff(sample_ids) > 0).all():
        # the plan must not depend on shard file order: work in sample_id order
        o = np.argsort(sample_ids, kind="stable")
        sample_ids, num_tokens = sample_ids[o], num_tokens[o]
    bk = assign_buckets(num_tokens, plan_spec.boundaries, overlong=plan_spec.overlong, min_tokens=plan_spec.min_tokens)
    rng = np.random.default_rng([int(seed), int(epoch), 1000])  # its own stream: interleave salts are 0..4
    batches = form_batches(bk.length, bk.bucket, plan_spec.boundaries, plan_spec.max_tokens_per_batch,
                           plan_spec.chunk_batches, rng)
    if batches.bucket.size == 0:
        raise UserError(f"no samples left to plan: {sample_ids.size} in, {bk.dropped_short} shorter than "
                        f"{plan_spec.min_tokens} tokens (2 x block_size), {bk.dropped_overlong} over the last "
                        f"bucket boundary {plan_spec.boundaries[-1]} (data.overlong=drop)")
    counts_per_bucket = np.bincount(batches.bucket, minlength=len(plan_spec.boundaries))
    order = interleave_order(counts_per_bucket, strategy=plan_spec.strategy, seed=seed, epoch=epoch)
    # position k takes the next unused batch of bucket order[k]; `shuffled` is grouped by bucket, so a
    # stable sort of the order lines positions up with it
    pick = np.empty(order.size, dtype=np.int64)
    pick[np.argsort(order, kind="stable")] = batches.shuffled
    sizes = batches.sizes[pick]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    gather = np.repeat(batches.offsets[:-1][pick] - offsets[:-1], sizes) + np.arange(offsets[-1])
    return Plan(
        epoch=int(epoch), seed=int(seed), plan_spec=plan_spec,
        bucket=order, offsets=offsets,
        sample_ids=sample_ids[batches.members[gather]], lengths=batches.lengths[gather],
        max_len=batches.max_len[pick],
        counts={"in": int(sample_ids.size), "kept": int(offsets[-1]), "truncated": bk.truncated,
                "dropped_overlong": bk.dropped_overlong, "dropped_too_short": bk.dropped_short},
    )


def plan_from_config(cfg, epoch: int | None = None) -> Plan:
    from dflash_ray.config import require
    from dflash_ray.data.shards import read_lengths

    plan_spec = PlanSpec.from_config(cfg)
    sample_ids, num_tokens, _ = read_lengths(require(cfg, "data.shards"))
    return build_plan(sample_ids, num_tokens, plan_spec, seed=int(cfg.seed),
                      epoch=int(cfg.plan.epoch if epoch is None else epoch))
