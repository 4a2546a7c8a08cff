"""The feed (runtime/stream/feed.py): each epoch's plan batches laid out in steps of W rows, a resume at a
cursor, max_steps, which rows a rank trains and the cursor after a step; and the plans it reads (runtime/spec.py
RunPlans), sent to Ray Train's controller as lengths and rebuilt there."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_ray.data.plan import PlanSpec, build_plan
from dflash_ray.runtime.stream.feed import FILLER, Cursor, build_feed, cursor_after, rank_rows


def _plans(num_samples=300, seed=0):
    rng = np.random.default_rng(0)
    lengths = rng.integers(40, 500, size=num_samples)
    plan_spec = PlanSpec(boundaries=[96, 192, 512], max_tokens_per_batch=1024, min_tokens=16)
    cache = {}

    def plan_for(e):
        if e not in cache:
            cache[e] = build_plan(np.arange(num_samples), lengths, plan_spec, seed=seed, epoch=e)
        return cache[e]

    return plan_for


@pytest.mark.parametrize("per_step", [1, 2, 3, 4])
def test_feed_covers_each_epoch_once_in_plan_order(per_step):
    plan_for = _plans()
    feed = build_feed(plan_for, Cursor(), per_step, epochs=2, max_steps=None)
    t = feed.table.to_pydict()
    assert feed.num_rows == feed.steps * per_step and t["index"] == list(range(feed.num_rows))
    for e in (0, 1):
        n = plan_for(e).num_batches
        pos = [p for p, ep in zip(t["position"], t["epoch"]) if ep == e]
        real = [p for p in pos if p != FILLER]
        assert real == list(range(n))                       # plan order, every batch once
        assert len(pos) % per_step == 0                        # a step never spans two epochs
        assert all(p == FILLER for p in pos[n:])            # fillers only at the epoch's tail
        assert feed.epoch_steps[e] == math.ceil(n / per_step)
    # rows carry the plan's batches
    k = t["position"].index(5)
    assert t["sample_ids"][k] == plan_for(0).batch(5).tolist()
    assert feed.schedule_steps == feed.total_steps == feed.steps


def test_feed_resumes_at_cursor_and_stops_at_max_steps():
    plan_for = _plans()
    n0 = plan_for(0).num_batches
    full = build_feed(plan_for, Cursor(), 2, epochs=2, max_steps=None)
    part = build_feed(plan_for, Cursor(), 2, epochs=2, max_steps=5)
    assert part.steps == 5 and part.total_steps == 5 and part.schedule_steps == full.steps
    rest = build_feed(plan_for, Cursor(0, 10, 5), 2, epochs=2, max_steps=None)
    assert rest.table.column("position").to_pylist()[:3] == [10, 11, 12]
    assert rest.total_steps == full.total_steps == rest.schedule_steps
    # a different W from the same global position: same batches, different step boundaries
    rest3 = build_feed(plan_for, Cursor(0, 10, 5), 3, epochs=2, max_steps=None)
    real = lambda f: [(e, p) for e, p in zip(f.table.column("epoch").to_pylist(),  # noqa: E731
                                             f.table.column("position").to_pylist()) if p != FILLER]
    assert real(rest3) == real(rest) and real(rest)[0] == (0, 10) and len(real(rest)) == 2 * n0 - 10 + (
        plan_for(1).num_batches - n0)
    assert build_feed(plan_for, Cursor(2, 0, 99), 2, epochs=2, max_steps=None).steps == 0


def test_feed_resumed_mid_epoch_stops_at_max_steps_across_the_epoch_end():
    """A resume at (epoch 0, position p, step k) with max_steps = m trains steps k+1..m: the rest of
    epoch 0 (ceil((n0 - p) / W) steps, the last padded with fillers), then epoch 1 from position 0."""
    plan_for = _plans()
    n0, per_step, p, k = plan_for(0).num_batches, 2, 11, 4
    left_in_epoch0 = -(-(n0 - p) // per_step)
    m = k + left_in_epoch0 + 3                              # 3 steps into epoch 1
    feed = build_feed(plan_for, Cursor(0, p, k), per_step, epochs=2, max_steps=m)
    t = feed.table.to_pydict()
    assert feed.steps == m - k and feed.total_steps == m and feed.num_rows == (m - k) * per_step
    assert feed.epoch_steps == {0: left_in_epoch0, 1: 3}
    epoch0 = [q for q, e in zip(t["position"], t["epoch"]) if e == 0]
    assert [q for q in epoch0 if q != FILLER] == list(range(p, n0))
    assert len(epoch0) - (n0 - p) == (-(n0 - p)) % per_step     # fillers pad the epoch's last step only
    assert [q for q, e in zip(t["position"], t["epoch"]) if e == 1] == list(range(3 * per_step))
    # the LR schedule still spans every planned step of both epochs at this W
    assert feed.schedule_steps == k + left_in_epoch0 + -(-plan_for(1).num_batches // per_step)


def test_rank_rows_and_cursor_after():
    assert rank_rows(0, 4, 2, 0) == [0, 2] and rank_rows(0, 4, 2, 1) == [1, 3]
    assert rank_rows(3, 2, 2, 1) == [7]
    assert sorted(r for rank in range(3) for r in rank_rows(5, 6, 3, rank)) == list(range(30, 36))
    assert cursor_after(0, [4, 5], 11, 3) == Cursor(0, 6, 3)
    assert cursor_after(0, [10, FILLER], 11, 6) == Cursor(1, 0, 6)
    assert cursor_after(1, [9, 10], 11, 12) == Cursor(2, 0, 12)


def test_run_plans_travel_as_lengths_and_rebuild_the_same_plans():
    """What the driver hands Ray Train's controller: the lengths (one copy), not every epoch's built plan (a
    copy of the samples per epoch, which sat in the object store as the controller's arguments: with a store
    full of token blocks the controller waited for plasma memory forever). Rebuilt there, equal plans."""
    import pickle

    from dflash_ray.data.shards import SampleLengths
    from dflash_ray.runtime.spec import RunPlans

    n = 20_000
    rng = np.random.default_rng(1)
    tokens = rng.integers(40, 500, size=n).astype(np.int64)
    lengths = SampleLengths(np.arange(n, dtype=np.int64), tokens, tokens - 1, [], 0)
    spec = SimpleNamespace(shards="/nonexistent",   # read again nowhere: the lengths travel
                           plan=PlanSpec(boundaries=[96, 192, 512], max_tokens_per_batch=1024, min_tokens=16), seed=3)
    plans = RunPlans(spec, lengths)
    built = [plans(e) for e in range(10)]
    data = pickle.dumps(plans)
    # the lengths are 3 x 8 bytes a sample; each built plan would add its samples again (ids, lengths, anchors)
    assert len(data) < 3 * 8 * n * 1.5, len(data)
    there = pickle.loads(data)
    for e, plan in enumerate(built):
        again = there(e)
        assert again.num_batches == plan.num_batches
        for field in ("bucket", "offsets", "sample_ids", "lengths", "max_len", "anchors"):
            assert np.array_equal(getattr(again, field), getattr(plan, field)), (e, field)
