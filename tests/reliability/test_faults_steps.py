"""Steps that fail in the real pipeline (a local Ray, real parquet shards, real models):

* NaN features reach the trainers: the step is skipped and counted; K skipped steps in a row stop the run
  with one line, the last checkpoint intact; a rerun finishes and counts the skips in summary.json.
* A drafter batch runs out of device memory (the allocator's exception type, raised on one rank inside its
  backward): trained in slices, the run ends with the weights of a run without the fault and counts the
  split; batches that do not fit even as single rows skip their steps, K in a row stop the run with one line.

Faults that need a precise moment come from DFLASH_TEST_FAULTS (runtime/training/faults.py: `faults_for_tests`),
which the driver reads and hands to the workers; every other part of these runs is the product as it runs.
W = 2 (two drafter workers), 10 plan batches per epoch of the tiny data: 5 steps an epoch. (One module a kind
of fault: under pytest-xdist each module runs on one worker, and these runs are minutes each.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_ray.errors import UserError
from dflash_ray.run_layout import LEDGER
from dflash_ray.runtime.checkpoints import RunCheckpoints
from dflash_ray.runtime.record.ledger import read_jsonl
from dflash_ray.runtime.training.checkpoint_format import load_weights, read_state
from dflash_ray.runtime.training.faults import TEST_FAULTS_ENV
from helpers_faults import BASE, assert_exact, checkpoints_by_step, events, expected_positions, one_line


# ----------------------------------------------------------------------------- NaN / Inf
def test_nonfinite_steps_are_skipped_counted_then_stop_the_run(train_run, tiny_plan_batches, monkeypatch):
    """Rank 1's batches get a NaN feature at steps 2, 5, 6, 7 (train.max_nonfinite_steps=3): steps 2, 5, 6
    are skipped on both ranks (rank 0's weights do not move though its own batches are fine), step 7 is the
    third in a row and stops the run, without a checkpoint; checkpoints 4, 5 and 6 hold the same weights.
    A rerun that meets the NaN at step 7 again stops there at once (the streak, 2 in checkpoint 6, is
    restored); one with the features fine finishes."""
    name = "nonfinite"
    overrides = [*BASE, "train.max_steps=8", "train.max_nonfinite_steps=3"]
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps({"nonfinite": {"steps": [2, 5, 6, 7], "rank": 1}}))
    with pytest.raises(UserError) as err:
        train_run(name, overrides)
    msg = one_line(err.value)
    print(msg)                                      # the line the user sees (pytest -rP shows it)
    assert "train.max_nonfinite_steps=3" in msg and "steps 5-7" in msg and "step 6" in msg, msg

    run_dir = train_run.root / name
    spec_exp = str(run_dir / "ray_train" / name)
    cursor, latest = RunCheckpoints(spec_exp).latest()
    assert cursor.step == 6 and read_state(Path(latest))["nonfinite_streak"] == 2   # intact, registered
    ckpts = checkpoints_by_step(spec_exp)
    assert sorted(ckpts) == [2, 4, 5, 6]                                   # none at the stop (step 7)
    w4, w5, w6 = (load_weights(ckpts[s]) for s in (4, 5, 6))
    for k in w4:                                                           # skipped steps moved nothing
        assert torch.equal(w4[k], w5[k]) and torch.equal(w4[k], w6[k]), k
        assert torch.isfinite(w6[k]).all(), k
    assert any(not torch.equal(load_weights(ckpts[2])[k], w4[k]) for k in w4)   # steps 3, 4 trained
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics if m["skipped_nonfinite"]] == [2, 5, 6, 7]
    assert [m["nonfinite_streak"] for m in metrics] == [0, 1, 0, 0, 1, 2, 3]
    ledger = read_jsonl(run_dir / LEDGER)                                  # consumed, marked, not retried
    assert [r["step"] for r in ledger if r.get("skipped") == "nonfinite"] == [2, 5, 6, 7]
    assert [r["positions"] for r in ledger] == expected_positions(tiny_plan_batches, 7)
    assert events(run_dir, "run_stopped")[-1]["step"] == 7

    # the same run.name again, the NaN still there at step 7: the streak is part of the checkpoint (2 at step
    # 6), so the rerun stops at its first step, as the uninterrupted run did, with the same line: a limit on
    # steps in a row of the run's timeline, which a rerun neither resets nor extends
    with pytest.raises(UserError) as err:
        train_run(name, overrides)
    again = one_line(err.value)
    assert again.startswith("training stopped at step 7: 3 steps in a row (steps 5-7)"), again
    rerun = read_jsonl(run_dir / "metrics.jsonl")[len(metrics):]      # what the rerun trained: step 7 only
    assert [(m["step"], m["nonfinite_streak"], m["skipped_nonfinite"]) for m in rerun] == [(7, 3, 1)], rerun

    # the same run.name again, the features fine now: it resumes from step 6 (the stopped step 7 rolls back)
    monkeypatch.delenv(TEST_FAULTS_ENV)
    _, s = train_run(name, overrides)
    assert s["steps"] == 8 and s["ledger"]["ok"], s["ledger"]
    assert s["skipped_nonfinite"] == 3 and s["skipped_nonfinite_steps"] == [2, 5, 6]
    assert s["rolled_back_steps"] == 1
    assert_exact(run_dir, tiny_plan_batches, 8)


# ----------------------------------------------------------------------------- out of device memory
def test_a_batch_that_runs_out_of_memory_trains_in_slices_and_the_run_ends_the_same(train_run, tiny_plan_batches,
                                                                                     monkeypatch):
    """train.oom_split=true (on CPUs it must be asked for: their allocator does not raise). Rank 1 runs out
    of memory inside its backward at steps 2 and 3 for any slice over one row: those batches train as single
    rows while rank 0 waits for the step's one gradient all-reduce. The run's final weights are those of the
    same run without the fault and with the split off (DDP's all-reduce inside the backward), up to float
    summation order; summary.json and metrics.jsonl count the two splits. Then batches that fit no slice at
    steps 2 and 3 (train.max_skipped_batches=2): both steps skipped, the second stops the run with one line."""
    steps = ["train.max_steps=4", "train.checkpoint_every=2"]
    _, plain = train_run("oom-plain", steps)
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps(
        {"oom": {"steps": [2, 3], "rank": 1, "where": "backward", "max_rows": 1}}))
    _, split = train_run("oom-split", [*steps, "train.oom_split=true"])
    assert plain["oom_splits"] == 0 and split["oom_splits"] == 2 and split["oom_split_steps"] == [2, 3], split
    assert split["skipped_oom"] == 0 and split["ledger"]["ok"]
    metrics = read_jsonl(train_run.root / "oom-split" / "metrics.jsonl")
    assert [m["oom_splits"] for m in metrics] == [0, 1, 1, 0]
    w_plain = load_weights(RunCheckpoints(str(train_run.root / "oom-plain" / "ray_train" / "oom-plain")).latest()[1])
    w_split = load_weights(RunCheckpoints(str(train_run.root / "oom-split" / "ray_train" / "oom-split")).latest()[1])
    for k in w_plain:
        torch.testing.assert_close(w_plain[k], w_split[k], rtol=1e-4, atol=1e-5)
    assert_exact(train_run.root / "oom-split", tiny_plan_batches, 4)

    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps(
        {"oom": {"steps": [2, 3], "rank": 0, "where": "forward", "max_rows": 0}}))
    with pytest.raises(UserError) as err:
        train_run("oom-unfit", [*steps, "train.oom_split=true", "train.max_skipped_batches=2"])
    msg = one_line(err.value)
    print(msg)
    assert msg.startswith("training stopped at step 3: 2 steps in a row (steps 2-3) had a batch that did not fit"), msg
    assert "train.max_skipped_batches=2" in msg and "model.max_block_tokens_per_batch" in msg, msg
    ledger = read_jsonl(train_run.root / "oom-unfit" / LEDGER)
    assert [r["step"] for r in ledger if r.get("skipped") == "oom"] == [2, 3]
    assert [r["positions"] for r in ledger] == expected_positions(tiny_plan_batches, 3)
