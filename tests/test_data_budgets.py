"""The two budgets of a batch: the target's (token budget, weighted by the attention term) and the
drafter's (anchors x block size), as the planner forms and reports them; the shards' supervised counts."""
import json

import numpy as np
import pyarrow as pa
import pytest
from helpers_data import write_shard

from dflash_ray.config import compose_config
from dflash_ray.data.buckets import rows_per_batch
from dflash_ray.data.plan import PlanSpec, attention_tokens_of, build_plan, plan_from_config
from dflash_ray.data.shards import iter_validated, read_lengths
from dflash_ray.errors import UserError

TINY_BOUNDS = [96, 128, 192, 256, 384, 512]


def test_rows_per_batch_weighs_long_rows_by_their_attention_work():
    # budget 1024 tokens, La = 576: a full batch of the first bucket costs 1024 x (1 + 96/576) = 1194.67.
    # L=512: 1194.67 / (512 x (1 + 512/576)) = 1.235 -> 1 row (the token budget alone allows 2)
    # L=384: 1194.67 / 640 = 1.867 -> 2;  L=300: 1194.67 / 456.25 = 2.618 -> 3 (= the token cap)
    # L=96: 1194.67 / 112 = 10.67 -> 11, capped at 1024 // 96 = 10 (memory: never over the token budget)
    lengths = np.array([512, 384, 300, 96, 50])
    assert rows_per_batch(lengths, 1024, TINY_BOUNDS, 576.0).tolist() == [1, 2, 3, 10, 20]
    assert rows_per_batch(lengths, 1024, TINY_BOUNDS, None).tolist() == [2, 2, 3, 10, 20]
    assert rows_per_batch(np.array([2000]), 1024, TINY_BOUNDS, 576.0).tolist() == [1]  # at least one row


def test_attention_tokens_by_flop_count():
    # Qwen3-8B: projections 2*4096*32*128 + 2*4096*8*128 + 3*4096*12288 = 192,937,984 per layer,
    # over heads x head_dim = 4096 -> 47,104 tokens
    qwen3_8b = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "intermediate_size": 12288}
    assert attention_tokens_of(qwen3_8b) == 47104
    assert attention_tokens_of({"text_config": qwen3_8b}) == 47104
    # the tiny default target: (2*64*64 + 2*64*32 + 3*64*128) / 64 = 576
    assert compose_config([]).data.attention_tokens is None
    assert PlanSpec.from_config(compose_config([])).attention_tokens == 576
    assert PlanSpec.from_config(compose_config(["data.attention_tokens=0"])).attention_tokens is None
    assert PlanSpec.from_config(compose_config(["data.attention_tokens=900"])).attention_tokens == 900
    with pytest.raises(UserError, match="data.attention_tokens"):
        compose_config(["data.attention_tokens=-1"])


def test_attention_tokens_from_a_local_target_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 256}))  # kv = heads, hd = 64
    cfg = compose_config(["model=qwen3_8b", f"model.target_path={tmp_path}", "data.tokenizer=x"])
    # (2*128*128 + 2*128*128 + 3*128*256) / 128 = 1280
    assert PlanSpec.from_config(cfg).attention_tokens == 1280


def _spec(**kw):
    base = dict(boundaries=[128, 512], max_tokens_per_batch=1024, min_tokens=16, block_size=8, num_anchors=20)
    base.update(kw)
    return PlanSpec(**base)


def test_the_drafter_budget_per_batch_and_the_anchor_density():
    # 40 samples of 100 tokens, 50 supervised: 49 valid anchors each (a needs a and a+1 supervised),
    # 20 trained per row (num_anchors); 1024 // 100 = 10 rows per batch -> 4 batches of 200 anchors
    n = 40
    plan = build_plan(np.arange(n), np.full(n, 100), _spec(), num_supervised=np.full(n, 50))
    trained, valid = plan.drafter_anchors()
    assert plan.num_batches == 4 and trained.tolist() == [200] * 4 and valid.tolist() == [490] * 4
    row = plan.summary()["buckets"][0]
    assert row["block_tokens_per_batch"] == 200 * 8 and row["anchor_density"] == pytest.approx(200 / 490)
    assert row["drafter_fill"] is None  # no anchors_per_batch: nothing to fill
    # with anchors_per_batch = 64 the step trains 64 of a batch's 200 wanted anchors
    plan = build_plan(np.arange(n), np.full(n, 100), _spec(anchors_per_batch=64), num_supervised=np.full(n, 50))
    row = plan.summary()["buckets"][0]
    assert (row["anchors_per_batch"], row["drafter_fill"]) == (64, 1.0)
    assert row["anchor_density"] == pytest.approx(64 / 490)


