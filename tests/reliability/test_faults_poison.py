"""A poison batch in the real pipeline (a local Ray, real parquet shards, real models): one whose step
raises, or whose worker dies outright, every time it meets it. After two failed worker groups in a row it is
set aside, and the run ends with an exact ledger that names it; with train.quarantine_after=0 the run fails
after train.max_failures as before.

Faults that need a precise moment come from DFLASH_TEST_FAULTS (runtime/training/faults.py: `faults_for_tests`),
which the driver reads and hands to the workers; every other part of these runs is the product as it runs.
W = 2 (two drafter workers), 10 plan batches per epoch of the tiny data: 5 steps an epoch. (One module a kind
of fault: under pytest-xdist each module runs on one worker, and these runs are minutes each.)"""
from __future__ import annotations

import json

import pytest

from dflash_ray.errors import UserError
from dflash_ray.runtime.training.faults import TEST_FAULTS_ENV
from helpers_faults import assert_exact, events, one_line


# ----------------------------------------------------------------------------- a poison batch
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_poison_batch_is_set_aside_after_two_failures_and_the_run_goes_on(train_run, tiny_plan_batches,
                                                                            monkeypatch, how):
    """Plan batch 3 of epoch 0 (step 2, rank 1) ends its worker every time: its step raises an IndexError, or
    its process exits outright. Attempts 1 and 2 fail at step 2 (no checkpoint yet: each resumes from the
    start); attempt 3's feed sets it aside and the run finishes. With the error's line only that batch is
    named; a process that died saying nothing makes both batches of its step suspect. Every batch of the 6
    steps is in the ledger once, the set-aside ones marked, with the reason in summary.json."""
    name = f"poison-{how}"
    steps = ["train.max_steps=6", "train.checkpoint_every=4", "train.max_failures=3"]
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps({"poison_batch": {"epoch": 0, "position": 3, "how": how}}))
    _, s = train_run(name, steps)
    run_dir = train_run.root / name
    aside = [3] if how == "raise" else [2, 3]
    assert [(q["epoch"], q["position"], q["step"]) for q in s["quarantined"]] == [(0, p, 2) for p in aside], s
    reason = s["quarantined"][-1]["reason"]
    assert (reason.startswith("IndexError: test fault: poison batch 0:3") if how == "raise"
            else reason.startswith("a worker died while training it")), reason
    assert s["trainer_restarts"] == 2 and s["ledger"]["ok"], s["ledger"]
    ledger = assert_exact(run_dir, tiny_plan_batches, 6)
    assert [(r["step"], r.get("quarantined")) for r in ledger if r.get("quarantined")] == [(2, aside)]
    assert [e["position"] for e in events(run_dir, "batch_quarantined")] == aside
    assert json.loads((run_dir / "quarantine.json").read_text())   # a rerun of this run.name keeps them
    step2 = next(r for r in ledger if r["step"] == 2)   # nothing of a set-aside batch was trained
    assert [t == 0 for t in step2["tokens"]] == [p in aside for p in step2["positions"]], step2


def test_with_quarantine_off_a_poison_batch_fails_the_run(train_run, monkeypatch):
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps({"poison_batch": {"epoch": 0, "position": 3, "how": "raise"}}))
    with pytest.raises(UserError) as err:
        train_run("poison-off", ["train.max_steps=4", "train.max_failures=1", "train.quarantine_after=0"])
    msg = one_line(err.value)
    assert "train.max_failures=1" in msg and "IndexError: test fault: poison batch 0:3" in msg, msg
    assert not (train_run.root / "poison-off" / "quarantine.json").exists()
