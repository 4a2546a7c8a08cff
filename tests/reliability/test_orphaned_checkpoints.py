"""Local checkpoint directories left by a worker killed while writing (or before Ray's async upload
deleted them) are removed by the next worker that starts on the node; a live writer's are kept."""
from __future__ import annotations

import os
import subprocess
import sys

from dflash_ray.runtime.training.checkpoint import _local_prefix, remove_orphaned_local_checkpoints


def test_only_dead_writers_directories_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)                      # exited: nobody writes its directory any more
    orphan = tmp_path / f"dflash-ckpt-{dead_pid}-a1b2c3"
    mine = tmp_path / f"{_local_prefix()}x9y8z7"      # this process, alive
    export_copy = tmp_path / "dflash-ckpt-k3j4l5m6"   # local_checkpoint's copy of a remote checkpoint
    for d in (orphan, mine, export_copy):
        d.mkdir()
        (d / "drafter.safetensors").write_bytes(b"x" * 10)
    assert _local_prefix() == f"dflash-ckpt-{os.getpid()}-"
    assert remove_orphaned_local_checkpoints(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and mine.exists() and export_copy.exists()