def test_the_block_token_budget_cuts_batches_at_full_density():
    # 40 samples of 100 tokens, 50 supervised (49 valid anchors), num_anchors 20: every row trains 20 anchors
    # = 160 block tokens (block 8). A budget of 500 block tokens takes 3 rows (480; 4 would be 640), the
    # target's 1024-token budget 10: batches of 3, 3, ..., and a last one of 1 -> ceil(40 / 3) = 14 batches,
    # every row still trains all 20 of its anchors (density unchanged, nothing thinned)
    n = 40
    plan = build_plan(np.arange(n), np.full(n, 100), _spec(max_block_tokens_per_batch=500),
                      num_supervised=np.full(n, 50))
    trained, _ = plan.drafter_anchors()
    assert sorted(np.diff(plan.offsets).tolist()) == [1] + [3] * 13
    assert trained.sum() == 20 * n and (trained * 8 <= 500).all()
    s = plan.summary()
    assert s["block_tokens"] == 20 * n * 8 and s["block_tokens_per_token"] == pytest.approx(1.6)
    # the target's budget still binds where it is the smaller one: 2 rows x 500 tokens, 40 anchors = 320 <= 500
    plan = build_plan(np.arange(n), np.full(n, 500), _spec(max_block_tokens_per_batch=500),
                      num_supervised=np.full(n, 250))
    assert np.diff(plan.offsets).tolist() == [2] * 20
    # a row whose own anchors pass the budget makes a batch alone and is the one row thinned (to 500 // 8 = 62)
    plan = build_plan(np.arange(3), np.full(3, 100), _spec(max_block_tokens_per_batch=500, num_anchors=90),
                      num_supervised=np.full(3, 80))
    trained, valid = plan.drafter_anchors()
    assert np.diff(plan.offsets).tolist() == [1, 1, 1] and trained.tolist() == [62] * 3 and valid.tolist() == [79] * 3
    # the step's cap is the same number (runtime/spec.py passes it to the drafter's anchor_quota)
    cfg = compose_config(["model.max_block_tokens_per_batch=500", "model.num_anchors=90"])
    assert PlanSpec.from_config(cfg).batch_anchor_cap() == 62
    with pytest.raises(UserError, match="model.max_block_tokens_per_batch.*smaller than one block"):
        PlanSpec.from_config(compose_config(["model.max_block_tokens_per_batch=7"]))


def test_without_supervised_counts_every_token_counts_and_nothing_is_dropped_for_it():
    lengths = np.array([100, 100, 300])
    plan = build_plan(np.arange(3), lengths, _spec(num_anchors=1000))
    assert plan.counts["dropped_unsupervised"] == 0
    assert sorted(plan.anchors.tolist()) == [99, 99, 299]


def test_samples_that_cannot_hold_an_anchor_are_dropped_and_counted():
    sup = np.array([0, 1, 2, 50])
    plan = build_plan(np.arange(4), np.full(4, 100), _spec(), num_supervised=sup)
    assert sorted(plan.sample_ids.tolist()) == [2, 3]
    assert plan.counts["dropped_unsupervised"] == 2 and plan.counts["kept"] == 2
    with pytest.raises(UserError, match="2 with fewer than 2 supervised tokens"):
        build_plan(np.arange(2), np.full(2, 100), _spec(), num_supervised=np.array([0, 1]))


def test_truncation_bounds_the_valid_anchors():
    # 600 tokens truncated to 512, all supervised: 511 valid anchors, not 599
    plan = build_plan(np.arange(1), np.array([600]), _spec(num_anchors=1000), num_supervised=np.array([600]))
    assert plan.anchors.tolist() == [511]


def test_shards_carry_supervised_counts_and_older_shards_fall_back(tmp_path):
    d = tmp_path / "shards"
    write_shard(d / "a.parquet", [0, 1], [40, 60])  # no num_supervised column (made elsewhere)
    write_shard(d / "b.parquet", [2], [50], num_supervised=pa.array([50], pa.int32()))
    lengths = read_lengths(d)
    assert lengths.num_supervised.tolist() == [40, 60, 50]
    assert lengths.shards_without_supervised == 1
    assert sum(t.num_rows for _, t in iter_validated(d)) == 3  # loss_mask all ones: 50 matches


def test_a_supervised_count_that_disagrees_with_the_mask_is_one_line(tmp_path):
    d = tmp_path / "shards"
    write_shard(d / "a.parquet", [0, 1], [40, 60], num_supervised=pa.array([40, 59], pa.int32()))
    assert read_lengths(d).num_supervised.tolist() == [40, 59]  # plausible: the plan trusts it
    with pytest.raises(UserError, match=r"a.parquet: row 1 \(0-based\): num_supervised is 59 but loss_mask has 60 ones"):
        list(iter_validated(d))
    write_shard(d / "a.parquet", [0, 1], [40, 60], num_supervised=pa.array([40, 61], pa.int32()))
    with pytest.raises(UserError, match=r"a.parquet: row 1 \(0-based\): num_supervised is 61, outside 0..num_tokens \(60\)"):
        read_lengths(d)


def test_plan_command_reads_supervised_counts_from_the_shards(tmp_path):
    d = tmp_path / "shards"
    write_shard(d / "a.parquet", list(range(20)), [100] * 20,
                num_supervised=pa.array([1] * 5 + [30] * 15, pa.int32()))
    cfg = compose_config([f"data.shards={d}"])
    plan = plan_from_config(cfg)
    assert plan.counts["dropped_unsupervised"] == 5
    assert sorted(plan.anchors.tolist()) == [29] * 15
