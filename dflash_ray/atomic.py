"""Files and directories that appear whole or not at all: written in a temporary sibling, swapped in on
success."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path


def atomic_dir(final: str | os.PathLike):
    """A context manager yielding a temporary sibling directory that replaces `final` only on success."""
    return _AtomicDir(Path(final))


class _AtomicDir:
    def __init__(self, final: Path):
        self.final = final
        self.tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.final, old)
            os.replace(self.tmp, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        return False


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """A JSON file that is whole or absent (written beside it, then renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
