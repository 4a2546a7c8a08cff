"""Parquet shards: the schema, atomic writes, and reads that reject bad input with one line naming the
file (and row: "row N (0-based)", the index pyarrow gives it) and what is wrong. (Long on purpose: the one
writer and every reader of the schema, so a check of bad input is made once, where the file is opened.)

Schema: sample_id int64 (unique over all shards), input_ids list<int32>, loss_mask list<int8>
(1 on assistant tokens), num_tokens int32; `prepare` also writes num_supervised int32 (the loss mask's
sum), which the planner reads to size the drafter's side of each batch. Shards made elsewhere may lack it:
the planner then counts every token as supervised.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_ray.errors import UserError

SCHEMA = pa.schema([
    ("sample_id", pa.int64()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
])
SUPERVISED = "num_supervised"
PREPARED_SCHEMA = SCHEMA.append(pa.field(SUPERVISED, pa.int32()))  # what `prepare` writes
_LIST_COLUMNS = ("input_ids", "loss_mask")


def filesystem_of(location: str):
    """(pyarrow filesystem, path) for a local path or any URI pyarrow opens (file://, s3://, gs://, hdfs://)."""
    import pyarrow.fs as pafs

    if "://" in str(location):
        try:
            return pafs.FileSystem.from_uri(str(location))
        except Exception as e:  # an unknown scheme, missing credentials: pyarrow's reason on one line
            raise UserError(f"{location}: cannot open this location ({str(e).splitlines()[0]})") from e
    return pafs.LocalFileSystem(), str(Path(location).resolve())


class ShardFile(str):
    """A shard's location as given (a path or a URI: what messages name), with the filesystem it lives on
    and its modification time as the listing gave it (nanoseconds; None where the filesystem has none)."""
    fs = None
    path = ""
    mtime_ns = None


def list_shards(directory: str | os.PathLike) -> list[ShardFile]:
    """The *.parquet files directly in `directory` (a local path or a URI), sorted."""
    import pyarrow.fs as pafs

    fs, root = filesystem_of(str(directory))
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"{directory}: shard directory does not exist")
    if info.type != pafs.FileType.Directory:
        raise UserError(f"{directory}: not a directory")
    found = sorted(((i.path, i.mtime_ns) for i in fs.get_file_info(pafs.FileSelector(root))
                    if i.type == pafs.FileType.File and i.path.endswith(".parquet")), key=lambda x: x[0])
    if not found:
        raise UserError(f"{directory}: no .parquet shards in directory")
    files = []
    for path, mtime_ns in found:
        name = path if "://" not in str(directory) else f"{str(directory).rstrip('/')}/{path.rsplit('/', 1)[-1]}"
        f = ShardFile(name)
        f.fs, f.path, f.mtime_ns = fs, path, mtime_ns
        files.append(f)
    return files


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class Footer(NamedTuple):
    """A shard file's size and a digest of its parquet footer (schema, row groups, column chunk offsets,
    sizes and statistics): its layout, which another writer or shard size changes for the same samples."""
    bytes: int
    digest: str


_TAIL = 1 << 16   # the footer is read with one read of the file's last 64 KiB (two when it is larger)


@contextlib.contextmanager
def _opened(path):
    """(ParquetFile, Footer) of a shard, its footer read once; the file handle is closed when the block
    ends, whatever happens in it (with many s3 shards no handle is left to the garbage collector)."""
    fs, where = (path.fs, path.path) if isinstance(path, ShardFile) and path.fs is not None \
        else filesystem_of(str(path))
    try:
        f = fs.open_input_file(where)
    except Exception as e:  # missing, a directory, no permission, a remote error
        raise UserError(f"{path}: not a readable parquet file ({_first_line(e)})") from e
    try:
        try:
            size = f.size()
            f.seek(max(size - _TAIL, 0))
            end = f.read(min(size, _TAIL))
            tail = end[-8:]
            n = int.from_bytes(tail[:4], "little") if len(tail) == 8 else -1
            if tail[4:] != b"PAR1" or not 0 < n <= size - 12:
                raise ValueError("no parquet footer")
            if n + 8 <= len(end):
                footer = end[len(end) - 8 - n:len(end) - 8]
            else:
                f.seek(size - 8 - n)
                footer = f.read(n)
            # the metadata parsed from the bytes read above: ParquetFile does not read the footer again
            pf = pq.ParquetFile(f, metadata=pq.read_metadata(pa.BufferReader(footer + tail)))
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise UserError(f"{path}: not a readable parquet file ({_first_line(e)})") from e
        yield pf, Footer(int(size), hashlib.blake2b(footer, digest_size=16).hexdigest())
    finally:
        f.close()


