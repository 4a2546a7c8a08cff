"""When a checkpoint is taken (steps and/or minutes, epoch ends, the last step), that every rank takes the
same decision, how the checkpoint is handed to Ray Train (sync or async upload), and what its cost shows
as (metrics lines, the coordinator's record). The real-cluster checks (an async run resumes exactly, the
metrics of a run) are in test_runtime_faults.py / test_runtime_jobs.py."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from dflash_ray.config import compose_config
from dflash_ray.errors import UserError
from dflash_ray.runtime.training.checkpoint import checkpoint_due
from dflash_ray.runtime.stream.feed import Cursor


def due_steps(n, every_steps=None, every_minutes=None, since=lambda s: 0.0, last=None, epoch_ends=()):
    return [s for s in range(1, n + 1)
            if checkpoint_due(s, every_steps, every_minutes, since(s), last_step=s == last,
                              end_of_epoch=s in epoch_ends)]


# minutes: 1 -> due when since_last_s >= 60; the "clock" below is seconds since the last checkpoint at step s
CLOCK = {1: 10.0, 2: 59.9, 3: 60.0, 4: 5.0, 5: 61.0, 6: 0.0, 7: 120.0, 8: 1.0}


@pytest.mark.parametrize("kw, expected", [
    (dict(every_steps=3), [3, 6]),                                          # steps only
    (dict(every_steps=3, last=8, epoch_ends=(5,)), [3, 5, 6, 8]),          # + epoch end, last step
    (dict(every_minutes=1.0), [3, 5, 7]),                                   # minutes only (>= 60 s)
    (dict(every_steps=4, every_minutes=1.0), [3, 4, 5, 7, 8]),            # both: either one
    (dict(every_steps=0, every_minutes=0.0, last=8, epoch_ends=(2,)), [2, 8]),   # both off
    (dict(every_steps=None, every_minutes=None), []),                       # None is off too
    (dict(every_steps=0, every_minutes=2.0, epoch_ends=(4,)), [4, 7]),      # 120 s >= 2 minutes
])
def test_checkpoint_due_table(kw, expected):
    assert due_steps(8, since=CLOCK.get, **kw) == expected


def test_checkpoint_due_old_call_is_steps_only():
    # the tiny demo's rule (train.checkpoint_every: 100) without a clock argument: as before
    assert [s for s in range(1, 15) if checkpoint_due(s, 4, last_step=s == 14, end_of_epoch=s in (6, 12))] \
        == [4, 6, 8, 12, 14]


def test_tiny_demo_keeps_its_step_interval_recipe_is_time_based():
    tiny = compose_config([])
    assert tiny.train.checkpoint_every == 100 and tiny.train.checkpoint_upload == "async"
    recipe = compose_config(["model=qwen3_8b", "data=sharegpt"])
    assert recipe.train.checkpoint_every is None and recipe.train.checkpoint_every_minutes == 30.0
    assert compose_config(["train.checkpoint_every=null", "train.checkpoint_every_minutes=5"]).train \
        .checkpoint_every_minutes == 5.0
    assert compose_config(["train.checkpoint_every=7", "train.checkpoint_every_minutes=0"]).train \
        .checkpoint_every == 7


@pytest.mark.parametrize("overrides, message", [
    (["train.checkpoint_every=0", "train.checkpoint_every_minutes=0"],
     "config key 'train.checkpoint_every_minutes': checkpoints are off"),
    (["train.checkpoint_every=null", "train.checkpoint_every_minutes=null"],
     "config key 'train.checkpoint_every_minutes': checkpoints are off"),
    (["train.checkpoint_every_minutes=-1"], "config key 'train.checkpoint_every_minutes': must be >= 0"),
    (["train.checkpoint_every=-2"], "config key 'train.checkpoint_every': must be >= 0"),
    (["train.checkpoint_upload=later"], "config key 'train.checkpoint_upload': 'later' is not one of async, sync"),
])
def test_checkpoint_keys_are_validated(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        compose_config(overrides)


def test_checkpoints_off_is_one_cli_line(capsys):
    from dflash_ray.cli import main

    assert main(["train", "--cfg", "job", "train.checkpoint_every=0", "train.checkpoint_every_minutes=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.checkpoint_every_minutes" in err and "train.checkpoint_every " in err


# ----------------------------------------------------------------------------- every rank decides the same
def _decide_on_two_ranks(rank, world, store, out, broadcast):
    import torch.distributed as dist

    from dflash_ray.runtime.training.checkpoint import rank0_value
    from helpers_ranks import init_ranks

    init_ranks(rank, world, store)
    try:
        # each rank's own clock differs (rank 1's runs 3x fast): only rank 0's may decide
        clock = [(s * 25.0) * (3 if rank else 1) for s in range(1, 13)]
        last, due = 0.0, []
        for step, now in enumerate(clock, start=1):
            since = now - last
            if broadcast:
                since = rank0_value(since, torch.device("cpu"), 2)
            if checkpoint_due(step, None, 1.0, since, last_step=False, end_of_epoch=False):
                due.append(step)
                last = now        # as the loop does: each rank restarts its own clock
        Path(out, f"rank{rank}.json").write_text(json.dumps(due))
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, broadcast, run_ranks):
    run_ranks(__name__, "_decide_on_two_ranks", 2, tmp_path / "store", str(tmp_path), broadcast)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_time_based_decision_is_rank_zeros_on_every_rank(tmp_path, ranks):
    r0, r1 = _two_ranks(tmp_path, broadcast=True, run_ranks=ranks)
    # rank 0's clock: 25 s a step, due once >= 60 s since the last: steps 3, 6, 9, 12
    assert r0 == r1 == [3, 6, 9, 12]


def test_rank0_value_single_process_is_the_value():
    from dflash_ray.runtime.training.checkpoint import rank0_value

    assert rank0_value(12.5, torch.device("cpu"), 1) == 12.5


# ----------------------------------------------------------------------------- handing it to Ray Train
def _model():
    from dflash_ray.runtime.training.model import lr_lambda

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.1))
    return model, opt, sched


@pytest.mark.parametrize("upload", ["sync", "async"])
def test_save_checkpoint_hands_a_whole_directory_after_the_ledger(monkeypatch, upload):
    """Rank 0: its files are written, then before_register (the ledger) runs, then report; with async the
    directory is Ray's to upload and delete after report returns (a TemporaryDirectory would be gone)."""
    import ray.train

    from dflash_ray.runtime.training.checkpoint import save_checkpoint

    events, seen = [], {}

    def fake_report(metrics, checkpoint=None, **kw):
        events.append("report")
        seen.update(kw, metrics=metrics, path=checkpoint.path,
                    files=sorted(os.listdir(checkpoint.path)))

    monkeypatch.setattr(ray.train, "report", fake_report)
    model, opt, sched = _model()

    def before(cost):
        events.append(("before_register", sorted(cost)))

    cost = save_checkpoint(rank=0, world_size=1, drafter=model, optimizer=opt, scheduler=sched,
                           cursor=Cursor(0, 4, 2), metrics={"step": 2, "loss": 1.0}, before_register=before,
                           upload=upload)
    try:
        _check_handed_over(events, seen, cost, upload)
    finally:
        import shutil

        shutil.rmtree(seen.get("path", "/nonexistent"), ignore_errors=True)   # async: Ray would delete it


