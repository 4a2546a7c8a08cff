"""`dflash-ray tune` for real, as a user runs it: a 4-trial sweep (two learning rates x two anchor counts, every
trial to its end), in a process of its own with its own local Ray, interrupted (Ctrl-C) while a later trial
trains and then resumed by the same command. Checked from the files the runs and Ray Tune wrote: every trial
finishes, the best is exported, the target's features were computed once (the pass before the trials; no
trial's target actor computed a batch), each report Tune got is the run's own metrics (recomputed here from
metrics.jsonl), the finished trial was kept across the resume and the interrupted one resumed from its own
checkpoint with every step trained once. ASHA's stops are not run here: see SPACE."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EVERY = 6
STEPS = 12
# --scheduler none: a trial stopped by ASHA leaves its worker group's resources reserved on a loaded machine
# (the next trial's workers then time out; an open defect), so this sweep runs every trial to its end
SPACE = ["train.lr=3e-3,0", "model.anchors_per_batch=null,4", "--metric", "loss", "--scheduler", "none",
         "--max-concurrent", "1", "--report-every", str(EVERY)]
# a checkpoint every 2 steps and the first report at step 6: a trial holds a checkpoint well before ASHA can stop it
RUN = [f"train.max_steps={STEPS}", "train.checkpoint_every=2", "train.warmup_ratio=0", "cluster.num_cpus=4"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _has_checkpoint(run: Path) -> bool:
    return any(run.glob("ray_train/*/checkpoint_*"))


@pytest.fixture(scope="module")
def swept(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}   # its own local Ray, not the session's
    cmd = [sys.executable, "-m", "dflash_ray", "tune", *SPACE, f"run.root={root}", "run.name=sw", *tiny_data, *RUN]
    out_dir = root / "sw-tune"
    with open(root / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        interrupted = None
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and interrupted is None:
            runs = sorted(p for p in out_dir.glob("sw-*") if p.is_dir())
            if any((p / "summary.json").exists() for p in runs):
                training = [p for p in runs if _has_checkpoint(p) and not (p / "summary.json").exists()]
                if training:
                    interrupted = training[0].name
                    proc.send_signal(signal.SIGINT)   # Ctrl-C: Tune saves the sweep's state and stops its trials
            time.sleep(0.2)
        first_rc = proc.wait(timeout=300)
    first = (root / "first.log").read_text()
    assert interrupted is not None, f"the sweep was never seen mid-trial (rc {first_rc}):\n{first[-3000:]}"
    first_summary = json.loads((out_dir / "summary.json").read_text())
    kept = {p.parent.name: p.stat().st_mtime_ns for p in out_dir.glob("sw-*/summary.json")}
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    return dict(root=root, out=out_dir, first_rc=first_rc, first=first, first_summary=first_summary,
                interrupted=interrupted, kept=kept, second=second,
                summary=json.loads((out_dir / "summary.json").read_text()))


def test_an_interrupted_sweep_says_so_and_the_same_command_resumes_it(swept):
    assert swept["first_rc"] == 130, swept["first"][-3000:]
    assert "unfinished (interrupted): rerun the same command to resume" in swept["first"]
    assert swept["first_summary"]["unfinished"] >= 1
    second = swept["second"]
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "resuming the sweep" in second.stdout and "trial(s) unfinished" not in second.stdout
    # a trial that had finished before the interrupt was kept: not run again, its summary untouched
    assert swept["kept"]
    for name, mtime in swept["kept"].items():
        assert (swept["out"] / name / "summary.json").stat().st_mtime_ns == mtime
        assert len([e for e in _lines(swept["out"] / name / "events.jsonl") if e.get("event") == "streams"]) == 1


def test_the_interrupted_trial_resumed_from_its_own_checkpoint_every_step_once(swept):
    run = swept["out"] / swept["interrupted"]
    events = _lines(run / "events.jsonl")
    assert len([e for e in events if e.get("event") == "streams"]) == 2    # two invocations of its run
    ledger = _lines(run / "ledger.jsonl")
    steps = [r["step"] for r in ledger]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2     # each step once, in order
    positions = [(r["epoch"], p) for r in ledger for p in r["positions"] if p >= 0]
    assert len(positions) == len(set(positions))                           # each plan batch trained once
    row = next(r for r in swept["summary"]["rows"] if r["trial"] == swept["interrupted"])
    assert row["status"] == "finished" and len(steps) == STEPS


def test_every_trial_finishes_and_the_best_is_exported(swept):
    rows = swept["summary"]["rows"]
    assert len(rows) == 4 and {r["trial"] for r in rows} == {f"sw-0000{i}" for i in range(4)}
    assert {(r["train.lr"], r["model.anchors_per_batch"]) for r in rows} == {
        ("3e-3", "null"), ("3e-3", "4"), ("0", "null"), ("0", "4")}
    assert [r["status"] for r in rows] == ["finished"] * 4 and all(r["step"] == STEPS for r in rows)
    best = swept["summary"]["best"]
    finished = [r for r in rows if r["status"] == "finished"]
    assert best["loss"] == min(r["loss"] for r in finished)
    export = Path(best["run_dir"]) / "export"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    assert f"its drafter is {export}" in swept["second"].stdout
    assert (swept["out"] / "sweep_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_targets_features_were_computed_once_before_the_trials(swept):
    passes = swept["first_summary"]["feature_passes"]
    assert len(passes) == 1 and len(passes[0]["nodes"]) == 1      # one cache group, one node
    computed = passes[0]["nodes"][0]["computed_tokens"]
    for r in swept["summary"]["rows"]:
        summary_file = Path(r["run_dir"]) / "summary.json"
        s = json.loads(summary_file.read_text())
        assert computed == s["plan"]["tokens"]                      # the whole epoch, once
        assert s["features"].startswith("hybrid")
        assert sum(a["batches"] for a in s["target_actors"].values()) == 0   # no target forward in any trial
        assert s["feature_cache"]["read_tokens"] == s["tokens_this_invocation"] and s["feature_cache"]["written_samples"] == 0
    # the resumed invocation's pass found every sample cached
    assert swept["summary"]["feature_passes"][0]["nodes"][0]["computed_batches"] == 0


def test_each_report_tune_got_is_the_runs_own_loss(swept):
    for r in swept["summary"]["rows"]:
        run = Path(r["run_dir"])
        by_step = {m["step"]: m for m in _lines(run / "metrics.jsonl")}   # a replayed step: its last line
        reports = [x for x in _lines(swept["out"] / "sweep" / r["trial"] / "result.json") if not x.get("final")]
        assert reports, r
        for x in reports:
            step = x["step"]
            assert step % EVERY == 0
            window = [by_step[s]["loss"] for s in range(step - EVERY + 1, step + 1)]
            assert x["loss"] == pytest.approx(sum(window) / EVERY, rel=1e-12)
            assert x["tokens"] == sum(by_step[s]["tokens"] for s in range(1, step + 1))
