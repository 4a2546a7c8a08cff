"""This machine's cache of things built once and reused by every run: $DFLASH_RAY_CACHE, else
~/.cache/dflash-ray. No Ray, no torch.

    <cache>/gguf/<digest>/          GGUF files converted to Hugging Face directories (model/gguf.py)
    <cache>/demo-worlds/<key>/      the embedded default's demo worlds (demo/world.py)

A keyed entry (KeyedEntry) is a directory whose record file is written last and lists every file with its
size and sha256: an entry without its record (a build killed midway) or whose files no longer match it
(deleted, truncated, edited) is damaged, and is built again. Builds of one entry take a lock, so two runs
that need it at once build it once.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_RAY_CACHE") or Path.home() / ".cache" / "dflash-ray")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def key_digest(what: dict) -> str:
    """A short, stable name for what determines an entry (a JSON-able dict)."""
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


class KeyedEntry:
    """<root>/<key>/, complete when its record (RECORD, written last) matches every file under it."""

    RECORD = "cache-entry.json"

    def __init__(self, root: str | os.PathLike, what: dict):
        self.what = what
        self.key = key_digest(what)
        self.path = Path(root) / self.key

    def problem(self) -> str | None:
        """Why the entry cannot be used (None: it can): missing, or damaged and how."""
        record = self.path / self.RECORD
        if not self.path.exists():
            return "missing"
        try:
            files = json.loads(record.read_text())["files"]
        except (OSError, ValueError, KeyError):
            return f"damaged: no readable {self.RECORD} (a build that did not finish)"
        for rel, (size, digest) in sorted(files.items()):
            f = self.path / rel
            if not f.is_file():
                return f"damaged: {rel} is missing"
            if f.stat().st_size != size or file_digest(f) != digest:
                return f"damaged: {rel} differs from the entry's record"
        return None

    @contextlib.contextmanager
    def lock(self):
        """Held while an entry is checked and built: another process needing it waits, then finds it built."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / f".{self.key}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def build(self, make, facts: dict | None = None) -> None:
        """Build the entry again: make(directory) fills a temporary sibling, which replaces the entry once its
        record is written (a damaged entry is removed first)."""
        from dflash_ray.atomic import atomic_dir

        with atomic_dir(self.path) as tmp:
            make(tmp)
            files = {str(p.relative_to(tmp)): [p.stat().st_size, file_digest(p)]
                     for p in sorted(tmp.rglob("*")) if p.is_file()}
            (tmp / self.RECORD).write_text(json.dumps({"what": self.what, "files": files, **(facts or {})},
                                                      indent=1, default=str))

    def record(self) -> dict:
        return json.loads((self.path / self.RECORD).read_text())