def _check_schema(path: Path, schema: pa.Schema, columns: Iterable[str]) -> None:
    for name in columns:
        if name not in schema.names:
            raise UserError(f"{path}: missing column '{name}' (has: {', '.join(schema.names)})")
        got = schema.field(name).type
        want = PREPARED_SCHEMA.field(name).type
        ok = (pa.types.is_integer(got) if not pa.types.is_list(want)
              else (pa.types.is_list(got) or pa.types.is_large_list(got)) and pa.types.is_integer(got.value_type))
        if not ok:
            raise UserError(f"{path}: column '{name}' has type {got}, expected {want}")


def _read(path: Path, columns: list[str], optional: tuple[str, ...] = ()) -> pa.Table:
    """Read `columns`, and those of `optional` the shard has; the whole schema is checked (metadata
    only), so a shard that would fail later in training fails here."""
    with _opened(path) as (pf, _):
        return _read_open(pf, path, columns, optional)


def _read_open(pf: pq.ParquetFile, path, columns: list[str], optional: tuple[str, ...] = ()) -> pa.Table:
    names = pf.schema_arrow.names
    present = [c for c in optional if c in names]
    _check_schema(path, pf.schema_arrow, SCHEMA.names + present)
    if pf.metadata.num_rows == 0:
        raise UserError(f"{path}: empty shard (0 rows)")
    try:
        table = pf.read(columns=list(columns) + present)
    except Exception as e:
        raise UserError(f"{path}: unreadable data ({_first_line(e)})") from e
    for name in table.column_names:
        col = table.column(name)
        if col.null_count:
            raise UserError(f"{path}: {_row(_first_row(col.is_null().to_numpy(zero_copy_only=False)))}: null {name}")
    return table


def _first_row(mask) -> int:
    return int(np.flatnonzero(np.asarray(mask))[0])


def _row(r) -> str:
    """A shard's row in a message, saying how it is counted (pq.read_table(path).slice(r) is that row)."""
    return f"row {r} (0-based)"


class SampleLengths(NamedTuple):
    sample_ids: np.ndarray       # int64
    num_tokens: np.ndarray       # int64
    num_supervised: np.ndarray   # int64; num_tokens where a shard has no num_supervised column
    files: list                  # (path, rows) per shard
    shards_without_supervised: int


def read_lengths(directory) -> SampleLengths:
    """sample_id, num_tokens and (where present) num_supervised of every sample: only those columns are
    read, checked for duplicate ids and impossible counts."""
    return scan_shards(directory).lengths


class ShardScan(NamedTuple):
    lengths: SampleLengths
    files: dict            # file name -> {"bytes", "rows", "footer", "mtime_ns"}: the layout (see Footer)
    max_token_id: int      # from the footers' statistics; -1 when vocab_size was not given
    contents: str | None   # contents_digest of the same pass (scan_shards(contents=True)), else None


