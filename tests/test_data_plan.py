"""Buckets, token-budget batches and the epoch plan."""
import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers_data import realistic_lengths, write_shard

from dflash_ray.config import compose_config
from dflash_ray.data.buckets import assign_buckets
from dflash_ray.data.plan import PlanSpec, build_plan, plan_from_config
from dflash_ray.errors import UserError

SEED_BOUNDS = [512, 1024, 1536, 2304, 3296, 8192]


def plan_spec(**kw):
    base = dict(boundaries=SEED_BOUNDS, max_tokens_per_batch=16384, min_tokens=32)
    base.update(kw)
    return PlanSpec(**base)


def test_bucket_assignment_truncation_and_drops_are_counted():
    lengths = np.array([10, 31, 32, 512, 513, 8192, 8193, 20000])
    bk = assign_buckets(lengths, SEED_BOUNDS, overlong="truncate", min_tokens=32)
    assert bk.bucket.tolist() == [-1, -1, 0, 0, 1, 5, 5, 5]
    assert bk.length[-2:].tolist() == [8192, 8192]
    assert (bk.truncated, bk.dropped_short, bk.dropped_overlong) == (2, 2, 0)
    bk = assign_buckets(lengths, SEED_BOUNDS, overlong="drop", min_tokens=32)
    assert bk.bucket.tolist() == [-1, -1, 0, 0, 1, 5, -1, -1]
    assert (bk.truncated, bk.dropped_short, bk.dropped_overlong) == (0, 2, 2)


def test_every_kept_sample_is_planned_exactly_once_in_one_bucket_batches_within_budget():
    n = 20000
    lengths = realistic_lengths(n, seed=1)
    ids = np.arange(n) * 7 + 3
    plan = build_plan(ids, lengths, plan_spec(), seed=0, epoch=0)
    assert plan.counts["kept"] == n and np.array_equal(np.sort(plan.sample_ids), ids)
    by_id = dict(zip(ids.tolist(), np.minimum(lengths, 8192).tolist()))
    bounds = np.array([0] + SEED_BOUNDS)
    for k in range(0, plan.num_batches, 37):
        members = plan.batch(k)
        lens = np.array([by_id[i] for i in members])
        b = plan.bucket[k]
        assert ((lens > bounds[b]) & (lens <= bounds[b + 1])).all()  # one bucket per batch
        assert lens.max() * lens.size <= 16384 and lens[0] == lens.max() == plan.max_len[k]
    assert (plan.padded_tokens() <= 16384).all()
    # "about the same number of tokens": most batches fill most of the budget
    assert np.median(plan.padded_tokens()) > 0.75 * 16384


