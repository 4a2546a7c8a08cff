"""The run's registered checkpoints as the driver sees them, and the cursor a checkpoint carries.

A checkpoint becomes the one a restart resumes from when Ray Train registers it (after every rank's upload,
in report order). Ray Train 2.60 keeps that record in the experiment directory's
checkpoint_manager_snapshot.json (SNAPSHOT), which this module alone reads: the latest registered
checkpoint and the metrics reported with it (our cursor travels there), and every registered directory
(to remove the ones never registered). Ray's file is not a public format: the pin on Ray (pyproject.toml)
and tests/reliability/test_faults_on_ray.py, which reads it after real Ray Train runs, keep the two in step.
Storage is read through pyarrow's filesystems, so local paths, NFS and s3:// go the same way.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SNAPSHOT = "checkpoint_manager_snapshot.json"   # Ray Train 2.60's record of registered checkpoints


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    position: int = 0      # next plan position of `epoch` to train
    step: int = 0          # optimizer steps committed so far (global, over all epochs)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Cursor":
        if not d:
            return cls()
        return cls(int(d.get("epoch", 0)), int(d.get("position", 0)), int(d.get("step", 0)))


def filesystem(uri_or_path: str):
    """(pyarrow filesystem, path inside it) for a local path or a URI (s3://, gs://, file://, ...)."""
    import pyarrow.fs as pafs

    if "://" in str(uri_or_path):
        return pafs.FileSystem.from_uri(str(uri_or_path))
    return pafs.LocalFileSystem(), str(Path(uri_or_path).resolve())


def read_snapshot(experiment_dir: str) -> dict | None:
    """Ray Train's record of the run's registered checkpoints (None before the first one), read through
    pyarrow's filesystem layer so local paths, NFS and s3:// storage go the same way."""
    fs, path = filesystem(f"{str(experiment_dir).rstrip('/')}/{SNAPSHOT}")
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
    fs, path = filesystem(experiment_dir)
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

    fs, path = filesystem(checkpoint)
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield Path(tmp)