class _Record:
    """The worker's record client, as the checkpoint manager sees it: what it was told, in order."""
    attempt = 1

    def __init__(self):
        self.calls = []

    def release(self, consumed):
        self.calls.append(("release", consumed))

    def flush(self, consumed, extra=None, wait=False):
        self.calls.append(("flush", consumed, sorted(extra or {}), wait))

    def checkpoint_uploaded(self, step, seconds):
        self.calls.append(("uploaded", step))

    def checkpoint_done(self, step, seconds, upload, cost):
        self.calls.append(("done", step, upload))


def test_the_manager_restores_then_saves_when_due_or_forced(monkeypatch, tmp_path):
    """Built once with the states: restore sweeps this node's orphaned local directories and starts a run at
    its start (no checkpoint handed over); save decides itself (every 3 steps here, or forced: an epoch's
    end, the feed's last step), sends the step's lines and waits before Ray Train has the checkpoint, and
    tells the record its cost; a step that is not due writes and tells nothing."""
    import subprocess
    import sys
    import tempfile
    from types import SimpleNamespace

    import ray.train

    from dflash_ray.runtime.training.checkpoint import CheckpointManager
    from dflash_ray.runtime.training.checkpoint_format import read_state

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    orphan = tmp_path / f"dflash-ckpt-{int(dead.stdout)}-a1b2c3"   # its writer exited
    orphan.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    reported = []

    def fake_report(metrics, checkpoint=None, **kw):
        reported.append((metrics["step"], read_state(Path(checkpoint.path))))

    monkeypatch.setattr(ray.train, "report", fake_report)
    model, opt, sched = _model()
    record = _Record()
    train = SimpleNamespace(checkpoint_every=3, checkpoint_every_minutes=None, checkpoint_upload="sync")
    manager = CheckpointManager(train, drafter=model, optimizer=opt, scheduler=sched, record=record, rank=0,
                                world_size=1, device=torch.device("cpu"), run_name="r")
    assert manager.restore() == (Cursor(), 0) and not orphan.exists()
    saved = [s for s in range(1, 8) if manager.save(s, Cursor(0, s, s), force=s in (5, 7), loss=1.0,
                                                    consumed=2 * s, nonfinite_streak=s % 2)]
    assert saved == [3, 5, 6, 7] and [step for step, _ in reported] == saved
    assert [(st["cursor"]["step"], st["run"], st["nonfinite_streak"]) for _, st in reported] == \
        [(3, "r", 1), (5, "r", 1), (6, "r", 0), (7, "r", 1)]
    cost = ["checkpoint_bytes", "checkpoint_upload", "checkpoint_write", "checkpoint_write_seconds"]
    flush = ("flush", 6, cost, True)
    assert record.calls[:3] == [("release", 6), flush, ("done", 3, "sync")]   # the ledger first, then the cost
    assert [c for c in record.calls if c[0] == "done"] == [("done", s, "sync") for s in saved]


