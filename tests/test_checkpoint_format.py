"""A checkpoint's files (runtime/training/checkpoint_format.py: complete or not, loaded back) and the lookup
of the latest one Ray Train registered (runtime/checkpoints.py), on a path or a URI."""
from __future__ import annotations

import json

import pytest

from dflash_ray.runtime.stream.feed import Cursor
from dflash_ray.runtime.training.model import lr_lambda


def test_checkpoint_manifest_detects_incomplete(tmp_path):
    import torch

    from dflash_ray.runtime.training.checkpoint_format import (IncompleteCheckpoint, load_checkpoint, read_state,
                                                              write_checkpoint, write_rank_files)

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.1))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    d = tmp_path / "ckpt"
    write_checkpoint(d, drafter=model, optimizer=opt, scheduler=sched, cursor=Cursor(0, 6, 3), world_size=2)
    with pytest.raises(IncompleteCheckpoint, match="rng_rank1"):
        read_state(d)
    write_rank_files(d, 1)
    assert read_state(d)["cursor"] == {"epoch": 0, "position": 6, "step": 3}
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda(10, 0.1))
    assert load_checkpoint(d, drafter=model2, optimizer=opt2, scheduler=sched2, rank=1) == Cursor(0, 6, 3)
    assert torch.equal(model2.weight, model.weight) and sched2.last_epoch == 1
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    (d / "optim.pt").write_bytes((d / "optim.pt").read_bytes()[:10])  # truncated upload
    with pytest.raises(IncompleteCheckpoint, match="optim.pt"):
        read_state(d)


@pytest.mark.parametrize("uri", [False, True], ids=["path", "file-uri"])
def test_checkpoint_lookup_reads_ray_trains_record_on_anyfilesystem(tmp_path, uri):
    """One reader (pyarrow's filesystem layer) for the cursor, the latest checkpoint and its files, so
    a URI storage path (s3://, gs://; file:// here) goes the same way as a local one."""
    from dflash_ray.runtime.training.checkpoint_format import cursor_metrics
    from dflash_ray.runtime.checkpoints import RunCheckpoints
    from helpers_ray_train import register_with_ray_train

    where = f"file://{tmp_path}" if uri else str(tmp_path)
    checkpoints = RunCheckpoints(where)
    assert checkpoints.latest() == (Cursor(), None) and not checkpoints.exists()
    (tmp_path / "checkpoint_x").mkdir()
    (tmp_path / "checkpoint_x" / "state.json").write_text("{}")
    register_with_ray_train(tmp_path, "checkpoint_w", cursor_metrics(Cursor(0, 2, 4)))
    register_with_ray_train(tmp_path, "checkpoint_x", {**cursor_metrics(Cursor(1, 4, 8)), "loss": 1.0})
    assert checkpoints.latest() == (Cursor(1, 4, 8), f"{where}/checkpoint_x") and checkpoints.exists()
    with checkpoints.local(checkpoints.latest()[1]) as d:
        assert (d / "state.json").read_text() == "{}"
        assert (d == tmp_path / "checkpoint_x") != uri          # a URI is copied to a local temp dir


def test_a_record_of_checkpoints_ray_train_cannot_read_is_one_line(tmp_path):
    """Ray Train refuses a record of another format (another Ray version's) or a damaged one: the driver says
    so in one line (a UserError: exit 2) naming the run's directory, instead of Ray's traceback."""
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.checkpoints import RunCheckpoints
    from dflash_ray.runtime.training.checkpoint_format import cursor_metrics
    from helpers_ray_train import register_with_ray_train

    register_with_ray_train(tmp_path, "checkpoint_x", cursor_metrics(Cursor(0, 2, 4)))
    assert RunCheckpoints(str(tmp_path)).latest()[0] == Cursor(0, 2, 4)
    (record,) = tmp_path.glob("*.json")     # Ray's own file (its name and format are Ray's, read here only)
    other = json.loads(record.read_text())
    other["ray_version"] = "9.0.0"          # a later Ray whose record lost a field this one needs
    del other["current_report_index"]
    record.write_text(json.dumps(other))
    with pytest.raises(UserError) as e:
        RunCheckpoints(str(tmp_path)).latest()
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{tmp_path}: Ray Train cannot read this run's record")
    assert "Ray version 9.0.0" in line and line.endswith("resume under the Ray version that wrote it, or train under a new run.name")
    record.write_text("{not json")
    with pytest.raises(UserError, match="Ray Train cannot read this run's record"):
        RunCheckpoints(str(tmp_path)).latest()
