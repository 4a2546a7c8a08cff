"""Checkpoints: what a restart needs, in one directory per committed step, complete or absent.

Every rank writes its part into a fresh local directory and hands it to `ray.train.report`, which uploads
every rank's files into the same checkpoint directory and registers the checkpoint only when all ranks
have reported (an interrupted upload is never registered, so never resumed from):

    state.json             rank 0: cursor (epoch, position, step), world size, the file manifest
    drafter.safetensors    rank 0: drafter weights (trainable parameters only)
    optim.pt               rank 0: optimizer + LR scheduler state
    rng_rank{r}.pt         every rank: python, numpy and torch RNG states

`load_checkpoint` checks the manifest (names and sizes) before anything is restored.

The feed of a restarted worker group must start where the checkpoint it will resume from ends. Ray
Train hands that checkpoint to the workers; the dataset factory, which runs in Ray Train's controller
before the workers start, reads the same fact from the controller's persisted record of registered
checkpoints (`latest_checkpoint_cursor`): the metrics reported with the checkpoint carry the cursor. The
workers check that the two agree and fail loudly if they do not.
"""
from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import torch

from dflash_ray.runtime.feed import Cursor

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


def write_rank_files(out_dir: Path, rank: int) -> None:
    with open(out_dir / f"rng_rank{rank}.pt", "wb") as f:
        pickle.dump(rng_state(), f)


def write_checkpoint(out_dir: Path, *, drafter, optimizer, scheduler, cursor: Cursor, world_size: int,
                     extra: dict | None = None) -> None:
    """Rank 0's files (the other ranks call write_rank_files only)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    module = getattr(drafter, "module", drafter)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, out_dir / OPTIM)
    write_rank_files(out_dir, 0)
    files = {name: (out_dir / name).stat().st_size for name in (WEIGHTS, OPTIM)}
    meta = {"cursor": cursor.as_dict(), "world_size": int(world_size), "files": files,
            "rank_files": [f"rng_rank{r}.pt" for r in range(world_size)], **(extra or {})}
    tmp = out_dir / f".{STATE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out_dir / STATE)


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
    """Restore weights, optimizer, scheduler and this rank's RNG; return the cursor."""
    meta = read_state(ckpt_dir)
    module = getattr(drafter, "module", drafter)
    module.load_state_dict(load_weights(ckpt_dir), strict=True)
    opt = torch.load(Path(ckpt_dir) / OPTIM, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = Path(ckpt_dir) / f"rng_rank{rank}.pt"
    if rng.exists():  # a rank that did not exist before (more workers now) keeps its fresh seed
        with open(rng, "rb") as f:
            set_rng_state(pickle.load(f))
    return Cursor.from_dict(meta["cursor"])


def latest_checkpoint_cursor(experiment_dir: str) -> Cursor:
    """The cursor of the latest checkpoint Ray Train has registered for this run (Cursor() if none).

    Reads Ray Train's checkpoint-manager snapshot, which the controller rewrites whenever it registers a
    checkpoint; our cursor travels in the metrics reported with it."""
    path = Path(experiment_dir) / SNAPSHOT
    if "://" in str(experiment_dir):
        import pyarrow.fs as pafs

        fs, p = pafs.FileSystem.from_uri(f"{experiment_dir.rstrip('/')}/{SNAPSHOT}")
        try:
            with fs.open_input_stream(p) as f:
                text = f.read().decode()
        except (FileNotFoundError, OSError):
            return Cursor()
    else:
        if not path.exists():
            return Cursor()
        text = path.read_text()
    snap = json.loads(text)
    latest = snap.get("latest_checkpoint_result")
    if not latest:
        return Cursor()
    m = latest.get("metrics", {})
    if "cursor_epoch" not in m:
        raise RuntimeError(f"{path}: the latest checkpoint has no cursor in its metrics "
                           "(written by another program?)")
    return Cursor(int(m["cursor_epoch"]), int(m["cursor_position"]), int(m["cursor_step"]))


def cursor_metrics(cursor: Cursor) -> dict:
    return {"cursor_epoch": cursor.epoch, "cursor_position": cursor.position, "cursor_step": cursor.step}
