"""The main job as a user submits it: `ray start --head` on 127.0.0.1, then `ray job submit` with
jobs/runtime_env.yaml (conftest.job_run): the job reaches SUCCEEDED, a `dflash_` metric shows on the
node's metrics export port while it runs, and its run directory holds what docs/training.md promises:
summary.json, export/ (loads in the reference `dflash` package), metrics.jsonl, the ledger, checkpoints,
and `dflash-ray plot` draws it.

The run: 2 epochs of the tiny test corpus, 2 drafter workers x 1 -> W = 2 batches per step, so an epoch
of n batches takes ceil(n / 2) steps (the last one with a filler row when n is odd); checkpoints every 4
steps and at each epoch end. Expected counts are derived from n (`tiny_plan_batches`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash_ray.runtime.training.checkpoint_format import load_weights, read_state


def steps_of(n_batches):
    return [-(-n // 2) for n in n_batches]                    # W = 2


def test_job_succeeds_and_exports_a_dflash_metric(job_run, tiny_plan_batches):
    assert job_run["status"] == "SUCCEEDED", job_run["logs"][-4000:]
    assert job_run["metric"] and job_run["metric"].startswith("ray_dflash_"), \
        f"no ray_dflash_* metric on port {job_run['metrics_port']}"
    total = sum(steps_of(tiny_plan_batches))
    assert f"step {total}/{total}" in job_run["logs"]         # the driver's progress lines
    assert "ledger exactly-once" in job_run["logs"]


@pytest.mark.rounding
def test_run_directory(job_run, tiny_plan_batches):
    run, s = Path(job_run["run_dir"]), job_run["summary"]
    assert s is not None, job_run["logs"][-4000:]
    steps = steps_of(tiny_plan_batches)
    assert s["ledger"]["ok"], s["ledger"]
    assert s["ledger"]["batches"] == sum(tiny_plan_batches)   # every planned batch, fillers not counted
    assert s["epochs_finished"] == [0, 1]
    assert s["steps"] == sum(steps) and s["batches_per_step"] == 2
    assert s["failures_survived"] == 0
    assert s["tokens"] > 0 and s["tokens_per_second"] > 0 and s["final_loss"] > 0
    for key in ("epochs", "tokens", "tokens_per_second", "final_loss", "plan", "failures_survived", "export"):
        assert key in s
    assert s["export"] == str(run / "export")
    # the stream stayed inside the flight window; the target actor did every row (fillers included)
    assert 2 <= s["max_batches_in_flight"] <= s["flight_window"]
    assert s["stream_rows_per_block"] > 1     # tiny batches share blocks (cluster.stream_block_mb)
    assert sum(t["batches"] for t in s["target_actors"].values()) == 2 * sum(steps)
    # every step logged; the loss goes down on this learnable corpus
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, sum(steps) + 1))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    # checkpoints every 4 steps, at each epoch's end and at the last step; the last one at the run's end
    due = sorted({s for s in range(1, sum(steps) + 1) if s % 4 == 0} | {steps[0], sum(steps)})
    assert [c["step"] for c in s["checkpoints"]] == due
    state = read_state(Path(s["checkpoint"]))
    assert state["cursor"] == {"epoch": 2, "position": 0, "step": sum(steps)} and state["world_size"] == 2
    # what each checkpoint cost: its step's metrics line (the seconds the step waited for rank 0's state, a
    # host snapshot whose files are written in the background, and its bytes: the tensors of the weights and
    # of the optimizer state, counted here from the files), its upload's seconds on a later line, the totals
    lines = {m["step"]: m for m in metrics if "checkpoint_bytes" in m}
    assert sorted(lines) == due
    assert all(m["checkpoint_write_seconds"] > 0 and m["checkpoint_upload"] == "async"
               and m["checkpoint_write"] == "background" for m in lines.values())
    final = Path(s["checkpoint"])
    assert lines[due[-1]]["checkpoint_bytes"] == _tensor_bytes(final)
    uploads = [m["checkpoint_upload_step"] for m in metrics if "checkpoint_upload_step" in m]
    assert uploads and set(uploads) <= set(due[:-1])        # the last one's upload ends after the last line
    assert all(c["upload"] == "async" and c["upload_seconds"] > 0 and c["bytes"] == lines[c["step"]]["checkpoint_bytes"]
               for c in s["checkpoints"])
    cost = s["checkpoint_cost"]
    assert cost["count"] == len(due) and cost["max_seconds"] == max(c["seconds"] for c in s["checkpoints"])
    assert cost["total_bytes"] == sum(m["checkpoint_bytes"] for m in lines.values())


def test_export_loads_in_reference_dflash(job_run):
    from dflash.model import DFlashDraftModel

    s = job_run["summary"]
    model = DFlashDraftModel.from_pretrained(s["export"])
    exported = model.state_dict()
    for k, v in load_weights(Path(s["checkpoint"])).items():
        assert torch.equal(exported[k], v), k


def test_plot_command_draws_pngs(job_run):
    from dflash_ray.cli import main

    run = Path(job_run["run_dir"])
    assert main(["plot", str(run)]) == 0
    for name in ("loss.png", "tokens_per_second.png", "buckets.png"):
        assert (run / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_command_rewrites_export_from_latest_checkpoint(job_run, tiny_data, tmp_path):
    """On a copy of the job's run directory (the job's own stays as the other tests read it)."""
    from dflash_ray.cli import main

    run = tmp_path / "job"
    shutil.copytree(job_run["run_dir"], run)
    (run / "export" / "model.safetensors").unlink()
    assert main(["export", f"run.root={tmp_path}", "run.name=job", *tiny_data]) == 0
    exported = load_weights_file(run / "export" / "model.safetensors")
    checkpoint = run / "ray_train" / "job" / Path(job_run["summary"]["checkpoint"]).name
    for k, v in load_weights(checkpoint).items():
        assert torch.equal(exported[k], v), k                     # the tiny target is fp32: so is the export
    assert (run / "export" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert main(["export", "--dtype", "bfloat16", f"run.root={tmp_path}", "run.name=job", *tiny_data]) == 0
    exported = load_weights_file(run / "export" / "model.safetensors")
    for k, v in load_weights(checkpoint).items():
        assert exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v.to(torch.bfloat16)), k
    assert json.loads((run / "export" / "config.json").read_text())["dtype"] == "bfloat16"


def load_weights_file(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _tensor_bytes(checkpoint: Path) -> int:
    """Bytes of every tensor in a checkpoint's weights and optimizer files."""
    from safetensors.torch import load_file

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(walk(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(walk(v) for v in obj)
        return 0

    weights = load_file(str(checkpoint / "drafter.safetensors"))
    return walk(weights) + walk(torch.load(checkpoint / "optim.pt", weights_only=False))
