"""The token store read by Ray Data: lookups equal a direct read of the shards, bad rows are one line
naming the shard and the sample, and the per-process block cache stays within its bound."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers_data import write_shard

from dflash_ray.errors import UserError


def _shards(root, files=3, rows=40, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(10_000)[: files * rows]          # ids not in file order
    for f in range(files):
        lengths = rng.integers(5, 300, size=rows)
        write_shard(root / f"shard-{f:03d}.parquet", ids[f * rows:(f + 1) * rows], lengths, vocab=500, seed=f)
    return root


def _direct(root) -> dict:
    """sample_id -> (ids, mask), read with pyarrow alone (the oracle)."""
    out = {}
    for path in sorted(root.glob("*.parquet")):
        t = pq.read_table(path)
        for sid, ids, mask in zip(t["sample_id"].to_pylist(), t["input_ids"].to_pylist(), t["loss_mask"].to_pylist()):
            out[sid] = (ids, mask)
    return out


def test_store_built_by_ray_data_matches_a_direct_read(ray_session, tmp_path):
    import ray

    from dflash_ray.runtime.stream.token_store import TokenStore, build_token_store

    root = _shards(tmp_path / "shards")
    truth = _direct(root)
    # 16 KiB blocks: many blocks per shard, so lookups cross blocks and files
    handle, info = build_token_store(str(root), vocab_size=500, block_mb=16 / 1024, cache_mb=0.05)
    assert info.samples == len(truth) == 120
    assert info.tokens == sum(len(v[0]) for v in truth.values())
    assert info.blocks > 3                                 # more blocks than shards
    # cut at one size across shards, only the last block short (a non-strict repartition leaves a short
    # block at each shard's end on some Ray versions)
    rows = [ray.get(ref).num_rows for ref in handle["blocks"]]
    assert len(set(rows[:-1])) == 1 and rows[-1] <= rows[0] and sum(rows) == 120
    store = TokenStore(**ray.get(ray.put(handle)))         # what a join task sees
    _check_lookups(store, truth)
    # the cache holds ~50 KB: it evicted, and refetched blocks still give the right tokens
    assert store.cache.bytes <= 0.05 * 2**20 or len(store.cache.blocks) == 1
    assert store.cache.fetches > info.blocks
    with pytest.raises(KeyError):
        store.batch(np.array([10_001]), np.array([1]), pad_id=0)


@pytest.mark.parametrize("ray_data", [None, True])
def test_a_corpus_of_one_block_is_read_by_the_driver_and_matches(ray_session, tmp_path, ray_data, monkeypatch):
    """At most block_mb of tokens: one block either way; by default read here (no Ray Data job), the same
    store as Ray Data's read."""
    import ray

    from dflash_ray.runtime.stream import token_store
    from dflash_ray.runtime.stream.token_store import TokenStore, build_token_store

    root = _shards(tmp_path / "shards")
    truth = _direct(root)
    calls = []
    real = token_store._read_one_block
    monkeypatch.setattr(token_store, "_read_one_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    handle, info = build_token_store(str(root), vocab_size=500, block_mb=1.0, ray_data=ray_data)
    assert len(calls) == (1 if ray_data is None else 0)
    assert info.blocks == 1 and info.samples == len(truth) == 120
    assert info.tokens == sum(len(v[0]) for v in truth.values())
    _check_lookups(TokenStore(**ray.get(ray.put(handle))), truth)


def _check_lookups(store, truth):
    rng = np.random.default_rng(1)
    all_ids = np.array(sorted(truth))
    for _ in range(20):
        pick = rng.choice(all_ids, size=6, replace=False)
        lengths = np.array([min(len(truth[s][0]), int(rng.integers(1, 320))) for s in pick])
        ids, mask = store.batch(pick, lengths, pad_id=-7)
        width = lengths.max()
        for i, (s, n) in enumerate(zip(pick, lengths)):
            want_ids = truth[s][0][:n] + [-7] * (width - n)
            want_mask = truth[s][1][:n] + [0] * (width - n)
            assert ids[i].tolist() == want_ids and mask[i].tolist() == want_mask


@pytest.mark.parametrize("ray_data", [True, False])
def test_a_bad_row_in_the_store_read_names_shard_and_sample(ray_session, tmp_path, ray_data):
    from dflash_ray.runtime.stream.token_store import build_token_store

    root = tmp_path / "shards"
    write_shard(root / "a.parquet", [1, 2, 3], [4, 4, 4], vocab=50)
    write_shard(root / "b.parquet", [10, 11], [3, 3], vocab=50,
                loss_mask=pa.array([[1, 1, 1], [1, 2, 1]], pa.list_(pa.int8())))
    with pytest.raises(UserError) as e:
        build_token_store(str(root), vocab_size=50, ray_data=ray_data)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"{root / 'b.parquet'}: sample_id 11: loss_mask values must be 0 or 1")


def test_in_memory_store_cuts_pads_and_spans_blocks():
    from dflash_ray.runtime.stream.token_store import TokenStore

    table = pa.table({"sample_id": pa.array([9, 4, 6], pa.int64()),
                      "input_ids": pa.array([[1, 2, 3], [4], [5, 6]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1, 1], [1], [1, 0]], pa.list_(pa.int8()))})
    store = TokenStore.from_table(table, rows_per_block=2)       # blocks [9, 4] and [6]
    ids, mask = store.batch(np.array([6, 9, 4]), np.array([2, 2, 1]), pad_id=0)
    assert ids.tolist() == [[5, 6], [1, 2], [4, 0]]
    assert mask.tolist() == [[1, 0], [0, 1], [1, 0]]


def test_token_store_pads_and_truncates():
    from dflash_ray.runtime.stream.token_store import TokenStore

    table = pa.table({"sample_id": pa.array([7, 3], pa.int64()),
                      "input_ids": pa.array([[1, 2, 3, 4], [5, 6]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1, 1, 1], [1, 1]], pa.list_(pa.int8())),
                      "num_tokens": pa.array([4, 2], pa.int32())})
    store = TokenStore.from_table(table, rows_per_block=1)   # two blocks
    ids, mask = store.batch(np.array([7, 3]), np.array([3, 2]), pad_id=0)   # sample 7 truncated to 3
    assert ids.tolist() == [[1, 2, 3], [5, 6, 0]] and mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    with pytest.raises(KeyError):
        store.batch(np.array([5]), np.array([1]), pad_id=0)