def scan_shards(directory, vocab_size: int | None = None, hint: str = "", contents: bool = False) -> ShardScan:
    """What a run's start needs from the shards, in one pass that opens each file and reads its footer
    once: the schema check; with `vocab_size`, every token id in [0, vocab_size) (check_token_range: the
    footers' statistics, rows only where a row group has none or is out of range; `hint` ends its error
    line); the sample_id / num_tokens / num_supervised columns, checked (read_lengths); each file's size,
    rows and footer digest (the layout). contents=True also reads the token columns, in the same pass, for
    the contents digest (contents_digest)."""
    ids, lens, sups, files, missing, layout, top = [], [], [], [], 0, {}, -1
    digests = _ContentsDigest() if contents else None
    for path in list_shards(directory):
        with _opened(path) as (pf, footer):
            if vocab_size is not None:
                _check_schema(path, pf.schema_arrow, ["input_ids"])
                top = max(top, _token_range(pf, path, vocab_size, hint))
            t = _read_open(pf, path, ["sample_id", "num_tokens"] + (["input_ids", "loss_mask"] if contents else []),
                           optional=(SUPERVISED,))
        has_sup = SUPERVISED in t.column_names
        sid = t.column("sample_id").to_numpy().astype(np.int64)
        nt = t.column("num_tokens").to_numpy().astype(np.int64)
        if (nt < 0).any():
            raise UserError(f"{path}: {_row(_first_row(nt < 0))}: negative num_tokens")
        if has_sup:
            ns = t.column(SUPERVISED).to_numpy().astype(np.int64)
            bad = (ns < 0) | (ns > nt)
            if bad.any():
                r = _first_row(bad)
                raise UserError(f"{path}: {_row(r)}: {SUPERVISED} is {ns[r]}, outside 0..num_tokens ({nt[r]})")
        else:
            ns, missing = nt, missing + 1
        if digests is not None:
            digests.add(sid, t.column("input_ids"), t.column("loss_mask"))
        ids.append(sid)
        lens.append(nt)
        sups.append(ns)
        files.append((path, t.num_rows))
        layout[_file_name(path)] = {"bytes": footer.bytes, "rows": int(t.num_rows), "footer": footer.digest,
                                    "mtime_ns": path.mtime_ns}
    sample_ids = np.concatenate(ids)
    _check_unique(sample_ids, files)
    lengths = SampleLengths(sample_ids, np.concatenate(lens), np.concatenate(sups), files, missing)
    return ShardScan(lengths, layout, top, digests.hexdigest() if digests is not None else None)


def _file_name(path) -> str:
    return str(path).replace("\\", "/").rsplit("/", 1)[-1]


def _check_unique(sample_ids: np.ndarray, files: list[tuple[Path, int]]) -> None:
    order = np.argsort(sample_ids, kind="stable")
    dup = np.flatnonzero(sample_ids[order][1:] == sample_ids[order][:-1])
    if dup.size == 0:
        return
    first, second = int(order[dup[0]]), int(order[dup[0] + 1])
    bounds = np.cumsum([0] + [n for _, n in files])

    def where(i):
        f = int(np.searchsorted(bounds, i, side="right") - 1)
        return files[f][0], i - bounds[f]

    p2, r2 = where(second)
    p1, r1 = where(first)
    raise UserError(f"{p2}: {_row(r2)}: duplicate sample_id {int(sample_ids[second])} (first seen in {p1} {_row(r1)})")


def validate_tokens(path: Path, t: pa.Table, vocab_size: int | None, row_names=None) -> None:
    """Per-row checks of the token columns: lengths agree with num_tokens, ids in range, mask 0/1.
    Messages name the row of `t`, or `sample_id <row_names[r]>` where given (a part of a shard)."""
    def row(r) -> str:
        return _row(r) if row_names is None else f"sample_id {row_names[r]}"

    ids, mask = t.column("input_ids"), t.column("loss_mask")
    n_ids = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
    n_mask = pc.list_value_length(mask).to_numpy(zero_copy_only=False)
    nt = t.column("num_tokens").to_numpy().astype(np.int64)
    if (n_ids != n_mask).any():
        r = _first_row(n_ids != n_mask)
        raise UserError(f"{path}: {row(r)}: input_ids has {n_ids[r]} tokens but loss_mask has {n_mask[r]}")
    if (n_ids != nt).any():
        r = _first_row(n_ids != nt)
        raise UserError(f"{path}: {row(r)}: num_tokens is {nt[r]} but input_ids has {n_ids[r]} tokens")
    row_of = np.repeat(np.arange(t.num_rows), n_ids)
    flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    if flat.size and flat.min() < 0:
        raise UserError(f"{path}: {row(row_of[_first_row(flat < 0)])}: negative token id {flat.min()}")
    if vocab_size is not None and flat.size and flat.max() >= vocab_size:
        bad = _first_row(flat >= vocab_size)
        raise UserError(f"{path}: {row(row_of[bad])}: token id {flat[bad]} is out of vocabulary (size {vocab_size})")
    fm = pc.list_flatten(mask).to_numpy(zero_copy_only=False)
    if fm.size and ((fm != 0) & (fm != 1)).any():
        raise UserError(f"{path}: {row(row_of[_first_row((fm != 0) & (fm != 1))])}: loss_mask values must be 0 or 1")
    if SUPERVISED in t.column_names:
        sums = np.bincount(row_of, weights=fm, minlength=t.num_rows).astype(np.int64)
        ns = t.column(SUPERVISED).to_numpy(zero_copy_only=False).astype(np.int64)
        if (sums != ns).any():
            r = _first_row(sums != ns)
            raise UserError(f"{path}: {row(r)}: {SUPERVISED} is {ns[r]} but loss_mask has {sums[r]} ones")


