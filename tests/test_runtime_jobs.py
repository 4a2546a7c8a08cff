"""The main job as a user submits it: `ray start --head` on 127.0.0.1, then `ray job submit` with
jobs/runtime_env.yaml (conftest.job_run): the job reaches SUCCEEDED, a `dflash_` metric shows on the
node's metrics export port while it runs, and its run directory holds what docs/runtime.md promises:
summary.json, export/ (loads in the reference `dflash` package), metrics.jsonl, the ledger, checkpoints,
and `dflash-ray plot` draws it.

The run: 2 epochs of the tiny test corpus, 11 plan batches per epoch, 2 drafter workers x 1 -> W = 2, so
each epoch's last step carries a filler row; checkpoints every 4 steps and at each epoch end."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_ray.runtime.checkpoint import load_weights, read_state


def test_job_succeeds_and_exports_a_dflash_metric(job_run):
    assert job_run["status"] == "SUCCEEDED", job_run["logs"][-4000:]
    assert job_run["metric"] and job_run["metric"].startswith("ray_dflash_"), \
        f"no ray_dflash_* metric on port {job_run['metrics_port']}"
    assert "step 12/12" in job_run["logs"]                    # the driver's progress lines
    assert "ledger exactly-once" in job_run["logs"]


def test_run_directory(job_run):
    run, s = Path(job_run["run_dir"]), job_run["summary"]
    assert s is not None, job_run["logs"][-4000:]
    assert s["ledger"]["ok"], s["ledger"]
    assert s["epochs_finished"] == [0, 1]
    assert s["steps"] == 12  # 11 batches per epoch, W = 2 -> 6 steps per epoch (the last one with a filler)
    assert s["failures_survived"] == 0
    assert s["tokens"] > 0 and s["tokens_per_second"] > 0 and s["final_loss"] > 0
    for key in ("epochs", "tokens", "tokens_per_second", "final_loss", "plan", "failures_survived", "export"):
        assert key in s
    assert s["export"] == str(run / "export")
    # the stream stayed inside the flight window; the target actor did every batch (fillers included)
    assert 2 <= s["max_batches_in_flight"] <= s["flight_window"]
    assert sum(t["batches"] for t in s["target_actors"].values()) == 24
    # every step logged; the loss goes down on this learnable corpus
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    # the last checkpoint: complete, at the end of the run
    state = read_state(Path(s["checkpoint"]))
    assert state["cursor"] == {"epoch": 2, "position": 0, "step": 12} and state["world_size"] == 2


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


def test_export_command_rewrites_export_from_latest_checkpoint(job_run, tiny_data):
    from dflash_ray.cli import main

    run = Path(job_run["run_dir"])
    (run / "export" / "model.safetensors").unlink()
    assert main(["export", f"run.root={run.parent}", "run.name=job", *tiny_data]) == 0
    exported = load_weights_file(run / "export" / "model.safetensors")
    for k, v in load_weights(Path(job_run["summary"]["checkpoint"])).items():
        assert torch.equal(exported[k], v), k


def load_weights_file(path):
    from safetensors.torch import load_file

    return load_file(str(path))
