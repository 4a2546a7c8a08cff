"""train.features=hybrid on the real pipeline (the session's Ray, the tiny target, RUNTIME_RUN: two epochs):
the first epoch's batches run through the target actors and write each sample's features to the node's
cache; the second epoch reads them back and the target computes nothing; the drafter trained from the cache
equals the online job's (job_run), and a run that finds the cache warm reads every batch, stops inside
epoch 1 and resumes from its checkpoint to the same weights. train.features=offline computes every sample
before the drafter workers start, and its training stream reads only the cache (its target never loads)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers_cluster import RUNTIME_RUN
from dflash_ray.run_layout import LEDGER
from dflash_ray.runtime.record.ledger import read_jsonl
from dflash_ray.runtime.training.checkpoint_format import load_weights


def computed_tokens(summary) -> int:
    return sum(t["tokens"] for t in summary["target_actors"].values())


def assert_same_weights(a_ckpt, b_ckpt):
    a, b = load_weights(Path(a_ckpt)), load_weights(Path(b_ckpt))
    assert a.keys() == b.keys()
    for k in a:   # features from the cache equal the target's up to the rounding of another batch shape
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


def test_hybrid_reads_later_epochs_from_the_cache_and_trains_what_online_trains(train_run, job_run, tmp_path,
                                                                                 tiny_plan_batches):
    cache = [f"train.features=hybrid", f"train.feature_cache_dir={tmp_path / 'features'}"]
    spec, cold = train_run("hybrid-cold", [*RUNTIME_RUN, *cache])
    job = job_run["summary"]
    assert job["features"].startswith("online") and not (job["feature_cache"] or {}).get("read_rows")
    assert cold["features"].startswith("hybrid") and spec.feature_cache
    fc = cold["feature_cache"]
    # every sample written once (epoch 0), epoch 1 read back: no target forward for it
    entries = list((tmp_path / "features" / spec.feature_cache).rglob("*.feat"))
    assert fc["written_samples"] == len(entries) > 0 and fc["damaged"] == 0 and fc["write_errors"] == 0
    assert fc["read_rows"] > 0 and fc["read_tokens"] > 0
    assert fc["read_tokens"] + computed_tokens(cold) == cold["tokens"] == job["tokens"]
    assert computed_tokens(cold) < job["tokens"] == computed_tokens(job)
    assert cold["steps"] == job["steps"] and cold["ledger"]["ok"]
    ledger, job_ledger = read_jsonl(Path(spec.run_dir) / LEDGER), read_jsonl(Path(job_run["run_dir"]) / LEDGER)
    assert [r["positions"] for r in ledger] == [r["positions"] for r in job_ledger]
    assert_same_weights(job["checkpoint"], cold["checkpoint"])

    # the same key again (another run of the same data and target): every batch read, none computed; it stops
    # inside epoch 1 and resumes from that checkpoint, reading the cache again
    stop = tiny_plan_batches[0] // 2 + 2
    spec, part = train_run("hybrid-warm", [*RUNTIME_RUN, *cache, f"train.max_steps={stop}"])
    assert part["steps"] == stop and computed_tokens(part) == 0 and part["feature_cache"]["written_samples"] == 0
    spec, warm = train_run("hybrid-warm", [*RUNTIME_RUN, *cache])
    assert warm["steps"] == job["steps"] and warm["ledger"]["ok"] and computed_tokens(warm) == 0
    assert warm["feature_cache"]["read_tokens"] == warm["tokens_this_invocation"] > 0
    assert_same_weights(cold["checkpoint"], warm["checkpoint"])
    summary = json.loads((Path(spec.run_dir) / "summary.json").read_text())
    assert summary["features"].startswith("hybrid")


def test_offline_computes_every_sample_first_and_training_only_reads_the_cache(train_run, job_run, tmp_path,
                                                                                tiny_plan_batches):
    cache = ["train.features=offline", f"train.feature_cache_dir={tmp_path / 'features'}"]
    spec, run = train_run("offline", [*RUNTIME_RUN, *cache])
    job = job_run["summary"]
    assert run["features"].startswith("offline") and spec.features == "offline"
    off = run["offline_features"]
    # the pass: every batch of epoch 0 (the tiny data's plan, RUNTIME_RUN) computed once, by as many actors as
    # the session's Ray has target slots (no trainer holds one yet)
    import ray

    assert off["rows"] == off["computed_batches"] == tiny_plan_batches[0]
    assert off["actors"] == int(ray.cluster_resources()[spec.cluster.target_resource])
    entries = list((tmp_path / "features" / spec.feature_cache).rglob("*.feat"))
    assert run["feature_cache"]["written_samples"] == len(entries) > 0
    # training read every token of both epochs from the cache: the target computed epoch 0's tokens, once
    assert run["feature_cache"]["read_tokens"] == run["tokens"] == job["tokens"]
    assert computed_tokens(run) == off["computed_tokens"] and 2 * off["computed_tokens"] == job["tokens"]
    events = [json.loads(x) for x in (Path(spec.run_dir) / "events.jsonl").read_text().splitlines()]
    loaded = [e for e in events if e["event"] == "target_loaded"]
    assert len(loaded) == 1   # the pass's actor; the training stream's actor never loads the target
    assert run["steps"] == job["steps"] and run["ledger"]["ok"]
    assert_same_weights(job["checkpoint"], run["checkpoint"])
