"""benchmarks/gpu_check.sh is run on a GPU machine: everything of it that can run here runs
here, on the CPU path of the same code (gloo for NCCL, fp32/bf16 on the CPU, small shapes).

The whole script runs once (`whole_script`); its first part is the runtime paths' command itself
(`gpu_check.py --device cpu --out $OUT/runtime_paths.json`), so the runtime paths' test reads that part
when the session runs the whole script, and runs the command alone only when it does not (`-m "not slow"`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WHOLE = "test_the_whole_script_writes_one_json_of_every_part"


@pytest.fixture(scope="module")
def whole_script(tmp_path_factory):
    """benchmarks/gpu_check.sh at its CPU shapes: (OUT, the finished process)."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "GPU_CHECK_CPU": "1", "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=600, env=env)
    return out, proc


def runtime_paths_report(request, tmp_path) -> dict:
    """The JSON of `gpu_check.py --device cpu` after asserting its exit status 0: the whole script's
    runtime_paths part (the same command, the script prints each part's exit status) when this pytest session
    runs the whole script, else the command run here."""
    if any(item.name == WHOLE for item in request.session.items):
        out, proc = request.getfixturevalue("whole_script")
        part = re.search(r"^== runtime_paths\n\s+exit (\d+)", proc.stdout, re.M)
        log = out / "runtime_paths.log"
        assert part and part.group(1) == "0", proc.stdout[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
        return json.loads((out / "runtime_paths.json").read_text())
    out = tmp_path / "runtime.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_runtime_paths_pass_on_the_cpu(request, tmp_path):
    report = runtime_paths_report(request, tmp_path)
    assert report["ok"] and report["collective"]["backend"] == "gloo"
    assert report["features"]["bytes_per_value"] == 2                 # bf16 travels as int16 bits
    assert report["checkpoint"]["weights_equal"] and report["checkpoint"]["optimizer_equal"]
    assert report["recompute"]["max_relative_grad_difference"] == 0.0  # fp32 on the CPU: exact
    assert report["host_copy"] == report["staging"] == {"ok": True, "skipped": "no CUDA device"}
    assert report["fsdp"]["ok"] and report["fsdp"]["loss"] == report["fsdp"]["ddp_loss"]   # exact on the CPU


@pytest.mark.slow
def test_the_whole_script_writes_one_json_of_every_part(whole_script):
    out, proc = whole_script
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report) >= {"drafter_step", "recipe_short", "recipe_long", "target_sizes", "runtime_paths",
                           "ce_chunk_128", "ce_chunk_256", "ce_chunk_512"}
    assert all(report[p] for p in ("drafter_step", "recipe_short", "recipe_long", "target_sizes", "runtime_paths"))
    # the recipe's density: every requested anchor of every row trained (no anchors_per_batch), 3 x 20 and 2 x 32
    assert report["recipe_short"]["anchors_per_batch"] is None and report["recipe_short"]["blocks"] == 3 * 20
    assert report["recipe_long"]["blocks"] == 2 * 32 and report["recipe_memory_max_over_min"] > 0
    assert [r["tokens"] for r in report["target_sizes"]["sizes"]] == [64, 128, 512, 1024]
    assert [report[f"ce_chunk_{c}"]["ce_chunk_rows"] for c in (128, 256, 512)] == [128, 256, 512]
    assert report["runtime_paths"]["ok"] and report["drafter_step"]["losses_finite"]
