"""benchmarks/gpu_check.sh is run once on a lent GPU machine: everything of it that can run here runs
here, on the CPU path of the same code (gloo for NCCL, fp32/bf16 on the CPU, small shapes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_runtime_paths_pass_on_the_cpu(tmp_path):
    out = tmp_path / "runtime.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["collective"]["backend"] == "gloo"
    assert report["features"]["bytes_per_value"] == 2                 # bf16 travels as int16 bits
    assert report["checkpoint"]["weights_equal"] and report["checkpoint"]["optimizer_equal"]
    assert report["recompute"]["max_relative_grad_difference"] == 0.0  # fp32 on the CPU: exact
    assert report["host_copy"] == {"ok": True, "skipped": "no CUDA device"}


@pytest.mark.slow
def test_the_whole_script_writes_one_json_of_every_part(tmp_path):
    env = {**os.environ, "GPU_CHECK_CPU": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report) >= {"drafter_step", "bucket_smallest", "bucket_largest", "target_capture", "runtime_paths"}
    assert report["bucket_smallest"]["anchors_per_batch"] == report["bucket_largest"]["anchors_per_batch"] == 32
    assert report["bucket_smallest"]["blocks"] <= 32 and report["bucket_largest"]["blocks"] <= 32
    assert report["target_capture"]["features_equal"] and report["runtime_paths"]["ok"]
    assert report["drafter_step"]["losses_finite"]