def test_padding_efficiency_on_a_realistic_distribution_beats_fixed_size_batches():
    lengths = realistic_lengths(50000, seed=2)
    plan = build_plan(np.arange(lengths.size), lengths, plan_spec(), seed=0)
    s = plan.summary()
    # recomputed from the input lengths (by sample id, truncated at the last boundary), not from the
    # plan's own token counts: real = sum of a batch's lengths, padded = rows x its longest row
    lens = np.minimum(lengths, SEED_BOUNDS[-1])[plan.sample_ids]
    starts, rows = plan.offsets[:-1], np.diff(plan.offsets)
    real = np.add.reduceat(lens, starts)
    padded = rows * np.maximum.reduceat(lens, starts)
    assert real.sum() == np.minimum(lengths, SEED_BOUNDS[-1]).sum() == s["tokens"]
    assert s["padded_tokens"] == padded.sum() and (padded <= 16384).all()
    assert s["padding_efficiency"] == pytest.approx(real.sum() / padded.sum(), rel=1e-12)
    for r in s["buckets"]:
        sel = plan.bucket == r["bucket"]
        assert r["samples"] == rows[sel].sum() and r["batches"] == sel.sum() and r["tokens"] == real[sel].sum()
        assert r["padding_efficiency"] == pytest.approx(real[sel].sum() / padded[sel].sum(), rel=1e-12)
    assert real.sum() / padded.sum() >= 0.95
    # the usual approach: shuffled fixed-size batches padded to their longest sample
    rng = np.random.default_rng(0)
    fixed = rng.permutation(np.minimum(lengths, 8192))[: lengths.size // 8 * 8].reshape(-1, 8)
    assert s["padding_efficiency"] > fixed.sum() / (fixed.max(1).sum() * 8) + 0.3


def test_plan_is_a_pure_function_and_batches_reshuffle_every_epoch():
    lengths = realistic_lengths(5000, seed=3)
    ids = np.arange(5000)
    a = build_plan(ids, lengths, plan_spec(), seed=5, epoch=2)
    b = build_plan(ids[::-1].copy(), lengths[::-1].copy(), plan_spec(), seed=5, epoch=2)  # shard order differs
    assert np.array_equal(a.sample_ids, b.sample_ids) and np.array_equal(a.offsets, b.offsets)
    c = build_plan(ids, lengths, plan_spec(), seed=5, epoch=3)
    pairs = lambda p: {frozenset(p.batch(k)[:2].tolist()) for k in range(p.num_batches) if p.offsets[k + 1] - p.offsets[k] > 1}
    assert len(pairs(a) & pairs(c)) < 0.2 * len(pairs(a))  # who shares a batch changes
    assert not np.array_equal(a.bucket, c.bucket)


def test_plan_order_follows_the_interleave_strategy():
    lengths = realistic_lengths(20000, seed=4)
    plan = build_plan(np.arange(lengths.size), lengths, plan_spec(strategy="default"), seed=0)
    order = plan.summary()["order"]
    assert order["longest_run"] == order["least_possible_longest_run"]
    seq = build_plan(np.arange(lengths.size), lengths, plan_spec(strategy="sequential"), seed=0)
    assert (np.diff(seq.bucket) >= 0).all()


def test_config_validation_names_the_key():
    with pytest.raises(UserError, match="data.max_tokens_per_batch"):
        plan_spec(max_tokens_per_batch=4096).validate()
    with pytest.raises(UserError, match="data.bucket_boundaries"):
        plan_spec(boundaries=[512, 256]).validate()


def test_plan_from_config_reads_shards_and_dumps_rows(tmp_path):
    lengths = realistic_lengths(600, seed=5)
    write_shard(tmp_path / "s" / "a.parquet", np.arange(300), lengths[:300])
    write_shard(tmp_path / "s" / "b.parquet", np.arange(300, 600), lengths[300:])
    cfg = compose_config([f"data.shards={tmp_path}/s", "data=sharegpt", "data.input=x", "data.tokenizer=y"])
    plan = plan_from_config(cfg)
    table = plan.to_arrow()
    assert table.column("position").to_pylist() == list(range(plan.num_batches))
    flat = np.concatenate([np.asarray(x) for x in table.column("sample_ids").to_pylist()])
    assert np.array_equal(flat, plan.sample_ids)
    tail = plan.to_arrow(start=3)
    assert tail.num_rows == plan.num_batches - 3 and tail.column("sample_ids")[0].as_py() == plan.batch(3).tolist()


def _longest_row(plan, lengths):
    """Each batch's longest row, from the input lengths by sample id (ids are 0..n-1 here)."""
    return np.maximum.reduceat(np.minimum(lengths, SEED_BOUNDS[-1])[plan.sample_ids], plan.offsets[:-1])


def test_batches_of_a_bucket_come_in_random_order_not_by_length():
    # inside a bucket, batches are cut from length-sorted chunks but drawn in a fresh random order: the
    # sequence of a bucket's batches (as the plan draws them) must not run longest- or shortest-first,
    # neither over the whole bucket nor chunk by chunk. For a random order, a batch is shorter than the
    # one before it half the time (ties left out); sorted orders give 0 or 1, sorted chunks ~63/64.
    lengths = realistic_lengths(20000, seed=11)
    for epoch in (0, 1):
        plan = build_plan(np.arange(lengths.size), lengths, plan_spec(), seed=0, epoch=epoch)
        longest = _longest_row(plan, lengths)
        downs = ups = 0
        for b in range(len(SEED_BOUNDS)):
            step = np.sign(np.diff(longest[plan.bucket == b]))
            d, u = int((step < 0).sum()), int((step > 0).sum())
            assert d + u >= 100  # enough batches in every bucket for the bounds below (4 sigma)
            assert 0.3 < d / (d + u) < 0.7, (epoch, b, d, u)
            downs, ups = downs + d, ups + u
        assert 0.45 < downs / (downs + ups) < 0.55, (epoch, downs, ups)


def test_another_epoch_changes_batch_mates_and_the_same_epoch_repeats_them():
    lengths = realistic_lengths(20000, seed=12)

    def mates(epoch):
        plan = build_plan(np.arange(lengths.size), lengths, plan_spec(), seed=3, epoch=epoch)
        out = {}
        for k in range(plan.num_batches):
            members = plan.batch(k).tolist()
            for i in members:
                out[i] = frozenset(members) - {i}
        return out

    a, again, other = mates(4), mates(4), mates(5)
    assert a == again
    shared = [i for i in a if a[i]]  # samples that have batch-mates at all
    assert len(shared) > 0.9 * lengths.size
    assert sum(a[i] == other[i] for i in shared) < 0.02 * len(shared)  # almost everyone has new mates


# ----------------------------------------------------------------------------- a step's batches from one bucket
def test_step_order_of_one_batch_a_step_is_the_interleave_order():
    from dflash_ray.data.interleave import interleave_order
    from dflash_ray.data.plan import step_order

    counts = np.array([7, 0, 3, 12, 1])
    shuffled = np.random.default_rng(0).permutation(counts.sum())   # any batch ids, grouped by bucket
    order = interleave_order(counts, strategy="default", seed=3, epoch=1)
    # position k takes the next unused batch of bucket order[k], in `shuffled`'s order within the bucket
    nxt = {b: list(shuffled[s: s + n]) for b, s, n in zip(range(5), np.cumsum(counts) - counts, counts)}
    expected = [nxt[b].pop(0) for b in order]
    assert step_order(counts, shuffled, 1, strategy="default", seed=3, epoch=1).tolist() == expected


@pytest.mark.parametrize("w", [2, 3])
def test_a_steps_batches_come_from_one_bucket_and_the_steps_interleave(w):
    from dflash_ray.data.interleave import interleave_order

    lengths = realistic_lengths(6000, seed=9)
    ids = np.arange(lengths.size)
    one = build_plan(ids, lengths, plan_spec(max_tokens_per_batch=8192), seed=2, epoch=1)
    plan = build_plan(ids, lengths, plan_spec(max_tokens_per_batch=8192, step_batches=w), seed=2, epoch=1)
    batches = lambda p: sorted(tuple(p.batch(k).tolist()) for k in range(p.num_batches))
    assert batches(plan) == batches(one)              # the same batches (the cut knows no steps), reordered
    counts = np.bincount(one.bucket, minlength=6)
    whole, left = counts // w, counts % w              # by hand: each bucket's whole steps and its leftovers
    mixed, tail = divmod(int(left.sum()), w)
    steps = plan.bucket[: plan.num_batches - tail].reshape(-1, w)
    pure = (steps == steps[:, :1]).all(axis=1)
    assert (~pure).sum() == mixed and np.array_equal(np.bincount(steps[pure, 0], minlength=6), whole)
    # the steps follow the strategy's order over the units (whole steps per bucket, leftover steps as one more)
    units = np.append(whole, mixed) if mixed else whole
    labels = np.where(pure, steps[:, 0], 6)
    assert labels.tolist() == interleave_order(units, strategy="default", seed=2, epoch=1).tolist()
    # the partial last step holds what is left of the leftovers; every earlier step is whole
    assert plan.num_batches == one.num_batches and tail == plan.num_batches % w
    order = plan.summary()["order"]
    assert order["unit"] == f"steps of {w} batches" and order["batches"] == steps.shape[0]
    assert order["longest_run"] == order["least_possible_longest_run"]


def test_the_plan_of_a_configured_run_steps_by_its_workers_and_accumulation():
    cfg = compose_config(["cluster.drafter_workers=3", "train.grad_accum=2", "cluster.max_batches_in_flight=12"])
    assert PlanSpec.from_config(cfg).step_batches == 6
