"""A worker's checkpoints (`CheckpointManager`): when they are written, and how they reach the run's storage
(the files themselves: checkpoint_format.py; the driver's side, what Ray Train registered and the export of
the latest: runtime/checkpoints.py `RunCheckpoints`).

Every rank writes its part into a fresh local directory and hands it to `ray.train.report`, which uploads
every rank's files into the same checkpoint directory and registers the checkpoint only when all ranks
have reported (an interrupted upload is never registered, so never resumed from).

When: `checkpoint_due` (every `train.checkpoint_every` steps and/or every `train.checkpoint_every_minutes`
of rank 0's clock, at each epoch's end, after the last step). How: with `train.checkpoint_upload: async`
(Ray Train v2's `CheckpointUploadMode.ASYNC`) rank 0 takes a host snapshot of its state (training waits only
for that copy), and each rank's background thread writes the files from it and uploads them to the run's
storage while training goes on; with `sync` the files are written and uploaded before training goes on. Either way a checkpoint is registered (becomes the one a restart resumes
from) only after every rank's upload has finished, and in report order: what a restart sees is whole.

The feed of a restarted worker group must start where the checkpoint it will resume from ends. Ray
Train hands that checkpoint to the workers; the dataset factory, which runs in Ray Train's controller
before the workers start, reads the same fact from the controller's persisted record of registered
checkpoints (runtime/checkpoints.py `RunCheckpoints.latest`): the metrics reported with the checkpoint carry
the cursor. The workers check that the two agree and fail loudly if they do not.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dflash_ray.runtime.stream.feed import Cursor
from dflash_ray.runtime.training.checkpoint_format import (HostBuffers, StateSnapshot, capture_state, cursor_metrics,
                                                          gather_state, load_checkpoint, read_state, write_checkpoint,
                                                          write_rank_files)
from dflash_ray.runtime.training.faults import pause_point

def checkpoint_due(step: int, every_steps: int | None, every_minutes: float | None = None,
                   since_last_s: float = 0.0, *, last_step: bool, end_of_epoch: bool) -> bool:
    """Checkpoint every `every_steps` steps, once `every_minutes` have passed since the last checkpoint
    (`since_last_s`: rank 0's clock, the same value on every rank), at the end of every epoch (so a
    finished epoch is never retrained) and after the last step of the run. An interval of 0 or None is off.
    Every rank must get the same answer: `ray.train.report` is a barrier."""
    by_steps = bool(every_steps) and step % int(every_steps) == 0
    by_time = bool(every_minutes) and since_last_s >= float(every_minutes) * 60.0
    return by_steps or by_time or last_step or end_of_epoch


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _timed_upload(on_uploaded=None):
    """A `checkpoint_upload_fn` doing what Ray Train does by default (`StorageContext.
    persist_current_checkpoint`, ray/train/v2/_internal/execution/context.py `_upload_checkpoint`), timed:
    `on_uploaded(seconds)` runs after the copy, before Ray Train hands the report on (so before the
    checkpoint can be registered). None (Ray's own upload, untimed) where the storage context is not
    reachable (`get_storage` is a DeveloperAPI).

    An upload that fails (a full disk, a storage refusing writes) removes what it left of the checkpoint's
    directory (never registered: this rank never reports it; a partial copy would only keep the disk full
    for the retry, and stay as garbage), and raises an OSError naming the destination (pyarrow's "Error
    writing bytes to file ... No space left on device" does not), which trainer.failure_error names as
    train.storage_path."""
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()
        persist = storage.persist_current_checkpoint
        fs, where = storage.storage_filesystem, storage.build_checkpoint_path_from_name
    except Exception:  # pragma: no cover - another Ray version
        return None

    def upload(checkpoint, checkpoint_dir_name):
        t0 = time.perf_counter()
        try:
            persisted = persist(checkpoint, checkpoint_dir_name)
        except OSError as e:
            dest = where(checkpoint_dir_name)
            with contextlib.suppress(Exception):
                fs.delete_dir(dest)
            if dest in str(e):
                raise
            said = (str(e.strerror or e).strip().splitlines() or [""])[0]
            raise OSError(e.errno, f"{dest}: {said}") from e
        pause_point("upload")   # a test's pause: the files are in storage, the checkpoint is not registered
        if on_uploaded is not None:
            on_uploaded(time.perf_counter() - t0)
        return persisted

    return upload


def _local_prefix() -> str:
    # the writer's pid in the name: a worker killed while writing (or before Ray's async upload deleted
    # it) leaves its directory behind, and `remove_orphaned_local_checkpoints` knows it is nobody's
    return f"dflash-ckpt-{os.getpid()}-"


def remove_orphaned_local_checkpoints(tmp_dir: str | None = None) -> list[str]:
    """Delete this node's local checkpoint directories whose writer process is gone (killed mid-write or
    mid-upload: a Qwen3-8B drafter's state is ~12.6 GB, left in the temp dir at every such kill). Every
    worker's `CheckpointManager.restore` calls it as the worker starts. Returns the directories removed."""
    import re

    removed = []
    root = Path(tmp_dir or tempfile.gettempdir())
    for d in root.glob("dflash-ckpt-*-*"):
        m = re.fullmatch(r"dflash-ckpt-(\d+)-.+", d.name)
        if not m or not d.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue                      # alive (another run on this node is writing it)
        except PermissionError:
            continue                      # alive, another user's
        except ProcessLookupError:
            pass
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


def save_checkpoint(*, rank: int, world_size: int, drafter, optimizer, scheduler, cursor: Cursor, metrics: dict,
                    before_register=None, on_uploaded=None, upload: str = "sync", host: HostBuffers | None = None,
                    snapshot: StateSnapshot | None = None, extra: dict | None = None) -> dict:
    """Every rank calls this at the same step (`ray.train.report` is a barrier). Rank 0 writes the state,
    the others their RNG; `before_register(cost)` runs on rank 0 before the checkpoint is handed to Ray
    Train (e.g. wait for the step's ledger lines), with cost = {"checkpoint_write_seconds",
    "checkpoint_bytes", "checkpoint_write"}: what the step waited for rank 0's state ("step": the files
    written; "background": a host snapshot, the files written later) and its bytes. `on_uploaded(seconds)`
    runs on rank 0 when its files are in the run's storage (inside `ray.train.report` with upload="sync", in
    Ray Train's upload thread with "async", where the seconds include the background write), before the
    checkpoint can be registered.

    upload="async" (Ray Train 2.60, `CheckpointUploadMode.ASYNC`): rank 0 copies its state into `host`'s
    buffers (the step's only cost: a Qwen3-8B drafter's 12.6 GB is a device-to-host copy, not a file
    write); `report` returns once every rank has passed its barrier (the checkpoint directory name is
    agreed there); each rank's upload then runs in a single background thread (uploads stay in report
    order), which on rank 0 first writes the files from the snapshot; Ray deletes the local directory after
    it, and the rank's report reaches the controller only after its upload, so the checkpoint is registered
    only when every rank's files are in storage; a failed write or upload fails the worker (a restart
    resumes from the previous checkpoint); the last upload is waited for when the train function returns.
    The ledger lines written by `before_register` are on disk before `report` is even called, so before
    registration.

    `snapshot`: rank 0's state already taken (FSDP: `gather_state`, a collective every rank ran before); it
    is written instead of the live state, in the background with async.

    Returns rank 0's cost; {} on other ranks."""
    import ray.train
    from ray.train import Checkpoint

    cost: dict = {}
    report_metrics = {**cursor_metrics(cursor), **metrics}
    written = {"seconds": 0.0}   # a background write's seconds, counted in the upload's

    def uploaded(seconds: float) -> None:
        if on_uploaded is not None:
            on_uploaded(written["seconds"] + seconds)

    # every rank's upload: a failed one names the storage and leaves no partial directory behind
    upload_fn = _timed_upload(uploaded if rank == 0 else None)

    def write_now(tmp: Path) -> None:
        if rank == 0:
            t0 = time.perf_counter()
            write_checkpoint(tmp, drafter=drafter, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                             world_size=world_size, extra=extra, snapshot=snapshot)
            cost.update(checkpoint_write_seconds=time.perf_counter() - t0, checkpoint_bytes=dir_bytes(tmp),
                        checkpoint_write="step")
            if before_register is not None:
                before_register(dict(cost))
        else:
            write_rank_files(tmp, rank)

    if upload == "sync":
        with tempfile.TemporaryDirectory(prefix=_local_prefix()) as tmp:
            write_now(Path(tmp))
            ray.train.report(report_metrics, checkpoint=Checkpoint.from_directory(tmp),
                             checkpoint_upload_fn=upload_fn)
        return cost
    if upload != "async":
        raise ValueError(f"checkpoint upload mode {upload!r}: expected 'sync' or 'async'")
    from ray.train import CheckpointUploadMode

    background = rank == 0 and (host is not None or snapshot is not None) and upload_fn is not None
    if background:
        t0 = time.perf_counter()
        if snapshot is None:
            snapshot = capture_state(drafter, optimizer, scheduler, host)
        else:
            host = None   # a gathered snapshot is its own copy
        cost.update(checkpoint_write_seconds=time.perf_counter() - t0, checkpoint_bytes=snapshot.nbytes,
                    checkpoint_write="background")
        if before_register is not None:
            before_register(dict(cost))
        upload_fn = _written_then_uploaded(snapshot, host, upload_fn, written, cursor=cursor,
                                           world_size=world_size, extra=extra)
    # not a TemporaryDirectory: Ray Train reads it after `report` returns and deletes it after the upload
    tmp = tempfile.mkdtemp(prefix=_local_prefix())
    try:
        if background and host is not None:
            host.idle.clear()   # the snapshot is the background write's until it is done with it
        else:
            write_now(Path(tmp))
        ray.train.report(report_metrics, checkpoint=Checkpoint.from_directory(tmp),
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True, checkpoint_upload_fn=upload_fn)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)   # no upload was started from it
        if background and host is not None:
            host.idle.set()
        raise
    return cost


def _written_then_uploaded(snapshot: StateSnapshot, host: HostBuffers | None, upload_fn, written: dict,
                           **write_kwargs):
    """Rank 0's `checkpoint_upload_fn` for a background write: the files from the snapshot into the local
    directory Ray Train hands over (its seconds into `written`), then the timed upload; the host buffers are
    free again after the write (or its failure, which fails the worker as a failed upload does)."""
    def upload(checkpoint, checkpoint_dir_name):
        t0 = time.perf_counter()
        try:
            write_checkpoint(Path(checkpoint.path), snapshot=snapshot, **write_kwargs)
        finally:
            if host is not None:
                host.idle.set()
        written["seconds"] = time.perf_counter() - t0
        return upload_fn(checkpoint, checkpoint_dir_name)

    return upload


def rank0_value(value: float, device, world_size: int) -> float:
    """Rank 0's `value` on every rank (one float broadcast; on the model's device, as NCCL needs): a
    decision taken from it is the same on every rank."""
    if world_size <= 1:
        return float(value)
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


class CheckpointManager:
    """A worker's checkpoints, built once with the states they hold (the drafter, its optimizer and LR
    scheduler) and the worker's record client: `restore` at the worker's start (this node's orphaned local
    directories removed first), then `save` after every step, which decides itself whether the step is due
    (the same answer on every rank, from rank 0's clock), writes, hands the checkpoint to Ray Train (upload
    sync or async) and tells the run record what it cost."""

    def __init__(self, train, *, drafter, optimizer, scheduler, record, rank: int, world_size: int, device,
                 run_name: str, faults: dict | None = None):
        self.train, self.rank, self.world, self.device = train, rank, world_size, device
        self.drafter, self.optimizer, self.scheduler = drafter, optimizer, scheduler
        self.record, self.run_name, self.faults = record, run_name, faults or {}
        self.t_last = time.perf_counter()
        self.host = HostBuffers()   # rank 0's snapshot buffers for async checkpoints, reused

    def restore(self) -> tuple[Cursor, int]:
        """The cursor and the non-finite streak of the checkpoint Ray Train hands this worker group (the
        weights, optimizer, scheduler and this rank's RNG restored); (Cursor(), 0) at a run's start. Before
        that, this node's local checkpoint directories left by a worker killed while checkpointing go."""
        import ray.train

        remove_orphaned_local_checkpoints()
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return Cursor(), 0
        with ckpt.as_directory() as d:
            cursor = load_checkpoint(Path(d), drafter=self.drafter, optimizer=self.optimizer,
                                     scheduler=self.scheduler, rank=self.rank)
            streak = int(read_state(Path(d)).get("nonfinite_streak", 0))
        self.t_last = time.perf_counter()   # the time-based interval counts from here, not from the restore
        return cursor, streak

    def _due(self, step: int, force: bool) -> bool:
        since = time.perf_counter() - self.t_last
        if self.train.checkpoint_every_minutes:   # every rank decides from rank 0's clock (a broadcast)
            since = rank0_value(since, self.device, self.world)
        return force or checkpoint_due(step, self.train.checkpoint_every, self.train.checkpoint_every_minutes,
                                       since, last_step=False, end_of_epoch=False)

    def save(self, step: int, cursor: Cursor, *, force: bool = False, loss: float, consumed: int,
             nonfinite_streak: int) -> bool:
        """Every rank, after every step: checkpoint `step` when it is due (`train.checkpoint_every` steps,
        `train.checkpoint_every_minutes`) or `force`d (an epoch's end, the feed's last step). Returns whether
        it did. The step's ledger lines are on disk before the checkpoint can be registered (they are sent
        and waited for here); the step's metrics line says what the write cost; the upload's seconds go on a
        later one."""
        from dflash_ray.runtime.training.faults import arm_checkpoint_pause
        from dflash_ray.runtime.training.sharding import is_sharded

        if not self._due(step, force):
            return False
        record, upload = self.record, self.train.checkpoint_upload
        drafter, optimizer, scheduler = self.drafter, self.optimizer, self.scheduler
        record.release(consumed)
        t0 = time.perf_counter()
        arm_checkpoint_pause(self.faults, step, self.rank, record)   # tests only: a no-op without faults
        # FSDP: every rank takes part in gathering rank 0's copy of the whole state
        snapshot = gather_state(drafter, optimizer, scheduler, self.rank) if is_sharded(drafter) else None
        cost = save_checkpoint(
            rank=self.rank, world_size=self.world, drafter=drafter, optimizer=optimizer, scheduler=scheduler,
            cursor=cursor, metrics={"step": step, "loss": loss}, upload=upload, host=self.host,
            extra={"run": self.run_name, "nonfinite_streak": nonfinite_streak}, snapshot=snapshot,
            before_register=lambda cost: record.flush(consumed, {**cost, "checkpoint_upload": upload}, wait=True),
            on_uploaded=lambda seconds: record.checkpoint_uploaded(step, seconds))
        self.t_last = time.perf_counter()
        # what training waited: the write, the ledger, the barrier, and the upload unless it is async
        record.checkpoint_done(step, self.t_last - t0, upload, cost)
        return True
