"""The driver's side of a run's checkpoints: `RunCheckpoints`, what Ray Train registered for the run and the
export of the latest. The workers' side (restore, when to save, the write and upload): training/checkpoint.py
`CheckpointManager`; the files of one checkpoint: training/checkpoint_format.py.

A checkpoint becomes the one a restart resumes from when Ray Train registers it (after every rank's upload,
in report order). The driver reads that record through Ray Train's public `Result.from_path`: the latest
registered checkpoint and the metrics reported with it (our cursor travels there), and every registered
directory (to remove the ones never registered). Ray keeps the record in a file of its own whose format
this project does not read; Ray refuses a record it cannot parse (damaged, or another Ray version's format),
said in one line here. Storage goes through pyarrow's filesystems, so local paths, NFS and s3:// go the
same way.

The modules below this floor get what they need from here handed to them: the stream's dataset factory
holds a `RunCheckpoints` (it reads where each stream starts in Ray Train's controller), the run's inputs
check is told whether the run resumes, the summary is given the latest checkpoint.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

from dflash_ray.errors import UserError
from dflash_ray.runtime.stream.feed import Cursor


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


class RunCheckpoints:
    """The checkpoints of the run whose Ray Train directory is `experiment_dir` (a local path or a URI), as
    the driver sees them. Holds nothing but the directory: every answer is read from storage when asked (a
    restart registers new ones meanwhile), and it travels to Ray Train's controller as it is."""

    def __init__(self, experiment_dir: str):
        self.experiment_dir = str(experiment_dir)

    @property
    def storage_path(self) -> str:
        """The experiment directory as its filesystem names it (what a storage error's message says)."""
        return filesystem(self.experiment_dir)[1]

    def registered(self):
        """Ray Train's record of the run's registered checkpoints (`ray.train.Result`: `checkpoint` and
        `metrics` of the latest, `best_checkpoints` every one kept), None before the first one. A record Ray
        cannot load (damaged, another Ray version's format, naming a checkpoint that is gone) is one line."""
        from ray.train import Result

        try:
            with _quiet_ray_train():
                return Result.from_path(self.experiment_dir)
        except RuntimeError:   # Ray's words for "nothing registered here": no experiment folder, or no record yet
            return None
        except Exception as e:  # noqa: BLE001 - Ray Train's initialization error for a record it cannot load
            cause = " ".join(str(e).split())
            raise UserError(f"{self.experiment_dir}: Ray Train cannot read this run's record of its checkpoints "
                            f"({cause[:300]}); resume under the Ray version that wrote it, or train under a new "
                            "run.name") from e

    def exists(self) -> bool:
        """Ray Train has registered a checkpoint of this run: a rerun resumes."""
        result = self.registered()
        return result is not None and result.checkpoint is not None

    def latest(self) -> tuple[Cursor, str | None]:
        """The cursor and the location (a local path or a URI) of the latest checkpoint Ray Train has
        registered for this run; (Cursor(), None) before the first one. Our cursor travels in the metrics
        reported with the checkpoint."""
        result = self.registered()
        if result is None or result.checkpoint is None:
            return Cursor(), None
        m = result.metrics or {}
        if "cursor_epoch" not in m:
            raise UserError(f"{self.experiment_dir}: the latest registered checkpoint has no cursor in its metrics "
                            "(written by another program?): train under a new run.name")
        cursor = Cursor(int(m["cursor_epoch"]), int(m["cursor_position"]), int(m["cursor_step"]))
        return cursor, f"{self.experiment_dir.rstrip('/')}/{Path(result.checkpoint.path).name}"

    def remove_unregistered(self) -> list[str]:
        """Remove the checkpoint directories in storage that Ray Train never registered (a driver killed
        between the ranks' uploads and the registration, a failed upload's remains): nothing will ever read
        them (a resume uses the registered latest only) and each is a whole checkpoint's bytes. Called by the
        driver before its first fit, when no upload of this run can be in flight; keeps every directory the
        record names (every checkpoint kept, the latest among them). Returns the names removed."""
        import pyarrow.fs as pafs

        result = self.registered()
        keep = set()
        if result is not None:
            kept = [c for c, _ in result.best_checkpoints or []] + [result.checkpoint]
            keep = {Path(c.path).name for c in kept if c is not None}
        fs, path = filesystem(self.experiment_dir)
        removed = []
        for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
            if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_") \
                    and info.base_name not in keep:
                fs.delete_dir(info.path)
                removed.append(info.base_name)
        return sorted(removed)

    @staticmethod
    @contextlib.contextmanager
    def local(checkpoint: str):
        """A local directory holding the checkpoint at `checkpoint` (a path or a URI, as `latest` names it):
        the directory itself, or a temporary copy of a remote one, removed afterwards."""
        if "://" not in str(checkpoint):
            yield Path(checkpoint)
            return
        import pyarrow.fs as pafs

        fs, path = filesystem(checkpoint)
        with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
            pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            yield Path(tmp)

    def export_latest(self, run_spec, dtype: str = "target", card: dict | None = None) -> tuple[str, str] | None:
        """Write the drafter of the latest checkpoint to <run.dir>/export, as a Hugging Face directory the
        reference `dflash` package and transformers' AutoModel load (model/export.py writes it), in the
        target's dtype unless `dtype` names one (serving engines load the drafter beside the target, in its
        dtype; bf16 is also half the file). Returns (checkpoint, export dir), or None when the run has no
        checkpoint. `run_spec`: the run's RunSpec (runtime/spec.py), for the drafter's shape."""
        import torch

        from dflash_ray.model.export import export_drafter
        from dflash_ray.model.target import target_dtype
        from dflash_ray.run_layout import RunLayout
        from dflash_ray.runtime.training.checkpoint_format import load_weights, read_state
        from dflash_ray.runtime.training.model import build_run_drafter

        _, checkpoint = self.latest()
        if checkpoint is None:
            return None
        with self.local(checkpoint) as d:
            read_state(d)
            drafter = build_run_drafter(run_spec, torch.device("cpu"))
            drafter.load_state_dict(load_weights(d), strict=True)
        out_dtype = target_dtype(run_spec.target_path) if dtype == "target" else getattr(torch, dtype)
        return checkpoint, export_drafter(drafter, str(RunLayout(run_spec.run_dir).export), dtype=out_dtype,
                                          card=card)
