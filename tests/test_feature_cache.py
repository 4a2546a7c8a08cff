"""The feature cache's files and choices (runtime/stream/feature_cache.py), without Ray: what is written is
what is read, a damaged or partial entry is never trained from, the key moves with what determines the
features, and train.features is answered by size, budget, disk and epochs."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dflash_ray.errors import UserError
from dflash_ray.runtime.stream.feature_cache import FeatureCache, cache_bytes, cache_key, choose_features


def features(n, width=6, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, width)).astype(dtype)


def test_written_entries_read_back_and_batches_pad_with_zeros(tmp_path):
    c = FeatureCache(tmp_path, "k")
    a, b = features(5, seed=1), features(3, seed=2)
    c.write_batch([7, 300], [5, 3], np.stack([a, np.pad(b, ((0, 2), (0, 0)))]))
    assert np.array_equal(c.get(7, 5), a) and np.array_equal(c.get(300, 3), b)
    assert c.get(7, 4) is None          # another trained length (a truncated row) is another entry
    got = c.read_batch([300, 7], [3, 5], width=8)
    assert got.shape == (2, 8, 6) and got.dtype == np.float32
    assert np.array_equal(got[0, :3], b) and not got[0, 3:].any()
    assert np.array_equal(got[1, :5], a) and not got[1, 5:].any()
    assert c.read_batch([7, 8], [5, 5], width=8) is None   # one sample missing: the batch is computed
    assert c.counts["written_samples"] == 2 and c.counts["read_rows"] == 1
    assert c.has_batch([300, 7], [3, 5]) and not c.has_batch([7, 8], [5, 5]) and not c.has_batch([7], [4])
    assert c.counts["read_rows"] == 1   # has_batch reads nothing
    # bf16 features travel as their int16 bits (rows.encode_features): the same bits come back
    bits = features(4, seed=3).view(np.int32).astype(np.int16)
    c.put(9, bits)
    assert c.get(9, 4).dtype == np.int16 and np.array_equal(c.get(9, 4), bits)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty"])
def test_a_damaged_entry_is_removed_counted_and_never_returned(tmp_path, damage):
    c = FeatureCache(tmp_path, "k")
    c.put(1, features(4))
    p = c.path(1, 4)
    data = bytearray(p.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x10
    elif damage == "truncate":
        data = data[:-8]
    elif damage == "header":
        data[:8] = b"NOTFEATS"
    else:
        data = bytearray()
    p.write_bytes(bytes(data))
    assert c.get(1, 4) is None and c.counts["damaged"] == 1 and not p.exists()
    assert c.read_batch([1], [4], width=4) is None   # and the batch is computed again, then rewritten
    c.write_batch([1], [4], features(4, seed=5)[None])
    assert np.array_equal(c.get(1, 4), features(4, seed=5))


def test_a_killed_writer_leaves_no_entry_and_a_full_disk_turns_the_cache_off(tmp_path):
    c = FeatureCache(tmp_path, "k")
    c.put(2, features(3))
    # a writer killed before its rename leaves only its temporary name: not an entry
    (c.path(2, 3).parent / f".{c.path(5, 3).name}.abcd1234.tmp").write_bytes(b"partial")
    assert c.get(5, 3) is None and c.counts["damaged"] == 0
    # writes that fail (here: the entry's directory cannot be made) stop writing, counted, and raise nothing
    blocked = FeatureCache(tmp_path / "file-not-dir", "k")
    (tmp_path / "file-not-dir").write_text("x")
    blocked.write_batch([1, 2], [3, 3], np.zeros((2, 3, 6), np.float32))
    assert not blocked.writable and blocked.counts["write_errors"] == 1 and blocked.counts["written_samples"] == 0


def test_the_key_moves_with_the_target_files_taps_dtype_and_tokens(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"hidden_size": 8}')
    (target / "model.safetensors").write_bytes(b"w" * 64)
    key = cache_key(str(target), [1, 3], "float32", "tokens-a")
    assert key == cache_key(str(target), (1, 3), "float32", "tokens-a")
    assert key != cache_key(str(target), [1, 2], "float32", "tokens-a")
    assert key != cache_key(str(target), [1, 3], "bfloat16", "tokens-a")
    assert key != cache_key(str(target), [1, 3], "float32", "tokens-b")
    st = (target / "model.safetensors").stat()
    os.utime(target / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # weights rewritten
    assert key != cache_key(str(target), [1, 3], "float32", "tokens-a")


def test_train_features_answered_by_size_budget_disk_and_epochs():
    gib = 2**30
    # SmolLM2-135M's regenerated world: 115,238 tokens x 2 taps x 576 x 4 bytes (fp32) = 506 MiB
    assert cache_bytes(115_238, 2, 576, "float32") == 115_238 * 2 * 576 * 4 == 531_016_704
    assert cache_bytes(115_238, 2, 576, "bfloat16") * 2 == cache_bytes(115_238, 2, 576, "float32")
    assert choose_features("auto", 6, gib, 64, 100 * gib)[0] == "hybrid"
    assert choose_features("online", 6, gib, 64, 100 * gib)[0] == "online"
    mode, why = choose_features("auto", 6, 70 * gib, 64, 100 * gib)      # over the budget: online, says why
    assert mode == "online" and "train.feature_cache_gb=64" in why and "70.00 GiB" in why
    mode, why = choose_features("auto", 6, 10 * gib, 64, 5 * gib)        # over the free disk
    assert mode == "online" and "5.0 GiB free" in why
    assert choose_features("auto", 1, gib, 64, None)[0] == "online"      # one epoch: never read back
    assert choose_features("hybrid", 1, gib, 64, None)[0] == "hybrid"    # asked for: written for later runs
    with pytest.raises(UserError, match="config key 'train.features'.*70.00 GiB.*train.feature_cache_gb=64"):
        choose_features("hybrid", 6, 70 * gib, 64, None)
    # offline only when asked for (auto never takes it); refused like hybrid when it does not fit
    assert choose_features("offline", 1, gib, 64, None)[0] == "offline"
    assert choose_features("offline", 6, gib, 64, None)[0] == "offline"
    with pytest.raises(UserError, match="config key 'train.features': offline needs 70.00 GiB"):
        choose_features("offline", 6, 70 * gib, 64, None)
