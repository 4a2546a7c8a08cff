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
    assert report["host_copy"] == report["staging"] == {"ok": True, "skipped": "no CUDA device"}
    assert report["fsdp"]["ok"] and report["fsdp"]["loss"] == report["fsdp"]["ddp_loss"]   # exact on the CPU


@pytest.mark.slow
def test_the_whole_script_writes_one_json_of_every_part(tmp_path):
    env = {**os.environ, "GPU_CHECK_CPU": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report) >= {"drafter_step", "recipe_short", "recipe_long", "target_sizes", "runtime_paths",
                           "ce_chunk_128", "ce_chunk_256", "ce_chunk_512"}
    assert all(report[p] for p in ("drafter_step", "recipe_short", "recipe_long", "target_sizes", "runtime_paths"))
    # the recipe's density: every requested anchor of every row trained (no anchors_per_batch), 3 x 20 and 2 x 32
    assert report["recipe_short"]["anchors_per_batch"] is None and report["recipe_short"]["blocks"] == 3 * 20
    assert report["recipe_long"]["blocks"] == 2 * 32 and report["recipe_memory_max_over_min"] > 0
    assert [r["tokens"] for r in report["target_sizes"]["sizes"]] == [64, 128, 512, 1024]
    assert [report[f"ce_chunk_{c}"]["ce_chunk_rows"] for c in (128, 256, 512)] == [128, 256, 512]
    assert report["runtime_paths"]["ok"] and report["drafter_step"]["losses_finite"]
