"""The feed: which plan batches the trainers consume, in which order, starting from a resume cursor.

Pure (no Ray, no torch): the Ray Data source, the train workers' checks and the tests all call it.

    rows = epoch e's plan positions from the cursor on, then epoch e+1's from 0, ... up to the last
           epoch or `max_steps`; each epoch's tail padded with filler rows (position -1) to a multiple
           of W = drafter_workers x grad_accum, so an optimizer step never spans two epochs.
    step s of this feed = rows [s*W, (s+1)*W); row i goes to rank i mod workers (Ray Data's
           streaming_split hands equal blocks out round-robin when the order is preserved, and each block
           holds one rank's next rows: pipeline.block_rows), so rank r
           trains rows s*W + a*workers + r for accumulation micro-step a.

The cursor (epoch, position, step) is ours to keep: Ray Data iterators cannot be checkpointed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from dflash_ray.runtime.stream.rows import FEED_LISTS, FEED_SCALARS, FILLER, QUARANTINED


@dataclass(frozen=True)
class Cursor:
    """Where training stands: a checkpoint carries it (runtime/checkpoints.py reads it back) and a feed
    starts from it."""
    epoch: int = 0
    position: int = 0      # next plan position of `epoch` to train
    step: int = 0          # optimizer steps committed so far (global, over all epochs)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Cursor":
        if not d:
            return cls()
        return cls(int(d.get("epoch", 0)), int(d.get("position", 0)), int(d.get("step", 0)))


@dataclass
class Feed:
    cursor: Cursor
    batches_per_step: int
    table: pa.Table             # rows.FEED_COLUMNS, one row per plan batch (fillers included)
    steps: int                  # optimizer steps in this feed
    total_steps: int            # where this feed ends: cursor.step + steps (max_steps stops it early)
    epoch_steps: dict           # epoch -> steps that epoch has in this feed
    schedule_steps: int = 0     # steps of all planned epochs at this W: the LR schedule's length

    @property
    def num_rows(self) -> int:
        return self.table.num_rows


def steps_in_epoch(num_batches: int, start: int, batches_per_step: int) -> int:
    return -(-(num_batches - start) // batches_per_step) if num_batches > start else 0


def build_feed(plan_for_epoch, cursor: Cursor, batches_per_step: int, epochs: int, max_steps: int | None,
               quarantined=()) -> Feed:
    """plan_for_epoch(e) -> Plan. Rows of every remaining step, fillers included. `max_steps` stops the
    feed early; the LR schedule still spans every planned epoch (`schedule_steps`), so a run stopped
    early and resumed with a larger max_steps follows the same schedule as one that never stopped.
    `quarantined` (epoch, position): batches kept in their place (the step and the ledger have them) with
    bucket QUARANTINED, no samples and no tokens, so no target actor computes and no rank trains them."""
    if batches_per_step < 1:
        raise ValueError(f"batches_per_step must be >= 1, got {batches_per_step}")
    budget = None if max_steps is None else max(0, int(max_steps) - cursor.step)
    quarantined = {(int(e), int(p)) for e, p in quarantined}
    cols = {k: [] for k in FEED_SCALARS if k != "index"}
    sample_lists, length_lists, epoch_steps = [], [], {}
    steps, planned = 0, 0
    e, start = cursor.epoch, cursor.position
    while e < epochs:
        plan = plan_for_epoch(e)
        n = plan.num_batches
        k = steps_in_epoch(n, start, batches_per_step)
        planned += k
        if budget is not None:
            k = max(0, min(k, budget - steps))
        if k > 0:
            stop = min(n, start + k * batches_per_step)
            pos = np.arange(start, stop, dtype=np.int64)
            fill = k * batches_per_step - pos.size
            tokens = plan.batch_tokens()
            aside = np.array([(e, int(p)) in quarantined for p in pos], bool)
            bucket = plan.bucket[start:stop].astype(np.int64)
            bucket[aside] = QUARANTINED
            cols["epoch"].append(np.full(k * batches_per_step, e, np.int64))
            cols["position"].append(np.concatenate([pos, np.full(fill, FILLER, np.int64)]))
            cols["epoch_batches"].append(np.full(k * batches_per_step, n, np.int64))
            cols["bucket"].append(np.concatenate([bucket, np.full(fill, -1)]))
            cols["num_tokens"].append(np.concatenate([np.where(aside, 0, tokens[start:stop]).astype(np.int64),
                                                      np.zeros(fill, np.int64)]))
            for p, off in zip(pos, aside):
                a, b = (0, 0) if off else (plan.offsets[p], plan.offsets[p + 1])
                sample_lists.append(plan.sample_ids[a:b])
                length_lists.append(plan.lengths[a:b])
            sample_lists.extend([np.zeros(0, np.int64)] * fill)
            length_lists.extend([np.zeros(0, np.int64)] * fill)
            epoch_steps[e] = k
            steps += k
        e, start = e + 1, 0
    n_rows = steps * batches_per_step

    def cat(name):
        return np.concatenate(cols[name]) if cols[name] else np.zeros(0, np.int64)

    table = pa.table({
        "index": pa.array(np.arange(n_rows, dtype=np.int64)),
        **{k: pa.array(cat(k)) for k in cols},
        **{k: pa.array([x.tolist() for x in lists], type=pa.list_(pa.int64()))
           for k, lists in zip(FEED_LISTS, (sample_lists, length_lists))},
    })
    return Feed(cursor=cursor, batches_per_step=batches_per_step, table=table, steps=steps,
                total_steps=cursor.step + steps,
                epoch_steps=epoch_steps, schedule_steps=cursor.step + planned)


def rank_rows(step: int, batches_per_step: int, workers: int, rank: int) -> list[int]:
    """Feed row indices rank `rank` trains in step `step` (its accumulation micro-steps, in order)."""
    accum = batches_per_step // workers
    return [step * batches_per_step + a * workers + rank for a in range(accum)]


def cursor_after(epoch: int, positions, epoch_batches: int, step: int) -> Cursor:
    """The cursor after a committed step that trained `positions` (fillers = -1) of `epoch`."""
    real = [int(p) for p in positions if int(p) != FILLER]
    nxt = (max(real) + 1) if real else epoch_batches
    if nxt >= epoch_batches:
        return Cursor(epoch + 1, 0, step)
    return Cursor(epoch, nxt, step)
