"""Checkpoints: what a restart needs, in one directory per committed step, complete or absent.

Every rank writes its part into a fresh local directory and hands it to `ray.train.report`, which uploads
every rank's files into the same checkpoint directory and registers the checkpoint only when all ranks
have reported (an interrupted upload is never registered, so never resumed from):

    state.json             rank 0: cursor (epoch, position, step), world size, the file manifest
    drafter.safetensors    rank 0: drafter weights (trainable parameters only)
    optim.pt               rank 0: optimizer + LR scheduler state
    rng_rank{r}.pt         every rank: python, numpy and torch RNG states

`load_checkpoint` checks the manifest (names and sizes) before anything is restored.

When: `checkpoint_due` (every `train.checkpoint_every` steps and/or every `train.checkpoint_every_minutes`
of rank 0's clock, at each epoch's end, after the last step). How: the files are written synchronously
(training waits for them), then handed to Ray Train; with `train.checkpoint_upload: async` (Ray Train v2's
`CheckpointUploadMode.ASYNC`) their upload to the run's storage happens in a background thread of each
worker while training goes on. Either way a checkpoint is registered (becomes the one a restart resumes
from) only after every rank's upload has finished, and in report order: what a restart sees is whole.

The feed of a restarted worker group must start where the checkpoint it will resume from ends. Ray
Train hands that checkpoint to the workers; the dataset factory, which runs in Ray Train's controller
before the workers start, reads the same fact from the controller's persisted record of registered
checkpoints (`latest_checkpoint`): the metrics reported with the checkpoint carry the cursor. The
workers check that the two agree and fail loudly if they do not.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_ray.atomic import write_json_atomic
from dflash_ray.runtime.stream.feed import Cursor

STATE = "state.json"
WEIGHTS = "drafter.safetensors"
OPTIM = "optim.pt"
SNAPSHOT = "checkpoint_manager_snapshot.json"   # Ray Train 2.60's record of registered checkpoints


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def write_rank_files(out_dir: Path, rank: int, rng: dict | None = None) -> None:
    try:
        with open(out_dir / f"rng_rank{rank}.pt", "wb") as f:
            pickle.dump(rng if rng is not None else rng_state(), f)
    except Exception as e:
        raise local_write_error(out_dir, e) from e


def local_write_error(out_dir: Path, e: Exception) -> OSError:
    """An OSError naming the local checkpoint directory a write failed in, and the space left there: the
    writers' own errors do not say where, nor that the disk is full (torch.save: `RuntimeError: [enforce
    fail at inline_container.cc:672] . unexpected pos ...`). trainer.failure_error names the directory."""
    import errno
    import shutil

    try:
        free = shutil.disk_usage(out_dir).free
    except OSError:
        free = None
    code = getattr(e, "errno", None) or (errno.ENOSPC if free is not None and free < (1 << 20) else errno.EIO)
    space = f"{free / 2**20:.2f} MiB free there" if free is not None else "its free space unknown"
    first = (str(e).strip().splitlines() or [""])[0]
    return OSError(code, f"{out_dir}: {os.strerror(code)} ({space}); {type(e).__name__}: {first}")


@dataclass
class StateSnapshot:
    """Rank 0's training state as a checkpoint writes it: host tensors that training no longer touches
    (copies in HostBuffers) or may still touch (the live tensors' host views: write them at once)."""
    weights: dict      # drafter state_dict name -> host tensor
    optim: dict        # {"optimizer": ..., "scheduler": ...}, tensors on the host
    rng: dict          # rank 0's RNG states at the step (rng_state())
    nbytes: int        # the tensors' bytes


class HostBuffers:
    """Reused host copies of rank 0's state for a write off the step's path (`train.checkpoint_upload:
    async`): pinned on CUDA, where a device-to-host copy into pinned memory runs at ~55 GB/s against ~8 GB/s
    pageable (the H200's figures), so the step waits for a copy, not for a 12.6 GB file write. One set of
    buffers: a snapshot waits for the previous one's background write to end before it overwrites them."""

    def __init__(self):
        self.tensors: dict = {}
        self.idle = threading.Event()
        self.idle.set()

    def copy(self, key, t: torch.Tensor) -> torch.Tensor:
        buf = self.tensors.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self.tensors[key] = buf
        buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        return buf


def _map_tensors(obj, fn, path=()):
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn, path + (i,)) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _tensor_bytes(*objs) -> int:
    """Bytes of every tensor in nested dicts/lists/tuples (a snapshot's size; nothing copied)."""
    total = 0
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            total += _tensor_bytes(*obj.values())
        elif isinstance(obj, (list, tuple)):
            total += _tensor_bytes(*obj)
    return total


def capture_state(drafter, optimizer, scheduler, host: HostBuffers | None = None) -> StateSnapshot:
    """Rank 0's state now. With `host`: copies in its buffers (after the previous background write is
    done with them), which later steps cannot change; without: the live tensors' host views (a CPU
    tensor is itself), to be written before the next step."""
    module = getattr(drafter, "module", drafter)
    if host is not None:
        host.idle.wait()
        take = host.copy
    else:
        def take(_key, t):
            return t.detach().cpu()
    weights = {k: take(("w", k), v).contiguous() for k, v in module.state_dict().items()}
    optim = _map_tensors({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                         lambda path, t: take(("o",) + path, t))
    if host is not None and torch.cuda.is_available():
        torch.cuda.synchronize()   # the non-blocking copies into pinned memory have landed
    return StateSnapshot(weights=weights, optim=optim, rng=rng_state(), nbytes=_tensor_bytes(weights, optim))


def gather_state(drafter, optimizer, scheduler, rank: int) -> StateSnapshot | None:
    """An FSDP-sharded drafter's state, gathered whole (every rank calls it: collectives) onto rank 0's host,
    in the files' usual form (the optimizer keyed by parameter name: `optimizer_by_name` in optim.pt).
    None on the other ranks. sharding.py says why gathered."""
    from dflash_ray.runtime.training.sharding import gather_full_state

    weights, optim = gather_full_state(drafter, optimizer)
    if rank != 0:
        return None
    if not any(p.is_cuda for p in drafter.parameters()):
        # on the CPU the gathered dict still holds some live tensors (AdamW's step counters, never sharded):
        # the background write must not see the next steps' values
        optim = copy.deepcopy(optim)
    weights = {k: v.contiguous() for k, v in weights.items()}
    return StateSnapshot(weights=weights, optim={"optimizer_by_name": optim,
                                                 "scheduler": copy.deepcopy(scheduler.state_dict())},
                         rng=rng_state(), nbytes=_tensor_bytes(weights, optim))


def write_checkpoint(out_dir: Path, *, drafter=None, optimizer=None, scheduler=None, cursor: Cursor,
                     world_size: int, extra: dict | None = None, fault_pause=None,
                     snapshot: StateSnapshot | None = None) -> None:
    """Rank 0's files (the other ranks call write_rank_files only), from `snapshot` or from the live
    drafter/optimizer/scheduler. state.json, with the manifest, is written last. `fault_pause()`:
    test-only, called once the weights are written (a half-written checkpoint to kill a process in)."""
    from safetensors.torch import save_file

    if snapshot is None:
        snapshot = capture_state(drafter, optimizer, scheduler)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(snapshot.weights, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    except Exception as e:
        raise local_write_error(out_dir, e) from e
    if fault_pause is not None:
        fault_pause()
    try:
        torch.save(snapshot.optim, out_dir / OPTIM)
    except Exception as e:
        raise local_write_error(out_dir, e) from e
    write_rank_files(out_dir, 0, snapshot.rng)
    files = {name: (out_dir / name).stat().st_size for name in (WEIGHTS, OPTIM)}
    meta = {"cursor": cursor.as_dict(), "world_size": int(world_size), "files": files,
            "rank_files": [f"rng_rank{r}.pt" for r in range(world_size)], **(extra or {})}
    try:
        write_json_atomic(out_dir / STATE, meta)
    except Exception as e:
        raise local_write_error(out_dir, e) from e


class IncompleteCheckpoint(RuntimeError):
    pass


def read_state(ckpt_dir: Path) -> dict:
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / STATE).exists():
        raise IncompleteCheckpoint(f"{ckpt_dir}: no {STATE}")
    meta = json.loads((ckpt_dir / STATE).read_text())
    for name, size in meta["files"].items():
        p = ckpt_dir / name
        if not p.exists() or p.stat().st_size != size:
            raise IncompleteCheckpoint(f"{ckpt_dir}: {name} missing or truncated")
    for name in meta["rank_files"]:
        if not (ckpt_dir / name).exists():
            raise IncompleteCheckpoint(f"{ckpt_dir}: {name} missing")
    return meta


def load_weights(ckpt_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt_dir) / WEIGHTS))


def load_checkpoint(ckpt_dir: Path, *, drafter, optimizer, scheduler, rank: int) -> Cursor:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the cursor. Either parallelism
    reads either's checkpoint (the optimizer state by index under DDP, by parameter name under FSDP: each
    converted to the other's form), on any world size."""
    from dflash_ray.runtime.training.sharding import (is_sharded, load_full_state, optimizer_by_index,
                                                      optimizer_by_name, trainable_names)

    meta = read_state(ckpt_dir)
    module = getattr(drafter, "module", drafter)
    opt = torch.load(Path(ckpt_dir) / OPTIM, map_location="cpu", weights_only=False)
    names = trainable_names(module)
    if is_sharded(module):   # every rank reads the whole state and keeps its shard
        by_name = opt.get("optimizer_by_name") or optimizer_by_name(opt["optimizer"], names)
        load_full_state(module, optimizer, load_weights(ckpt_dir), by_name)
    else:
        module.load_state_dict(load_weights(ckpt_dir), strict=True)
        optimizer.load_state_dict(opt["optimizer"] if "optimizer" in opt
                                  else optimizer_by_index(opt["optimizer_by_name"], names))
    scheduler.load_state_dict(opt["scheduler"])
    rng = Path(ckpt_dir) / f"rng_rank{rank}.pt"
    if rng.exists():  # a rank that did not exist before (more workers now) keeps its fresh seed
        with open(rng, "rb") as f:
            set_rng_state(pickle.load(f))
    return Cursor.from_dict(meta["cursor"])


def _filesystem(uri_or_path: str):
    """(pyarrow filesystem, path inside it) for a local path or a URI (s3://, gs://, file://, ...)."""
    import pyarrow.fs as pafs

    if "://" in str(uri_or_path):
        return pafs.FileSystem.from_uri(str(uri_or_path))
    return pafs.LocalFileSystem(), str(Path(uri_or_path).resolve())


def read_snapshot(experiment_dir: str) -> dict | None:
    """Ray Train's record of the run's registered checkpoints (None before the first one), read through
    pyarrow's filesystem layer so local paths, NFS and s3:// storage go the same way."""
    fs, path = _filesystem(f"{str(experiment_dir).rstrip('/')}/{SNAPSHOT}")
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return None


def remove_unregistered_checkpoints(experiment_dir: str) -> list[str]:
    """Remove the checkpoint directories in storage that Ray Train never registered (a driver killed
    between the ranks' uploads and the registration, a failed upload's remains): nothing will ever read
    them (a resume uses the registered latest only) and each is a whole checkpoint's bytes. Called by the
    driver before its first fit, when no upload of this run can be in flight; keeps every directory the
    snapshot names (registered, latest, or reported and pending). Returns the names removed."""
    import pyarrow.fs as pafs

    snap = read_snapshot(experiment_dir) or {}
    keep = {r.get("checkpoint_dir_name") for r in snap.get("checkpoint_results") or []}
    keep |= {r.get("checkpoint_dir_name") for r in snap.get("pending_training_results") or []
             if isinstance(r, dict)}
    keep.add((snap.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name"))
    fs, path = _filesystem(experiment_dir)
    removed = []
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_") \
                and info.base_name not in keep:
            fs.delete_dir(info.path)
            removed.append(info.base_name)
    return sorted(removed)


def latest_checkpoint(experiment_dir: str) -> tuple[Cursor, str | None]:
    """The cursor and the location (a local path or a URI) of the latest checkpoint Ray Train has
    registered for this run; (Cursor(), None) before the first one. Our cursor travels in the metrics
    reported with the checkpoint."""
    latest = (read_snapshot(experiment_dir) or {}).get("latest_checkpoint_result")
    if not latest:
        return Cursor(), None
    m = latest.get("metrics", {})
    if "cursor_epoch" not in m:
        raise RuntimeError(f"{experiment_dir}/{SNAPSHOT}: the latest checkpoint has no cursor in its metrics "
                           "(written by another program?)")
    cursor = Cursor(int(m["cursor_epoch"]), int(m["cursor_position"]), int(m["cursor_step"]))
    return cursor, f"{str(experiment_dir).rstrip('/')}/{latest['checkpoint_dir_name']}"


@contextlib.contextmanager
def local_checkpoint(checkpoint: str):
    """A local directory holding the checkpoint: the directory itself, or a temporary copy of a remote
    (URI) one, removed afterwards."""
    if "://" not in str(checkpoint):
        yield Path(checkpoint)
        return
    import pyarrow.fs as pafs

    fs, path = _filesystem(checkpoint)
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield Path(tmp)


def cursor_metrics(cursor: Cursor) -> dict:
    return {"cursor_epoch": cursor.epoch, "cursor_position": cursor.position, "cursor_step": cursor.step}


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


def _timed_upload(on_uploaded=None, fault_pause=None):
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
        if fault_pause is not None:  # test-only: the files are in storage, the checkpoint is not registered
            fault_pause()
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
    mid-upload: a Qwen3-8B drafter's state is ~12.6 GB, left in the temp dir at every such kill). Called
    by every worker as it starts. Returns the directories removed."""
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
                    snapshot: StateSnapshot | None = None, extra: dict | None = None, fault_pause=None,
                    fault_pause_where: str = "write") -> dict:
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

    `fault_pause()` (test-only, tests/reliability/): rank 0 calls it halfway through writing its files
    (fault_pause_where="write") or after uploading them, before the checkpoint is registered ("upload").

    Returns rank 0's cost; {} on other ranks."""
    import ray.train
    from ray.train import Checkpoint

    cost: dict = {}
    report_metrics = {**cursor_metrics(cursor), **metrics}
    write_pause = fault_pause if fault_pause_where == "write" else None
    written = {"seconds": 0.0}   # a background write's seconds, counted in the upload's

    def uploaded(seconds: float) -> None:
        if on_uploaded is not None:
            on_uploaded(written["seconds"] + seconds)

    # every rank's upload: a failed one names the storage and leaves no partial directory behind
    upload_fn = _timed_upload(uploaded if rank == 0 else None,
                              fault_pause if (rank == 0 and fault_pause_where == "upload") else None)

    def write_now(tmp: Path) -> None:
        if rank == 0:
            t0 = time.perf_counter()
            write_checkpoint(tmp, drafter=drafter, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                             world_size=world_size, extra=extra, fault_pause=write_pause, snapshot=snapshot)
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
                                           world_size=world_size, extra=extra, fault_pause=write_pause)
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
    """A worker's checkpoints: restore at its start, decide when (the same answer on every rank, from
    rank 0's clock), save (write, hand to Ray Train, upload sync or async) and tell the run record what
    each cost. The driver's side (the latest registered checkpoint, the sweep of unregistered ones, the
    export) is the functions of this module."""

    def __init__(self, train, *, rank: int, world_size: int, device, record, faults: dict | None = None):
        self.train, self.rank, self.world, self.device = train, rank, world_size, device
        self.record, self.faults = record, faults or {}
        self.t_last = time.perf_counter()
        self.host = HostBuffers()   # rank 0's snapshot buffers for async checkpoints, reused

    def restore(self, drafter, optimizer, scheduler) -> tuple[Cursor, int]:
        """The cursor and the non-finite streak of the checkpoint Ray Train hands this worker group (the
        weights, optimizer, scheduler and this rank's RNG restored); (Cursor(), 0) at a run's start."""
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return Cursor(), 0
        with ckpt.as_directory() as d:
            cursor = load_checkpoint(Path(d), drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                                     rank=self.rank)
            streak = int(read_state(Path(d)).get("nonfinite_streak", 0))
        self.t_last = time.perf_counter()   # the time-based interval counts from here, not from the restore
        return cursor, streak

    def due(self, step: int, *, last_step: bool, end_of_epoch: bool) -> bool:
        since = time.perf_counter() - self.t_last
        if self.train.checkpoint_every_minutes:   # every rank decides from rank 0's clock (a broadcast)
            since = rank0_value(since, self.device, self.world)
        return checkpoint_due(step, self.train.checkpoint_every, self.train.checkpoint_every_minutes, since,
                              last_step=last_step, end_of_epoch=end_of_epoch)

    def save(self, step: int, cursor: Cursor, *, drafter, optimizer, scheduler, loss: float, consumed: int,
             extra: dict) -> None:
        """Every rank, at the same step. The step's ledger lines are on disk before the checkpoint can be
        registered; the step's metrics line says what the write cost; the upload's seconds go on a later one."""
        from dflash_ray.runtime.training.faults import checkpoint_pause

        from dflash_ray.runtime.training.sharding import is_sharded

        record, upload = self.record, self.train.checkpoint_upload
        record.release(consumed)
        t0 = time.perf_counter()
        pause, where = checkpoint_pause(self.faults, step, self.rank, record)
        # FSDP: every rank takes part in gathering rank 0's copy of the whole state
        snapshot = gather_state(drafter, optimizer, scheduler, self.rank) if is_sharded(drafter) else None
        cost = save_checkpoint(
            rank=self.rank, world_size=self.world, drafter=drafter, optimizer=optimizer, scheduler=scheduler,
            cursor=cursor, metrics={"step": step, "loss": loss}, upload=upload, host=self.host, extra=extra,
            snapshot=snapshot,
            before_register=lambda cost: record.flush(consumed, {**cost, "checkpoint_upload": upload}, wait=True),
            on_uploaded=lambda seconds: record.checkpoint_uploaded(step, seconds),
            fault_pause=pause, fault_pause_where=where)
        self.t_last = time.perf_counter()
        # what training waited: the write, the ledger, the barrier, and the upload unless it is async
        record.checkpoint_done(step, self.t_last - t0, upload, cost)


def export_latest(run_spec, dtype: str = "target", card: dict | None = None) -> tuple[str, str] | None:
    """Write the drafter of the run's latest checkpoint (local or remote storage) to <run.dir>/export, as
    a Hugging Face directory the reference `dflash` package loads, in the target's dtype unless `dtype`
    names one (serving engines load the drafter beside the target, in its dtype; bf16 is also half the
    file). Returns (checkpoint, export dir), or None when the run has no checkpoint."""
    from dflash_ray.model.export import export_drafter
    from dflash_ray.model.target import target_dtype
    from dflash_ray.runtime.record.layout import RunLayout
    from dflash_ray.runtime.training.model import build_run_drafter

    _, checkpoint = latest_checkpoint(run_spec.experiment_dir)
    if checkpoint is None:
        return None
    with local_checkpoint(checkpoint) as d:
        read_state(d)
        drafter = build_run_drafter(run_spec, torch.device("cpu"))
        drafter.load_state_dict(load_weights(d), strict=True)
    out_dtype = target_dtype(run_spec.target_path) if dtype == "target" else getattr(torch, dtype)
    return checkpoint, export_drafter(drafter, str(RunLayout(run_spec.run_dir).export), dtype=out_dtype, card=card)
