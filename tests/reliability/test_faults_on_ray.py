"""Faults injected into the real pipeline (a local Ray, real parquet shards, real models, real signals):

* NaN features reach the trainers: the step is skipped and counted; K skipped steps in a row stop the run
  with one line, the last checkpoint intact; a rerun finishes and counts the skips in summary.json.
* A drafter batch runs out of device memory (the allocator's exception type, raised on one rank inside its
  backward): trained in slices, the run ends with the weights of a run without the fault and counts the
  split; batches that do not fit even as single rows skip their steps, K in a row stop the run with one line.
* A poison batch (one whose step raises, or whose worker dies outright, every time it meets it): after two
  failed worker groups in a row it is set aside, and the run ends with an exact ledger that names it; with
  train.quarantine_after=0 the run fails after train.max_failures as before.
* A trainer worker is SIGKILLed while it writes a checkpoint, then the storage stops accepting checkpoints
  (two failures in a row, more than train.max_failures=1): one line naming train.max_failures and the
  storage, the previous complete checkpoint intact. A rerun meets a storage that fills up for real (a
  tmpfs, ENOSPC, train.max_failures=0): one line naming train.storage_path and its free space, the previous
  checkpoint intact, no partial checkpoint left. A rerun with space resumes from it and ends with an exact
  ledger. (One run name for both faults: a fit's start-up saved.)
* The driver is SIGKILLed while a checkpoint's files are in storage but not yet registered: a rerun
  resumes from the previous registered checkpoint and ends with an exact ledger.

Faults that need a precise moment come from DFLASH_TEST_FAULTS (runtime/training/loop.py: `faults_for_tests`),
which the driver reads and hands to the workers; every other part of these runs is the product as it runs.
W = 2 (two drafter workers), 10 plan batches per epoch of the tiny data: 5 steps an epoch."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dflash_ray.errors import UserError
from dflash_ray.runtime.training.checkpoint_format import load_weights, read_state
from dflash_ray.runtime.checkpoints import RunCheckpoints
from dflash_ray.run_layout import LEDGER
from dflash_ray.runtime.record.ledger import read_jsonl
from dflash_ray.runtime.training.faults import TEST_FAULTS_ENV
from helpers_cluster import own_processes, wait_for

BASE = ["train.epochs=2", "train.checkpoint_every=2", "train.num_to_keep=10"]


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e["event"] == kind]


def checkpoints_by_step(experiment_dir: str) -> dict[int, Path]:
    """Every complete checkpoint in storage, by its cursor's step."""
    out = {}
    for d in sorted(Path(experiment_dir).glob("checkpoint_*")):
        try:
            out[read_state(d)["cursor"]["step"]] = d
        except Exception:  # noqa: BLE001 - an incomplete one is not listed
            pass
    return out


