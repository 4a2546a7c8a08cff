"""Node-local streams, as pure functions: which feed rows a node's stream carries, how ranks group by node,
how many target actors each node gets, and the capacity model's per-node split. Expected values by hand."""
from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pytest

from dflash_ray.sizing.capacity import node_split
from dflash_ray.runtime.stream.feed import rank_rows
from dflash_ray.runtime.stream.pipeline import (MAX_ROWS_PER_BLOCK, block_budget_mb, block_rows, node_groups, rows_per_block,
                                        stream_blocks, target_shares)


def test_a_node_stream_carries_exactly_its_ranks_rows_in_order():
    # world 4, the node hosts ranks 1 and 3, blocks of 2 rows, 5 rows a rank: blocks alternate rank 1 / 3
    rows = [block_rows(b, 2, 5, (1, 3), 4) for b in range(stream_blocks(5, 2, 2))]
    assert rows == [[1, 5], [3, 7], [9, 13], [11, 15], [17], [19]]
    assert [block_rows(b, 1, 3, (0, 1, 2, 3), 4) for b in range(4)] == [[0], [1], [2], [3]]  # one row a block
    # round-robin of blocks over the node's ranks hands rank r exactly what feed.rank_rows assigns it
    per_step, world, steps = 4, 4, 5
    for ranks in [(0, 2), (1, 3), (3,), (0, 1, 2, 3)]:
        for per_block in (1, 2, 3, 7):
            per_rank = steps * per_step // world
            blocks = [block_rows(b, per_block, per_rank, ranks, world)
                      for b in range(stream_blocks(per_rank, per_block, len(ranks)))]
            for i, r in enumerate(ranks):
                got = [x for blk in blocks[i::len(ranks)] for x in blk]
                want = [x for s in range(steps) for x in rank_rows(s, per_step, world, r)]
                assert got == want, (ranks, per_block, r)
            assert len({len(b) for b in blocks[-len(ranks):]}) == 1   # every rank's last block alike


def test_rows_per_block_fits_the_largest_batch_in_the_budget():
    lengths = pa.array([[3, 5], [10], [2, 2, 2]], type=pa.list_(pa.int32()))   # padded: 2x5, 1x10, 3x2
    assert rows_per_block(lengths, 1000, 0.1) == 10          # 10 tokens x 1000 B; 0.1 MiB = 104,857 B
    assert rows_per_block(lengths, 1000, 0) == 1             # off
    assert rows_per_block(lengths, 0, 32) == 1               # width unknown
    assert rows_per_block(lengths, 1, 32) == MAX_ROWS_PER_BLOCK
    assert rows_per_block(lengths, 2**20, 100) == 6          # 10 MiB rows; capped at 64 MiB (half Ray's 128)
    assert rows_per_block(lengths, 2**24, 32) == 1           # a batch larger than the block: one a block


def test_the_block_budget_stays_a_small_part_of_the_smallest_object_store():
    nodes = {"a": {"object_store_memory": 400e6}, "b": {"object_store_memory": 64 * 2**30}}
    assert block_budget_mb(32, nodes) == pytest.approx(400e6 / 64 / 2**20)   # 5.96 MiB: a's store / 64
    assert block_budget_mb(32, {"b": nodes["b"]}) == 32                       # the configured value
    assert block_budget_mb(32, {}) == 32


def test_ranks_group_by_node_in_rank_order():
    assert node_groups(["a", "b", "a", "c"]) == [("a", (0, 2)), ("b", (1,)), ("c", (3,))]


def _cluster(**kw):
    base = dict(use_gpu=False, target_workers=3, target_resource="target_slot", drafter_gpus=1.0, target_gpus=1.0)
    return SimpleNamespace(**{**base, **kw})


def test_target_actors_follow_the_ranks_within_each_nodes_room():
    groups = [("a", (0, 2)), ("b", (1,))]
    # CPU: room is the custom resource; a wants round(3 * 2/3) = 2 but hosts 1, b wants 1
    assert target_shares(_cluster(), groups, 3, {"a": {"target_slot": 1}, "b": {"target_slot": 4}}) == [1, 1]
    assert target_shares(_cluster(), groups, 3, {"a": {"target_slot": 2}, "b": {"target_slot": 4}}) == [2, 1]
    assert target_shares(_cluster(), groups, 3, {"a": {"target_slot": 2}, "b": {}}) is None  # b hosts none
    # GPU: 8 GPUs a node less its trainers' shares; 12 actors over 4 ranks, 2 per node -> 6 each
    gpu = _cluster(use_gpu=True, target_workers=12)
    two = [("a", (0, 2)), ("b", (1, 3))]
    assert target_shares(gpu, two, 4, {"a": {"GPU": 8}, "b": {"GPU": 8}}) == [6, 6]
    assert target_shares(gpu, two, 4, {"a": {"GPU": 8}, "b": {"GPU": 4}}) == [6, 2]
    # the one stream anywhere: target_workers within the cluster's room beside the trainers
    assert target_shares(gpu, [(None, (0, 1, 2, 3))], 4, {"a": {"GPU": 8}, "b": {"GPU": 8}}) == [12]
    assert target_shares(_cluster(target_workers=2), [(None, (0, 1))], 2, {"h": {"target_slot": 1}}) == [1]


def test_capacity_model_splits_per_node_and_prices_one_stream():
    # 2 nodes x 8 GPUs, 12 target + 4 drafter; seed-run rates T = 25300/6, D = 25300/2
    t, d = 25300 / 6, 25300 / 2
    split = node_split(2, 8, 12, 4, t, d, feature_bytes_per_token=40960)
    assert [(n["target"], n["drafter"], n["idle_gpus"]) for n in split["nodes"]] == [(6, 2, 0), (6, 2, 0)]
    assert split["tokens_per_second"] == pytest.approx(2 * 25300)
    assert split["cross_node_bytes_per_second"] == 0
    # one stream: a batch's actor is on its trainer's node half the time -> half the features cross
    assert split["one_stream_cross_node_fraction"] == pytest.approx(0.5)
    assert split["one_stream_cross_node_bytes_per_second"] == pytest.approx(0.5 * 50600 * 40960)
    # 3 drafter workers on 2 nodes: 2 + 1, actors 8 and 4 capped by the free GPUs (6 and 7)
    odd = node_split(2, 8, 12, 3, t, d, None)
    assert [(n["target"], n["drafter"]) for n in odd["nodes"]] == [(6, 2), (4, 1)]