def _check_handed_over(events, seen, cost, upload):
    import ray.train

    from dflash_ray.runtime.training.checkpoint_format import read_state

    assert events == [("before_register", ["checkpoint_bytes", "checkpoint_write", "checkpoint_write_seconds"]), "report"]
    assert seen["files"] == ["drafter.safetensors", "optim.pt", "rng_rank0.pt", "state.json"]
    assert seen["metrics"] == {"cursor_epoch": 0, "cursor_position": 4, "cursor_step": 2, "step": 2, "loss": 1.0}
    assert cost["checkpoint_write_seconds"] > 0
    path = Path(seen["path"])
    if upload == "sync":
        assert "checkpoint_upload_mode" not in seen and not path.exists()      # ours, removed after report
    else:
        assert seen["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.ASYNC
        assert seen["delete_local_checkpoint_after_upload"] is True
        assert path.exists()                                                  # Ray's now: it uploads it
        assert cost["checkpoint_bytes"] == sum(p.stat().st_size for p in path.iterdir())
        assert read_state(path)["cursor"] == {"epoch": 0, "position": 4, "step": 2}


def test_timed_upload_calls_rays_persist_then_reports_seconds(monkeypatch):
    import ray.train

    from dflash_ray.runtime.training.checkpoint import _timed_upload

    calls = []

    class Storage:
        storage_filesystem = None   # used only when an upload fails

        def persist_current_checkpoint(self, checkpoint, name):
            calls.append(("persist", checkpoint, name))
            return "persisted"

        def build_checkpoint_path_from_name(self, name):
            return f"/storage/{name}"

    class Ctx:
        def get_storage(self):
            return Storage()

    monkeypatch.setattr(ray.train, "get_context", lambda: Ctx())
    fn = _timed_upload(lambda seconds: calls.append(("uploaded", seconds >= 0)))
    assert fn("ckpt", "checkpoint_x") == "persisted"
    assert calls == [("persist", "ckpt", "checkpoint_x"), ("uploaded", True)]


# ----------------------------------------------------------------------------- the cost in the metrics
def test_the_record_keeps_checkpoint_cost(ray_session, tmp_path):
    from dflash_ray.runtime.record.record import RunRecord

    c = RunRecord(str(tmp_path), "ckpt")
    assert c.begin_attempt(0, 2) == {"attempt": 1, "restarted": False, "rolled_back": 0}

    def commit(step, **extra):
        c.commit_steps(c.gen, [({"epoch": 0, "step": step, "positions": [step], "buckets": [0], "tokens": [1]},
                                {"step": step, "epoch": 0, "loss": 1.0, "tokens": 1, **extra})])

    def done(attempt, step, seconds, upload, write_seconds, nbytes):   # rank 0's report of it returned
        c.checkpoint(attempt, step, {"seconds": seconds, "upload": upload, "write_seconds": write_seconds,
                                     "bytes": nbytes, "write": None})

    commit(1)
    # sync: the upload is timed inside report, before report returns
    commit(2, checkpoint_write_seconds=2.0, checkpoint_bytes=1000, checkpoint_upload="sync")
    c.checkpoint(1, 2, {"upload_seconds": 3.0})
    done(1, 2, 5.5, "sync", 2.0, 1000)
    commit(3)
    # async: report returns first, the upload ends later (after step 5's line)
    commit(4, checkpoint_write_seconds=1.0, checkpoint_bytes=3000, checkpoint_upload="async")
    done(1, 4, 1.5, "async", 1.0, 3000)
    commit(5)
    c.checkpoint(1, 4, {"upload_seconds": 7.0})
    commit(6)
    c.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert [m.get("checkpoint_bytes") for m in lines] == [None, 1000, None, 3000, None, None]
    assert [m.get("checkpoint_upload_step") for m in lines] == [None, None, 2, None, None, 4]
    assert [m.get("checkpoint_upload_seconds") for m in lines] == [None, None, 3.0, None, None, 7.0]
    report = asyncio.run(c.report())
    assert report["checkpoints"] == [
        {"step": 2, "attempt": 1, "upload_seconds": 3.0, "seconds": 5.5, "upload": "sync", "write_seconds": 2.0,
         "bytes": 1000},
        {"step": 4, "attempt": 1, "seconds": 1.5, "upload": "async", "write_seconds": 1.0, "bytes": 3000,
         "upload_seconds": 7.0}]
    assert report["checkpoint_cost"] == {
        "count": 2, "total_seconds": 7.0, "max_seconds": 5.5, "total_write_seconds": 3.0,
        "max_write_seconds": 2.0, "total_upload_seconds": 10.0, "max_upload_seconds": 7.0,
        "total_bytes": 4000, "max_bytes": 3000}
    # a step checkpointed again in a later attempt is a record of its own
    assert c.begin_attempt(0, 2)["attempt"] == 2
    done(2, 2, 1.0, "async", 0.5, 1000)
    assert [(r["attempt"], r["step"]) for r in asyncio.run(c.report())["checkpoints"]] == [(1, 2), (1, 4), (2, 2)]


def test_unregistered_checkpoint_directories_are_removed_and_registered_ones_kept(tmp_path):
    from dflash_ray.runtime.checkpoints import RunCheckpoints
    from helpers_ray_train import register_with_ray_train

    def remove_unregistered_checkpoints(experiment_dir):
        return RunCheckpoints(experiment_dir).remove_unregistered()

    exp = tmp_path / "run"
    for d in ("checkpoint_a", "checkpoint_b", "checkpoint_c", "not_a_checkpoint"):
        (exp / d).mkdir(parents=True)
        (exp / d / "state.json").write_text("{}")
    (exp / "checkpoint_file").write_text("a file, not a checkpoint directory")
    assert remove_unregistered_checkpoints(str(exp)) == ["checkpoint_a", "checkpoint_b", "checkpoint_c"]
    for d in ("checkpoint_a", "checkpoint_b", "checkpoint_c"):     # nothing registered yet: all three went
        (exp / d).mkdir()
    register_with_ray_train(exp, "checkpoint_a", {"step": 1})
    register_with_ray_train(exp, "checkpoint_c", {"step": 3})   # b's upload finished, its registration never came
    assert remove_unregistered_checkpoints(str(exp)) == ["checkpoint_b"]
    assert {p.name for p in exp.iterdir() if p.is_dir()} == {"checkpoint_a", "checkpoint_c", "not_a_checkpoint"}
    assert (exp / "checkpoint_file").is_file()
    assert remove_unregistered_checkpoints(str(tmp_path / "absent")) == []


def test_async_checkpoint_writes_a_snapshot_of_the_step_in_the_upload_thread(monkeypatch, tmp_path):
    """upload=async with host buffers (what every worker does): the step pays a host copy of rank 0's state
    and nothing is written before `report`; the files are written in the upload function (Ray Train's
    background thread) from the snapshot, so a later step that changes the weights, the optimizer state and
    the RNG in place does not reach the checkpoint of this one."""
    import pickle

    import ray.train
    from safetensors.torch import load_file

    from dflash_ray.runtime.training.checkpoint import save_checkpoint

    from dflash_ray.runtime.training.checkpoint_format import HostBuffers, read_state

    model, opt, sched = _model()

    def train_step():
        opt.zero_grad()
        model(torch.ones(2, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()

    train_step()
    want_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want_avg = {i: s["exp_avg"].clone() for i, s in opt.state_dict()["state"].items()}
    persisted, seen, uploaded = [], {}, []

    class Storage:
        storage_filesystem = None

        def persist_current_checkpoint(self, checkpoint, name):
            persisted.append(sorted(os.listdir(checkpoint.path)))
            return "persisted"

        def build_checkpoint_path_from_name(self, name):
            return f"/storage/{name}"

    monkeypatch.setattr(ray.train, "get_context", lambda: type("Ctx", (), {"get_storage": lambda self: Storage()})())
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None, **kw: seen.update(
        kw, path=checkpoint.path, checkpoint=checkpoint, files=sorted(os.listdir(checkpoint.path))))
    host = HostBuffers()
    torch.manual_seed(7)
    rng_at_step = torch.get_rng_state()
    cost = save_checkpoint(rank=0, world_size=1, drafter=model, optimizer=opt, scheduler=sched,
                           cursor=Cursor(0, 4, 2), metrics={"step": 2}, upload="async", host=host,
                           on_uploaded=uploaded.append)
    try:
        assert seen["files"] == [] and not host.idle.is_set()     # nothing written on the step's path
        # by hand: Linear(4, 3) holds 12 + 3 fp32 values (60 bytes); AdamW two moments of each (120) and a
        # fp32 step counter per parameter tensor (2 x 4)
        assert cost == {"checkpoint_write_seconds": cost["checkpoint_write_seconds"], "checkpoint_bytes": 60 + 120 + 8,
                        "checkpoint_write": "background"}
        train_step()                                                # the next steps change everything in place
        torch.rand(100)
        assert not torch.equal(model.weight, want_weights["weight"])
        assert seen["checkpoint_upload_fn"](seen["checkpoint"], "checkpoint_x") == "persisted"
        assert host.idle.is_set() and len(uploaded) == 1 and uploaded[0] > 0
        assert persisted == [["drafter.safetensors", "optim.pt", "rng_rank0.pt", "state.json"]]
        path = Path(seen["path"])
        assert read_state(path)["cursor"] == {"epoch": 0, "position": 4, "step": 2}
        got = load_file(str(path / "drafter.safetensors"))
        assert all(torch.equal(got[k], want_weights[k]) for k in want_weights)
        saved = torch.load(path / "optim.pt", weights_only=False)["optimizer"]["state"]
        assert all(torch.equal(saved[i]["exp_avg"], want_avg[i]) for i in want_avg)
        assert not torch.equal(saved[0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
        with open(path / "rng_rank0.pt", "rb") as f:
            assert torch.equal(pickle.load(f)["torch"], rng_at_step)
    finally:
        import shutil

        shutil.rmtree(seen.get("path", "/nonexistent"), ignore_errors=True)