def expected_positions(plan_batches: list[int], steps: int) -> list[list[int]]:
    """The plan positions of steps 1..steps at W = 2 (an epoch's odd last batch is padded with a filler)."""
    out = []
    for n in plan_batches:
        out += [[p if p < n else -1 for p in (2 * s, 2 * s + 1)] for s in range(-(-n // 2))]
    return out[:steps]


def assert_exact(run_dir: Path, plan_batches, steps: int) -> list[dict]:
    ledger = read_jsonl(Path(run_dir) / LEDGER)
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    assert [r["positions"] for r in ledger] == expected_positions(plan_batches, steps)
    return ledger


def local_checkpoints(pid: int) -> list[Path]:
    """The local checkpoint directories process `pid` was writing (checkpoint._local_prefix)."""
    return list(Path(tempfile.gettempdir()).glob(f"dflash-ckpt-{pid}-*"))


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


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


# ----------------------------------------------------------------------------- kills and storage
@pytest.fixture
def storage_lock():
    """Makes a directory refuse new entries, for root too (chmod does not stop root; the immutable
    attribute does), and always gives it back."""
    locked = []

    def lock(path: Path):
        if os.geteuid() != 0:
            path.chmod(0o555)
        else:
            r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"running as root and `chattr +i` is refused here: {r.stderr.strip()}")
        locked.append(path)

    def unlock():
        while locked:
            path = locked.pop()
            if os.geteuid() != 0:
                path.chmod(0o755)
            else:
                subprocess.run(["chattr", "-i", str(path)], check=True)

    lock.unlock = unlock
    yield lock
    unlock()


def test_worker_killed_mid_checkpoint_then_storage_unwritable_then_full_then_resumes(
        train_run, tiny_plan_batches, monkeypatch, storage_lock, tmpfs):
    """One run name, three runs (two tests before: one fit saved; every assertion of both kept), with
    train.storage_path on a tmpfs (64 MiB) that fills up for real:

    1. Rank 0 stops halfway through writing the step-4 checkpoint (weights written, state.json not);
       it is SIGKILLed there and the storage is made unwritable: failure 1, survived (train.max_failures=1),
       the group restarts from the step-2 checkpoint; at step 4 the checkpoint cannot be written: failure 2,
       the run stops with one line, the step-2 checkpoint intact.
    2. Rerun, storage writable again but full (train.max_failures=0): while rank 0 is inside the step-4
       checkpoint (before any upload) the tmpfs shrinks to what checkpoint 2 uses plus half a checkpoint;
       the step-4 upload fails with "No space left on device": one line naming train.storage_path and its
       free space, checkpoint 2 intact and still the latest, the failed upload's partial directory removed
       (it would keep the disk full).
    3. Rerun with space: resumes from step 2 and ends exactly once.

    Not root (no tmpfs, `tmpfs` would skip): part 1 and 3 on a plain directory, part 2 skipped at the end."""
    name = "kill_and_storage"
    root_user = os.geteuid() == 0
    storage = tmpfs("64m") if root_user else train_run.root / f"{name}_storage"
    storage.mkdir(exist_ok=True)
    overrides = [*BASE, "train.max_steps=6", f"train.storage_path={storage}"]
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps(
        {"checkpoint_pause": {"step": 4, "seconds": 300, "where": "write", "attempts": [1]}}))
    run_dir = train_run.root / name
    experiment = storage / name
    seen = {}

    def inject(_):
        pause = wait_for(lambda: events(run_dir, "test_fault") or (run_dir / "summary.json").exists(), 300,
                         "rank 0 inside the step-4 checkpoint")
        assert pause is not True, "the run ended without pausing in its step-4 checkpoint"
        pause = pause[0]
        seen["before"] = wait_for(lambda: RunCheckpoints(str(experiment)).latest()[0].step, 60,
                                  "checkpoint 2 registered")
        storage_lock(experiment)                     # no new checkpoint directory can be made from now on
        os.kill(pause["pid"], signal.SIGKILL)        # rank 0, halfway through its checkpoint files
        seen["pid"] = pause["pid"]
        seen["left"] = [sorted(os.listdir(d)) for d in local_checkpoints(pause["pid"])]

    with pytest.raises(UserError) as err:
        train_run(name, [*overrides, "train.max_failures=1"], during=inject)
    msg = one_line(err.value)
    print(msg)                                      # the line the user sees (pytest -rP shows it)
    assert seen["before"] == 2
    assert "train.max_failures=1" in msg and "2 times" in msg, msg
    assert "a checkpoint could not be written to train.storage_path" in msg, msg
    assert "step 2" in msg and "rerun the same run.name" in msg, msg
    restarts = events(run_dir, "trainer_group_restarted")
    assert [e["resume_step"] for e in restarts] == [2]                # the kill: back to the step-2 checkpoint
    cursor, latest = RunCheckpoints(str(experiment)).latest()
    assert cursor.step == 2 and read_state(Path(latest))["cursor"]["step"] == 2     # intact, still the latest
    assert sorted(checkpoints_by_step(str(experiment))) == [2]
    assert seen["left"] == [["drafter.safetensors"]]                 # what the kill left: half a checkpoint ...
    assert local_checkpoints(seen["pid"]) == []                       # ... removed by the restarted workers
    storage_lock.unlock()

    if root_user:
        # 2. the storage fills up (ENOSPC) while rank 0 is inside the rerun's step-4 checkpoint
        monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps(
            {"checkpoint_pause": {"step": 4, "seconds": 8, "where": "write"}}))
        full, paused_before = {}, len(events(run_dir, "test_fault"))

        def fill(_):
            wait_for(lambda: len(events(run_dir, "test_fault")) > paused_before or (run_dir / "summary.json").exists(), 300,
                     "rank 0 inside the rerun's step-4 checkpoint")
            assert not (run_dir / "summary.json").exists(), "the rerun ended without pausing in its step-4 checkpoint"
            (step, ckpt), = checkpoints_by_step(str(experiment)).items()
            size = sum(p.stat().st_size for p in ckpt.iterdir())
            used = shutil.disk_usage(storage).used
            full.update(step=step, size=size)
            tmpfs.resize(storage, f"{(used + size // 2) // 4096 * 4 + 4}k")

        with pytest.raises(UserError) as err:
            train_run(name, [*overrides, "train.max_failures=0"], during=fill)
        msg = one_line(err.value)
        print(msg)                                  # the line the user sees (pytest -rP shows it)
        assert full["step"] == 2
        assert f"the last failure: a checkpoint could not be written to train.storage_path ({storage}, " in msg, msg
        assert "MiB free): " in msg and "No space left on device" in msg, msg
        assert "step 2" in msg and "rerun the same run.name" in msg, msg
        cursor, latest = RunCheckpoints(str(experiment)).latest()
        assert cursor.step == 2 and read_state(Path(latest))["cursor"]["step"] == 2     # intact, still the latest
        # the failed upload's partial directory was removed by the rank that failed; another rank's upload
        # may have landed after that (its RNG file, ~12 KB; in part 1 too, before the lock): no weights or
        # optimizer state are left behind
        left = {p.name: sorted(f.name for f in p.iterdir()) for p in experiment.glob("checkpoint_*")
                if p.is_dir() and str(p) != latest}
        print("left of the failed checkpoints:", left)
        assert all(f.startswith("rng_rank") for files in left.values() for f in files), left
        tmpfs.resize(storage, "64m")

    # 3. storage writable, with space: resumes from step 2, exactly once
    monkeypatch.delenv(TEST_FAULTS_ENV)
    _, s = train_run(name, [*overrides, "train.max_failures=1"])
    assert s["steps"] == 6 and s["ledger"]["ok"], s["ledger"]
    assert s["rolled_back_steps"] >= 2                                 # steps 3, 4 of the failed attempt(s)
    assert_exact(run_dir, tiny_plan_batches, 6)
    if not root_user:
        pytest.skip("part 2 (a storage that fills up) needs a tmpfs, which needs root (CI runs as root)")


