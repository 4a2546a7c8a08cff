"""benchmarks/gpu_ray_check.sh is run on a GPU machine (the whole job through Ray on one GPU):
its CPU path, the same script at tiny shapes on a CPU head node it starts itself, runs here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_whole_job_through_its_own_head_node_and_the_bare_pieces(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(GPU_CHECK_CPU="1", OUT=str(tmp_path), PYTHON=sys.executable, RAY_AUTH_MODE="disabled",
               # the script stops its head with SIGTERM, on which `ray start --block` drains the node for up
               # to 30 s (for Ray Serve's proxies) and always waited the whole 30 s here (measured): this CPU
               # head serves nothing, so it stops at once
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_ray_check.sh")], capture_output=True, text=True,
                          timeout=900, env=env)
    log = (tmp_path / "job.log").read_text()[-3000:] if (tmp_path / "job.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + log
    report = json.loads((tmp_path / "gpu_ray_check.json").read_text())
    job, bare = report["job"], report["bare"]
    steps = -(-report["plan_batches"] // 2)                       # two plan batches a step (grad_accum 2)
    assert report["plan_batches"] % 2 == 1 and report["filler_rows"] == 1   # the epoch ends with a filler row
    assert job["steps"] == steps and job["ledger_ok"] is True
    assert job["segments"] == 2 and job["segment_change_extra_seconds"] is not None   # one segment change
    assert job["trainer_restarts"] == 0 and job["target_restarts"] == 0
    # a checkpoint at the segment's end and at the run's end, written in the background from a snapshot
    ck = [c for c in job["checkpoints"] if c.get("bytes")]
    assert [c["step"] for c in ck] == [-(-steps // 2), steps] and all(c.get("write") == "background" for c in ck)
    assert all(c["upload_seconds"] > 0 for c in ck)
    # the bare pieces trained the window's batches: the same tokens as the job's steps over the window
    lo, hi = job["window"]
    assert bare["batches"] == 2 * (hi - lo + 1) and bare["tokens"] == job["window_tokens"] > 0
    assert report["ratio"] > 0 and "Plasma memory usage" in (tmp_path / "object_store.txt").read_text()
    assert (tmp_path / "summary.json").exists() and not (tmp_path / "work" / "target").exists()