def iter_validated(directory, vocab_size: int | None = None):
    """(path, table) of every shard, each fully validated; sample_ids unique over all shards (checked
    when the last shard has been read)."""
    ids, files = [], []
    for path in list_shards(directory):
        t = _read(path, list(SCHEMA.names), optional=(SUPERVISED,))
        validate_tokens(path, t, vocab_size)
        ids.append(t.column("sample_id").to_numpy())
        files.append((path, t.num_rows))
        yield path, t.select(SCHEMA.names).cast(SCHEMA)
    _check_unique(np.concatenate(ids), files)


def read_all(directory, vocab_size: int | None = None) -> pa.Table:
    """Every column of every shard, fully validated, as one table (for the token store)."""
    return pa.concat_tables([t for _, t in iter_validated(directory, vocab_size)])


def check_shards(directory, vocab_size: int | None = None) -> int:
    """Validate every shard fully, one shard in memory at a time; returns the number of samples."""
    return sum(t.num_rows for _, t in iter_validated(directory, vocab_size))


# ----------------------------------------------------------------------------- atomic file writes
def write_table_atomic(table: pa.Table, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ----------------------------------------------------------------------------- cheap checks before a run
def check_token_range(directory, vocab_size: int, hint: str = "") -> int:
    """Every token id of every shard in [0, vocab_size), from the input_ids statistics in the parquet
    footers (every pyarrow/Spark writer writes them by default): no data is read unless a row group has
    none (then that row group's input_ids are read), or is out of range (then it is read to name the row).
    Returns the largest token id. `hint` is appended to the error line. (`scan_shards` does the same in
    its pass.)"""
    top = -1
    for path in list_shards(directory):
        with _opened(path) as (pf, _):
            _check_schema(path, pf.schema_arrow, ["input_ids"])
            top = max(top, _token_range(pf, path, vocab_size, hint))
    return top


def _token_range(pf: pq.ParquetFile, path, vocab_size: int, hint: str) -> int:
    """The largest token id of one open shard, every id checked against [0, vocab_size) (see check_token_range)."""
    top = -1
    md = pf.metadata
    leaf = next(i for i in range(md.num_columns) if md.schema.column(i).path.split(".")[0] == "input_ids")
    row0 = 0
    for rg in range(md.num_row_groups):
        stats = md.row_group(rg).column(leaf).statistics
        ids = None
        if stats is not None and stats.has_min_max:
            lo, hi = int(stats.min), int(stats.max)
        else:
            ids = _row_group_ids(pf, path, rg)
            flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
            lo, hi = (int(flat.min()), int(flat.max())) if flat.size else (0, -1)
        if lo < 0 or hi >= vocab_size:
            ids = ids if ids is not None else _row_group_ids(pf, path, rg)
            n = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64)
            bad = _first_row((flat < 0) | (flat >= vocab_size))
            row = row0 + int(np.repeat(np.arange(len(n)), n)[bad])
            what = "negative token id" if flat[bad] < 0 else "token id"
            raise UserError(f"{path}: {_row(row)}: {what} {flat[bad]} is out of vocabulary (size {vocab_size}){hint}")
        top = max(top, hi)
        row0 += md.row_group(rg).num_rows
    return top


def _row_group_ids(pf: pq.ParquetFile, path, rg: int):
    try:
        return pf.read_row_group(rg, columns=["input_ids"]).column("input_ids").combine_chunks()
    except Exception as e:
        raise UserError(f"{path}: unreadable data ({_first_line(e)})") from e


