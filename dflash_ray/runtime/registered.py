"""The run's registered checkpoints as the driver sees them, and the cursor a checkpoint carries.

A checkpoint becomes the one a restart resumes from when Ray Train registers it (after every rank's upload,
in report order). The driver reads that record through Ray Train's public `Result.from_path` (`registered`):
the latest registered checkpoint and the metrics reported with it (our cursor travels there), and every
registered directory (to remove the ones never registered). Ray keeps the record in a file of its own whose
format this project does not read; Ray refuses a record it cannot parse (damaged, or another Ray version's
format), said in one line here. Storage goes through pyarrow's filesystems, so local paths, NFS and s3:// go
the same way.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_ray.errors import UserError


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


@contextlib.contextmanager
def _quiet_ray_train():
    """Ray Train logs a paragraph at INFO each time it loads a run's record (meant for a trainer restoring
    one); the driver reads it several times a run."""
    logger = logging.getLogger("ray.train")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def registered(experiment_dir: str):
    """Ray Train's record of the run's registered checkpoints (`ray.train.Result`: `checkpoint` and
    `metrics` of the latest, `best_checkpoints` every one kept), None before the first one. A record Ray
    cannot load (damaged, another Ray version's format, naming a checkpoint that is gone) is one line."""
    from ray.train import Result

    try:
        with _quiet_ray_train():
            return Result.from_path(str(experiment_dir))
    except RuntimeError:   # Ray's words for "nothing registered here": no experiment folder, or no record yet
        return None
    except Exception as e:  # noqa: BLE001 - Ray Train's initialization error for a record it cannot load
        cause = " ".join(str(e).split())
        raise UserError(f"{experiment_dir}: Ray Train cannot read this run's record of its checkpoints ({cause[:300]}); "
                        "resume under the Ray version that wrote it, or train under a new run.name") from e


def has_checkpoint(experiment_dir: str) -> bool:
    """Ray Train has registered a checkpoint of this run: a rerun resumes."""
    result = registered(experiment_dir)
    return result is not None and result.checkpoint is not None


def remove_unregistered_checkpoints(experiment_dir: str) -> list[str]:
    """Remove the checkpoint directories in storage that Ray Train never registered (a driver killed
    between the ranks' uploads and the registration, a failed upload's remains): nothing will ever read
    them (a resume uses the registered latest only) and each is a whole checkpoint's bytes. Called by the
    driver before its first fit, when no upload of this run can be in flight; keeps every directory the
    record names (every checkpoint kept, the latest among them). Returns the names removed."""
    import pyarrow.fs as pafs

    result = registered(experiment_dir)
    keep = set()
    if result is not None:
        kept = [c for c, _ in result.best_checkpoints or []] + [result.checkpoint]
        keep = {Path(c.path).name for c in kept if c is not None}
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
    result = registered(experiment_dir)
    if result is None or result.checkpoint is None:
        return Cursor(), None
    m = result.metrics or {}
    if "cursor_epoch" not in m:
        raise UserError(f"{experiment_dir}: the latest registered checkpoint has no cursor in its metrics "
                        "(written by another program?): train under a new run.name")
    cursor = Cursor(int(m["cursor_epoch"]), int(m["cursor_position"]), int(m["cursor_step"]))
    return cursor, f"{str(experiment_dir).rstrip('/')}/{Path(result.checkpoint.path).name}"


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