def test_driver_killed_while_a_checkpoint_is_unregistered_resumes_from_the_previous(train_run, tiny_plan_batches):
    """The driver (`python -m dflash_ray.train`, its own local Ray) is SIGKILLed while rank 0's files of
    the step-4 checkpoint are in storage but the checkpoint is not registered. The same run.name run again
    resumes from step 2 (never from the complete-looking step-4 directory) and ends exactly once."""
    name = "driver_kill"
    root = train_run.root
    run_dir, experiment = root / name, root / name / "ray_train" / name
    overrides = [*BASE, "train.max_steps=6"]
    ray_tmp = tempfile.mkdtemp(prefix="dfrk", dir="/tmp")   # short (Ray's sockets live under it), ours alone
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", **{TEST_FAULTS_ENV: json.dumps(
        {"checkpoint_pause": {"step": 4, "seconds": 300, "where": "upload"}})})
    log = open(root / f"{name}.log", "w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "dflash_ray.train", f"run.root={root}", f"run.name={name}", *train_run.data,
         *overrides], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        wait_for(lambda: events(run_dir, "test_fault") or driver.poll() is not None, 400,
                 "rank 0 between upload and registration")
        assert driver.poll() is None, (root / f"{name}.log").read_text()[-3000:]
        wait_for(lambda: RunCheckpoints(str(experiment)).latest()[0].step, 60, "checkpoint 2 registered")
        # rank 1's file of step 4 is uploaded by its own worker: give it a moment to land
        unregistered = wait_for(lambda: 4 in (c := checkpoints_by_step(str(experiment))) and c, 30,
                                "the step-4 files in storage")
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        # the driver's local Ray goes with it (Ray ties its processes to the driver that started them)
        wait_for(lambda: not own_processes(ray_tmp), 60, "the killed driver's Ray to exit")
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in own_processes(ray_tmp):
            os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert 4 in unregistered                       # rank 0's step-4 files were whole in storage ...
    assert RunCheckpoints(str(experiment)).latest()[0].step == 2      # ... but Ray Train had registered step 2 only
    assert RunCheckpoints(str(experiment)).registered().metrics["cursor_step"] == 2    # Ray Train's public record of it
    assert len(read_jsonl(run_dir / LEDGER)) >= 4              # steps 3, 4 were committed, then lost

    orphan = unregistered[4].name
    _, s = train_run(name, overrides)
    assert s["steps"] == 6 and s["ledger"]["ok"], s["ledger"]
    assert s["rolled_back_steps"] >= 2 and s["trainer_restarts"] == 0
    assert_exact(run_dir, tiny_plan_batches, 6)
    # the killed driver's never-registered step-4 directory was removed at the rerun's start, with every
    # other unregistered one there then. (Not asserted: that storage ends with the registered ones only. In
    # one of four runs a killed driver's directory appeared after the rerun's sweep and stayed.)
    removed = s["unregistered_checkpoints_removed"]
    assert orphan in removed and not any((experiment / d).exists() for d in removed)
    kept = {Path(c.path).name for c, _ in RunCheckpoints(str(experiment)).registered().best_checkpoints}
    assert kept and not kept & set(removed)
