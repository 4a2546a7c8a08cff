"""The stream's object store need per node and the start-up check against the nodes' stores and their
/dev/shm (sizing/object_store.py, runtime/cluster.py). Expected values by hand."""
from __future__ import annotations

import pytest

from dflash_ray.errors import UserError
from dflash_ray.sizing.object_store import store_problems, stream_store_need

GIB = 2 ** 30


def test_need_is_the_larger_of_the_operator_budgets_and_the_flight_window():
    # Qwen3-8B's largest batch, one a block: 16,384 tokens x (5 x 4,096 x 2 B features + 4 B id + 1 B mask)
    block = 16384 * (5 * 4096 * 2 + 5)
    # cluster=8gpu: 16 batches in flight, 2 trainers: 16 blocks + 2 x 2 held/prefetched = 20 > 3 x 4 = 12
    need = stream_store_need(block, 1, 16, 2)
    assert need == {"block_bytes": block, "rows_per_block": 1, "blocks": 20, "bytes": 20 * block,
                    "why": "flight window"}
    assert 12.5 < need["bytes"] / GIB < 12.6
    # tiny blocks of 64 batches, 4 in flight, 2 trainers: ceil(4 / 64) + 4 = 5 < 12: the operator budgets
    assert stream_store_need(1000, 64, 4, 2) == {"block_bytes": 1000, "rows_per_block": 64, "blocks": 12,
                                                  "bytes": 12000, "why": "operator budgets"}


def test_a_store_too_small_is_an_error_and_a_store_on_disk_a_warning():
    need = stream_store_need(GIB, 1, 16, 2)   # 20 GiB
    nodes = {"a" * 40: {"store": 10 * GIB, "shm": 64 * 2 ** 20, "ip": "10.0.0.1"},   # Ray's 10 GB floor, on /tmp
             "b" * 40: {"store": 200 * GIB, "shm": 1000 * GIB, "ip": "10.0.0.2"},    # fine
             "c" * 40: {"store": 30 * GIB, "shm": None, "ip": "10.0.0.3"}}           # no /dev/shm: not checked
    errors, warnings = store_problems(need, nodes)
    assert len(errors) == 1 and errors[0].startswith("node 10.0.0.1: its Ray object store is 10.00 GiB but the "
                                                     "stream needs ~20.00 GiB (20 blocks of up to 1,024 MiB")
    assert "--object-store-memory" in errors[0] and "cluster.max_batches_in_flight" in errors[0]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: node 10.0.0.1: /dev/shm is 0.06 GiB")
    assert "--shm-size=11g" in warnings[0] and "\n" not in warnings[0] + errors[0]
    assert store_problems(need, {"b" * 40: nodes["b" * 40]}) == ([], [])


def test_check_against_the_real_local_cluster(ray_session):
    """The local Ray of the tests (cluster=local: a 600 MB store, /dev/shm larger): a need of a few blocks
    passes without a warning; a need over the store fails with the line naming the node."""
    from dflash_ray.runtime.cluster import check_object_stores, node_stores

    nodes = node_stores(False, "target_slot")
    assert nodes and all(n["store"] > 0 and n["shm"] and n["shm"] > n["store"] for n in nodes.values())
    store = min(n["store"] for n in nodes.values())
    assert check_object_stores(stream_store_need(store / 100, 1, 4, 2), False, "target_slot", log=None) == []
    with pytest.raises(UserError, match=r"^node .*: its Ray object store is .* but the stream needs"):
        check_object_stores(stream_store_need(store / 10, 1, 16, 2), False, "target_slot", log=None)


def test_plan_prints_the_need_for_the_configs_largest_batch():
    """`dflash-ray plan`'s line: Qwen3-8B (hidden 4096, 5 taps, bf16 on GPUs) at the largest batch's 16,384
    padded tokens is 16,384 x (40,960 + 5) B a block, one a block (over cluster.stream_block_mb's 32 MiB)."""
    import numpy as np

    from dflash_ray.runtime.plan_sizing import plan_object_store
    from dflash_ray.config import compose_config

    class Plan:
        def padded_tokens(self):
            return np.array([1300, 16384, 9000])

    block = 16384 * (4096 * 5 * 2 + 5)
    eight = plan_object_store(compose_config(["model=qwen3_8b", "data=sharegpt", "cluster=8gpu"]), Plan())
    assert (eight["blocks"], eight["bytes"], eight["rows_per_block"]) == (20, 20 * block, 1)   # 16 + 2 x 2
    one = plan_object_store(compose_config(["model=qwen3_8b", "data=sharegpt", "cluster=1gpu"]), Plan())
    assert (one["blocks"], one["why"]) == (12, "operator budgets")                                # 4 + 2 < 12
    assert one["text"].startswith("object store: the stream needs ~7.50 GiB a node (12 blocks of up to 640 MiB")
