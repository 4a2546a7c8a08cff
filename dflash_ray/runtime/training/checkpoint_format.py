"""A checkpoint's files: what a restart needs, in one directory per committed step, complete or absent.

    state.json             rank 0: cursor (epoch, position, step), world size, the file manifest
    drafter.safetensors    rank 0: drafter weights (trainable parameters only)
    optim.pt               rank 0: optimizer + LR scheduler state
    rng_rank{r}.pt         every rank: python, numpy and torch RNG states

`write_checkpoint` writes them (from a `StateSnapshot`: the state copied, so a background upload can
overlap training); `load_checkpoint` checks the manifest (names and sizes) before anything is restored.
When they are written and how they reach the run's storage: checkpoint.py. Which checkpoint a restart
resumes from: runtime/checkpoints.py.
"""
from __future__ import annotations

import copy
import json
import os
import pickle
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_ray.atomic import write_json_atomic
from dflash_ray.runtime.stream.feed import Cursor
from dflash_ray.runtime.training.faults import pause_point


STATE = "state.json"
WEIGHTS = "drafter.safetensors"
OPTIM = "optim.pt"


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
                     world_size: int, extra: dict | None = None, snapshot: StateSnapshot | None = None) -> None:
    """Rank 0's files (the other ranks call write_rank_files only), from `snapshot` or from the live
    drafter/optimizer/scheduler. state.json, with the manifest, is written last (a test may pause in
    between: faults.pause_point("write"), a half-written checkpoint to kill a process in)."""
    from safetensors.torch import save_file

    if snapshot is None:
        snapshot = capture_state(drafter, optimizer, scheduler)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(snapshot.weights, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    except Exception as e:
        raise local_write_error(out_dir, e) from e
    pause_point("write")
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


def cursor_metrics(cursor: Cursor) -> dict:
    return {"cursor_epoch": cursor.epoch, "cursor_position": cursor.position, "cursor_step": cursor.step}
