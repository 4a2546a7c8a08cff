"""train.loss=distill on the real pipeline (the session's Ray, the tiny target, RUNTIME_RUN: two epochs): the
target actors compute the next-token top-k beside the features, the trainers learn from it, and with
train.features=hybrid the top-k is cached beside the features and read back in epoch 1, training what the
online job trains. The cached top-k of a sample equals the target's own softmax over its tokens (its Hugging
Face forward, written out here)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from helpers_cluster import RUNTIME_RUN
from dflash_ray.model.target import load_target
from dflash_ray.runtime.stream.feature_cache import FeatureCache, soft_label_key
from dflash_ray.runtime.stream.rows import decode_soft_labels
from dflash_ray.runtime.training.checkpoint_format import load_weights
from test_feature_cache_run import assert_same_weights, computed_tokens

pytestmark = [pytest.mark.slow, pytest.mark.rounding]


def test_distill_learns_from_the_targets_top_k_online_and_from_the_cache(train_run, job_run, tmp_path):
    distill = ["train.loss=distill", "train.distill_top_k=4"]
    _, online = train_run("distill-online", [*RUNTIME_RUN, *distill])
    cache = ["train.features=hybrid", f"train.feature_cache_dir={tmp_path / 'features'}"]
    spec, hybrid = train_run("distill-hybrid", [*RUNTIME_RUN, *distill, *cache])
    job = job_run["summary"]
    assert online["steps"] == hybrid["steps"] == job["steps"] and online["ledger"]["ok"] and hybrid["ledger"]["ok"]
    assert np.isfinite(online["final_loss"])
    # soft labels trained other weights than the hard labels of the CE job (same data, seed, batches)
    ce, soft = load_weights(Path(job["checkpoint"])), load_weights(Path(online["checkpoint"]))
    assert max(float((ce[k] - soft[k]).abs().max()) for k in ce) > 1e-3
    # epoch 1 read features and top-k from the cache (no target forward) and trained the same drafter
    assert hybrid["feature_cache"]["read_tokens"] > 0 and computed_tokens(hybrid) < hybrid["tokens"]
    assert_same_weights(online["checkpoint"], hybrid["checkpoint"])

    # a cached top-k is the target's softmax at every position of that sample
    soft_cache = FeatureCache(tmp_path / "features", soft_label_key(spec.feature_cache, 4))
    entries = sorted(soft_cache.dir.rglob("*.feat"))
    assert len(entries) == hybrid["feature_cache"]["written_samples"] > 0   # one per sample, as the features
    rows = pq.read_table(sorted(Path(spec.shards).glob("*.parquet"))[0], columns=["sample_id", "input_ids"]).to_pylist()
    target = load_target(spec.target_path)
    checked = 0
    for row in rows[:3]:
        ids = torch.tensor([row["input_ids"]])
        got = soft_cache.get(row["sample_id"], ids.shape[1])
        if got is None:   # a truncated sample is cached under its trained length
            continue
        top_ids, top_p = decode_soft_labels(got)
        with torch.no_grad():
            want_p, want_ids = torch.softmax(target(ids).logits.float()[0], -1).topk(4, dim=-1)
        assert torch.equal(top_ids, want_ids)
        torch.testing.assert_close(top_p, want_p, rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked > 0