# ----------------------------------------------------------------------------- what a resume compares
# A resume is exactly-once only if the plan is the first run's, and it trains what the first run trained.
# The plan is a function of each sample's (sample_id, num_tokens, num_supervised) in sample_id order (and
# of the config): `samples_fingerprint` hashes exactly that, whatever the file layout (file names, shard
# sizes, row order, row groups, writer: `data.prepare_engine=ray` or local), from the three columns the
# plan reads anyway (9 ms for 20K samples / 26M tokens here). The tokens themselves (input_ids, loss_mask)
# can change with every length unchanged (a loss-mask fix, a remapped vocabulary); no cheap statistic of
# them is layout independent (parquet statistics are per row group), so `contents_digest` reads them: once,
# at a run's first start, and again only on a resume whose files changed (another layout: same samples?
# same tokens?). A resume of unchanged files compares their listing and footers only: size, rows, footer
# digest and modification time. The footer alone would miss a token rewritten in place (same size and
# statistics: the footer is byte-identical); the modification time, which any rewrite moves, never refuses
# by itself (a copy that does not keep it costs one read of the tokens, which are then found the same).

def samples_fingerprint(lengths: SampleLengths) -> dict:
    """{"samples", "tokens", "supervised", "digest"}: the samples' counts and a digest of every
    (sample_id, num_tokens, num_supervised) in sample_id order: what the plan is a function of."""
    o = np.argsort(lengths.sample_ids, kind="stable")
    h = hashlib.blake2b(digest_size=16)
    for column in (lengths.sample_ids, lengths.num_tokens, lengths.num_supervised):
        h.update(np.ascontiguousarray(column[o], dtype="<i8").tobytes())
    return {"samples": int(lengths.sample_ids.size), "tokens": int(lengths.num_tokens.sum()),
            "supervised": int(lengths.num_supervised.sum()), "digest": h.hexdigest()}


class _ContentsDigest:
    """Per sample a digest of its input_ids (as int32) and loss_mask (as int8); the digest of them all in
    sample_id order (so independent of files and row order)."""

    def __init__(self):
        self.ids, self.rows = [], []

    def add(self, sample_ids: np.ndarray, input_ids, loss_mask) -> None:
        ids, mask = input_ids.combine_chunks(), loss_mask.combine_chunks()
        io, mo = ids.offsets.to_numpy(), mask.offsets.to_numpy()
        iv = ids.values.to_numpy(zero_copy_only=False).astype("<i4", copy=False)
        mv = mask.values.to_numpy(zero_copy_only=False).astype("i1", copy=False)
        out = np.empty((len(sample_ids), 16), np.uint8)
        for r in range(len(sample_ids)):
            h = hashlib.blake2b(iv[io[r]:io[r + 1]], digest_size=16)
            h.update(mv[mo[r]:mo[r + 1]])
            out[r] = np.frombuffer(h.digest(), np.uint8)
        self.ids.append(np.asarray(sample_ids, np.int64))
        self.rows.append(out)

    def hexdigest(self) -> str:
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        rows = np.concatenate(self.rows) if self.rows else np.zeros((0, 16), np.uint8)
        o = np.argsort(ids, kind="stable")
        h = hashlib.blake2b(np.ascontiguousarray(ids[o], dtype="<i8").tobytes(), digest_size=16)
        h.update(np.ascontiguousarray(rows[o]).tobytes())
        return h.hexdigest()


def contents_digest(directory) -> str:
    """A digest of every sample's tokens and loss mask in sample_id order: the same for the same samples
    in any file layout. Reads the sample_id, input_ids and loss_mask columns of every shard, one shard in
    memory at a time (0.3 s for 26M tokens in 20 local shards here)."""
    digest = _ContentsDigest()
    for path in list_shards(directory):
        with _opened(path) as (pf, _):
            t = _read_open(pf, path, ["sample_id", "input_ids", "loss_mask"])
        digest.add(t.column("sample_id").to_numpy().astype(np.int64), t.column("input_ids"), t.column("loss_mask"))
    return digest.hexdigest()


def fingerprint_change(old: dict, new: dict) -> tuple[str, str, int] | None:
    """The first difference between two layouts (`ShardScan.files`): (file name, what happened, how many files
    differ in all); None when they are equal."""
    removed = sorted(set(old) - set(new))
    added = sorted(set(new) - set(old))
    changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    total = len(removed) + len(added) + len(changed)
    if removed:
        return removed[0], "removed", total
    if changed:
        a, b = old[changed[0]], new[changed[0]]
        detail = (f"{a['bytes']} -> {b['bytes']} bytes, {a['rows']} -> {b['rows']} rows"
                  if (a["bytes"], a["rows"]) != (b["bytes"], b["rows"]) else "same size, other contents")
        return changed[0], f"changed ({detail})", total
    if added:
        return added[0], "added", total
    return None
