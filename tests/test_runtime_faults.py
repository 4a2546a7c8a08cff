"""Failures injected into the real pipeline with SIGKILL, and a resume with a different worker count.

`faulty` is the job_run's configuration (2 epochs, W = 2), stopped early by train.max_steps=8, and with
no model.target_path (the target is synthesised into its run directory, from the same config and seed
as the job's). Mid-epoch a target actor is killed, then a trainer worker while rank 0 is inside the
step-8 checkpoint (held there by the tests' fault hook: steps 6 and 7, after the step-5 checkpoint at
epoch 0's end, are in the ledger and must be rolled back, with step 5 if its checkpoint was not registered
yet); the run must finish by itself. Then the same run name is rerun from the command line (`python -m dflash_ray.train`, a new process
starting its own local Ray) with ONE drafter worker and grad_accum=2 (still W = 2): it resumes at the
checkpoint's global plan position and finishes both epochs.

After all that, the ledger covers every planned batch of both epochs exactly once, in the same steps as
the uninterrupted job's, and the final drafter equals the uninterrupted job's (float tolerance; on this
machine it is bit for bit)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from helpers_cluster import RUNTIME_RUN, TrainRun, wait_for
from dflash_ray.runtime.training.checkpoint_format import load_weights, read_state
from dflash_ray.run_layout import LEDGER
from dflash_ray.runtime.record.ledger import read_jsonl
from dflash_ray.runtime.training.faults import TEST_FAULTS_ENV


def run_record(name):
    import ray

    from dflash_ray.runtime.coordinator import record_actor_name
    from dflash_ray.runtime.spec import coordinator_name

    def get():
        try:
            return ray.get_actor(record_actor_name(coordinator_name(name)), namespace="dflash")
        except ValueError:
            return None

    return wait_for(get, 180, "the run's record")


def step_of(coord):
    import ray

    return ray.get(coord.progress.remote())["step"]


def test_kills_then_resume_with_fewer_workers_match_uninterrupted(job_run, train_run, tiny_plan_batches, monkeypatch):
    import ray

    steps = [-(-n // 2) for n in tiny_plan_batches]             # W = 2 in both attempts
    assert steps[0] < 8 < sum(steps)                            # max_steps=8 stops inside epoch 1

    assert job_run["summary"] is not None, job_run["logs"][-4000:]
    killed = {}

    def inject(name):
        coord = run_record(name)
        wait_for(lambda: step_of(coord) >= 2, 300, "step 2")
        pid = next(iter(ray.get(coord.progress.remote())["pids"]["targets"].values()))
        os.kill(pid, signal.SIGKILL)                       # a target actor, mid-epoch
        killed["target"] = pid
        run_dir = Path(train_run.root) / name
        wait_for(lambda: any(e["event"] == "test_fault" for e in read_jsonl(run_dir / "events.jsonl")), 300,
                 "rank 0 inside the step-8 checkpoint")
        pid = ray.get(coord.progress.remote())["pids"]["workers"][1]
        os.kill(pid, signal.SIGKILL)                       # a trainer worker, steps 6 and 7 not checkpointed
        killed["trainer"] = pid

    # the first attempt's rank 0 waits inside the step-8 checkpoint (after its write, before the ledger
    # line and the registration): the kill lands there, whatever the machine's speed
    monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps(
        {"checkpoint_pause": {"step": 8, "seconds": 60, "where": "write", "attempts": [1]}}))

    # no model.target_path: the run synthesises its target (same config and seed as the job's)
    run = TrainRun(train_run.root, [o for o in train_run.data if not o.startswith("model.target_path=")])
    # one plan batch a block (cluster.stream_block_mb=0): the tiny batches would otherwise all share one
    # block a rank, computed before step 2, and the kill would land on an idle actor. The job it is
    # compared with ran the default blocks of many batches: the weights must not depend on that.
    spec, s = run("faulty", RUNTIME_RUN + ["train.max_steps=8", "cluster.stream_block_mb=0"], during=inject)
    monkeypatch.delenv(TEST_FAULTS_ENV)
    assert (Path(spec.run_dir) / "target" / "config.json").exists()        # synthesised
    assert set(killed) == {"target", "trainer"}
    assert s["target_restarts"] >= 1 and s["trainer_restarts"] >= 1, s
    # steps 6 and 7; and 5, when the step-5 checkpoint's async upload was not yet registered at the kill
    assert s["failures_survived"] >= 2 and s["rolled_back_steps"] >= 2, s
    assert s["steps"] == 8 and s["ledger"]["ok"], s["ledger"]
    assert read_state(Path(s["checkpoint"]))["cursor"] == {"epoch": 1, "position": 2 * (8 - steps[0]), "step": 8}
    # the default upload is async (Ray Train uploads while training goes on): the restart still resumed
    # from a whole checkpoint, and the final weights below equal the uninterrupted job's
    assert s["checkpoints"] and all(c["upload"] == "async" for c in s["checkpoints"] if "upload" in c)
    assert s["checkpoints"][-1]["step"] == 8 and s["checkpoints"][-1]["upload_seconds"] > 0
    assert s["checkpoint_cost"]["count"] == len(s["checkpoints"])

    # the same run name again, from the command line in a new process that starts its own local Ray, with
    # one drafter worker (W = 1 x 2): it resumes in epoch 1 where the step-8 checkpoint left it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_ray.train", f"run.root={train_run.root}", "run.name=faulty",
         *run.data, *RUNTIME_RUN, "cluster.drafter_workers=1", "train.grad_accum=2"],
        env=env, capture_output=True, text=True, timeout=600, cwd=spec.run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    total = sum(steps)
    assert "ledger exactly-once" in proc.stdout and f"step {total}/{total}" in proc.stderr  # result, progress
    s = json.loads((Path(spec.run_dir) / "summary.json").read_text())
    assert s["steps"] == total and s["epochs_finished"] == [0, 1]
    assert s["ledger"]["ok"], s["ledger"]
    assert s["drafter_workers"] == 1 and s["batches_per_step"] == 2

    job = job_run["summary"]
    ledger = read_jsonl(Path(spec.run_dir) / LEDGER)
    job_ledger = read_jsonl(Path(job_run["run_dir"]) / LEDGER)
    assert [r["positions"] for r in ledger] == [r["positions"] for r in job_ledger]
    assert max(r["attempt"] for r in ledger[:8]) >= 2          # steps 6.. were retrained after the restart

    a, b = load_weights(Path(job["checkpoint"])), load_weights(Path(s["checkpoint"]))
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |w_uninterrupted - w_faulty_resumed| = {worst:.3g}")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
