"""The feature cache (`train.features`): the target's tapped-layer features of each sample, computed once and
read back in later epochs, on the node that computed them. No Ray, no torch: numpy arrays and files.

    online   every epoch runs every batch through the target actors (the features are never stored)
    hybrid   a batch whose samples are all in the node's cache is read from it (no target forward); any
             other batch runs through the target, and its samples' features are written to the cache. On
             one node the first epoch computes and writes, the later epochs only read; a rerun with the
             same key (another lr, a resumed run) reads from its first batch
    offline  hybrid, with the target's pass over every sample first (stream/offline.py), before the drafter
             workers start, on every target slot: the peers' offline path (dump, then train) inside one run.
             Asked for only: on two shared CPU cores it measured slower than side by side (443 s against
             413 s for SmolLM2's one-epoch job, docs/notes/performance.md)
    auto     hybrid when the run trains more than one epoch and the cache fits `train.feature_cache_gb` and
             the disk; online otherwise, saying why (the 8B presets' corpora need terabytes)

Per sample, not per batch: every epoch's plan cuts other batches (data/plan.py), while a sample's features
are the same in any batch it rides in (right padding under a causal mask; equal up to the float rounding of
another batch shape). Keyed by what determines them (`cache_key`): the target's files, the taps, the compute
dtype and the shards' tokens (run_inputs' contents digest); a sample by its id and its trained length (a
truncated row's features are its first `length` tokens').

Node-local: <train.feature_cache_dir or $DFLASH_RAY_CACHE/features>/<key>/<id % 256>/<id>-<length>.feat,
each file written beside itself and renamed (a killed writer leaves a temporary name, never an entry), with
a header that holds its shape, dtype and a CRC-32 of its bytes: a truncated or damaged entry is found on
read, removed, counted and computed again, never trained from. A write that fails (a full disk) stops the
cache's writes for that actor and the run goes on online, counted.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
import zlib
from pathlib import Path

import numpy as np

_MAGIC = b"DFRFEAT1"
_HEADER = struct.Struct("<8sqqII")   # magic, length, width, dtype code, crc32 of the payload
# float32, bfloat16 as its int16 bits (rows.encode_features), int32 (rows.encode_soft_labels)
_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i2"), 3: np.dtype("<i4")}
_CODES = {v: k for k, v in _DTYPES.items()}


def cache_key(target_path: str, taps, dtype: str, contents: str) -> str:
    """What determines a sample's features: the target's files (each file's name, size and modification time,
    and config.json's contents: a changed or replaced checkpoint is another key), the taps, the dtype, the
    shards' tokens (data.shards.contents_digest: a sample id names the same tokens only within it)."""
    files = {}
    root = Path(target_path)
    if root.is_dir():
        for p in sorted(root.rglob("*")):
            if p.is_file():
                st = p.stat()
                files[str(p.relative_to(root))] = [st.st_size, st.st_mtime_ns]
        config = (root / "config.json").read_text() if (root / "config.json").is_file() else ""
    else:   # a remote target: its path names it
        config = ""
    what = {"target": str(target_path), "files": files, "config": config, "taps": [int(t) for t in taps],
            "dtype": dtype, "tokens": contents}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def soft_label_key(key: str, top_k: int) -> str:
    """The key of distillation's soft labels (the target's next-token top-k): beside the features', per k."""
    return f"{key}-top{int(top_k)}"


def cache_bytes(tokens: int, taps: int, hidden: int, dtype: str, top_k: int = 0) -> int:
    """The whole corpus's features on disk: tokens x taps x hidden x bytes, and with distillation's top-k
    8 bytes a token per k (a node caches the samples its ranks train: on one node all of them, on several
    about 1/nodes in the first epoch, more later)."""
    return int(tokens) * (int(taps) * int(hidden) * (2 if dtype == "bfloat16" else 4) + 8 * int(top_k))


def choose_features(mode: str, epochs: int, need_bytes: int, budget_gb: float, free_bytes: int | None) -> tuple[str, str]:
    """(online | hybrid | offline, why): `train.features` answered for this run. auto stays online when the
    cache would not fit (and says why); an explicit hybrid or offline that would not fit is refused, one line.
    auto never takes offline: side by side (online, hybrid's first epoch) measured faster than the target's
    pass first on two shared CPU cores (docs/notes/performance.md)."""
    from dflash_ray.errors import UserError

    need = f"{need_bytes / 2**30:,.2f} GiB of features"
    if mode == "online":
        return "online", "train.features=online"
    misfit = None
    if need_bytes > budget_gb * 2**30:
        misfit = f"{need} over train.feature_cache_gb={budget_gb:g}"
    elif free_bytes is not None and need_bytes > free_bytes:
        misfit = f"{need} over the cache disk's {free_bytes / 2**30:,.1f} GiB free"
    if misfit and mode in ("hybrid", "offline"):
        raise UserError(f"config key 'train.features': {mode} needs {misfit}: raise the budget, free the disk, "
                        "set train.feature_cache_dir elsewhere, or train online")
    if misfit:
        return "online", misfit
    fits = f"{need}, within train.feature_cache_gb={budget_gb:g}"
    if mode == "auto" and epochs <= 1:
        return "online", "one epoch: a cache would be written and never read (train.features=hybrid caches it for later runs)"
    return ("offline" if mode == "offline" else "hybrid"), fits


def default_root() -> Path:
    from dflash_ray.machine_cache import cache_root

    return cache_root() / "features"


def cache_disk(configured: str | None) -> tuple[Path, int | None]:
    """(the cache's root on this node, the free bytes of its disk: of its nearest existing parent)."""
    import shutil

    root = Path(configured or default_root())
    probe = next((p for p in [root, *root.parents] if p.exists()), None)
    return root, shutil.disk_usage(probe).free if probe is not None else None


class FeatureCache:
    """One key's entries on this node. Counts what it did (`counts`) for the run record."""

    def __init__(self, root: str | os.PathLike, key: str):
        self.dir = Path(root) / key
        self.writable = True
        self.counts = {"read_rows": 0, "read_bytes": 0, "written_samples": 0, "written_bytes": 0, "damaged": 0,
                       "write_errors": 0}

    def path(self, sample_id: int, length: int) -> Path:
        return self.dir / f"{int(sample_id) % 256:02x}" / f"{int(sample_id)}-{int(length)}.feat"

    def get(self, sample_id: int, length: int) -> np.ndarray | None:
        """The sample's features [length, width] as written, or None (missing; damaged: removed and counted)."""
        p = self.path(sample_id, length)
        try:
            data = p.read_bytes()
        except OSError:
            return None
        try:
            magic, n, width, code, crc = _HEADER.unpack_from(data)
            dtype = _DTYPES[code]
            payload = memoryview(data)[_HEADER.size:]
            if magic != _MAGIC or n != length or len(payload) != n * width * dtype.itemsize \
                    or zlib.crc32(payload) != crc:
                raise ValueError("damaged")
        except (struct.error, KeyError, ValueError):
            self.counts["damaged"] += 1
            p.unlink(missing_ok=True)
            return None
        return np.frombuffer(payload, dtype=dtype).reshape(n, width)

    def put(self, sample_id: int, features: np.ndarray) -> None:
        """Write one sample's features [length, width] (float32 or int16 bits), whole or not at all."""
        if not self.writable:
            return
        a = np.ascontiguousarray(features)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        p = self.path(sample_id, a.shape[0])
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            payload = a.tobytes()
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, a.shape[0], a.shape[1], _CODES[a.dtype], zlib.crc32(payload)))
                f.write(payload)
            os.replace(tmp, p)
        except OSError:   # a full or read-only disk: the run goes on online, counted
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.writable = False
            self.counts["write_errors"] += 1
            return
        self.counts["written_samples"] += 1
        self.counts["written_bytes"] += len(payload)

    def read_batch(self, sample_ids, lengths, width: int) -> np.ndarray | None:
        """A plan batch's features [rows, width_tokens, features] right-padded with zeros (the drafter never
        sees a context position at or after a row's length), or None when a sample is not cached."""
        rows = []
        for sid, n in zip(sample_ids, lengths):
            a = self.get(int(sid), int(n))
            if a is None:
                return None
            rows.append(a)
        out = np.zeros((len(rows), int(width), rows[0].shape[1]), dtype=rows[0].dtype)
        for r, a in enumerate(rows):
            out[r, : a.shape[0]] = a
        self.counts["read_rows"] += 1
        self.counts["read_bytes"] += int(out.nbytes)
        return out

    def has_batch(self, sample_ids, lengths) -> bool:
        """Whether every sample of a batch has an entry (a stat each, nothing read: the offline pass's
        resume check; a damaged entry still shows when it is read, and is then recomputed)."""
        return all(self.path(int(sid), int(n)).exists() for sid, n in zip(sample_ids, lengths))

    def write_batch(self, sample_ids, lengths, features: np.ndarray) -> None:
        """Each sample of a computed batch (features [rows, width_tokens, F]) under its id and length."""
        for r, (sid, n) in enumerate(zip(sample_ids, lengths)):
            if not self.writable:
                return
            if not self.path(int(sid), int(n)).exists():
                self.put(int(sid), features[r, : int(n)])
