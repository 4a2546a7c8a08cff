"""The token store: every sample's input_ids and loss_mask, looked up by sample_id in the join stage.

Ray Data reads the shards (`read_parquet`, validated block by block) into blocks of about
`cluster.token_block_mb` each, materialised in the cluster's object stores: spread over the nodes that ran
the read tasks, spilled to disk by Ray when they exceed the stores (the corpus never has to fit one node's
memory, let alone the driver's). The driver keeps only the index — sample_id -> (block, row), 16 bytes a
sample — and the blocks' ObjectRefs (it owns them, so Ray reconstructs a block lost with its node from
lineage by re-running its read task).

A join task fetches the blocks its batch needs (`ray.get`: zero-copy from the local store, a copy from a
remote node or a restore from spill otherwise) and keeps the most recent ones, up to
`cluster.token_cache_mb`, in a per-process LRU: a batch's samples come from one length bucket, spread
over the corpus, so a block is worth keeping while the process is alive. The transfer unit is the
block: smaller blocks move fewer unneeded bytes per batch, larger blocks mean fewer objects.

A corpus that makes a single block (at most `block_mb`, by its token count) is read by the driver itself
with pyarrow, validated by the same function, and put as that one block: Ray Data's start-up (3-5 s on
this 2-core machine, ~20 s on a two-node cluster) would buy nothing for one block.

`TokenStore.from_table` builds the same store in memory from one table (benchmarks, tests, a single process).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dflash_ray.config import ClusterConfig
from dflash_ray.errors import UserError

TOKEN_COLUMNS = ("sample_id", "input_ids", "loss_mask")
_STORE_SCHEMA = pa.schema([("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                           ("loss_mask", pa.list_(pa.int8()))])


@dataclass
class StoreInfo:
    """What the run reports about its store (summary.json["token_store"])."""
    samples: int
    tokens: int
    blocks: int
    bytes: int
    seconds: float

    def as_dict(self) -> dict:
        return {"samples": self.samples, "tokens": self.tokens, "blocks": self.blocks, "bytes": self.bytes,
                "mib": round(self.bytes / 2**20, 1), "seconds": round(self.seconds, 2)}


class _Block:
    """One block's columns as flat numpy views (zero-copy of the Arrow buffers)."""

    def __init__(self, table: pa.Table):
        ids = table.column("input_ids").combine_chunks()
        mask = table.column("loss_mask").combine_chunks()
        offsets = ids.offsets.to_numpy().astype(np.int64)
        self.offsets = offsets - offsets[0]
        self.tokens = ids.values.to_numpy()[offsets[0]:]
        mask_offsets = mask.offsets.to_numpy()
        self.mask = mask.values.to_numpy()[mask_offsets[0]:]
        self.nbytes = self.tokens.nbytes + self.mask.nbytes + self.offsets.nbytes
        self._table = table   # keeps the object-store buffers (and so these views) alive

    def row(self, r: int, n: int):
        a = self.offsets[r]
        return self.tokens[a:a + n], self.mask[a:a + n]


class _BlockCache:
    """The most recently used blocks of this process, up to `limit` bytes (at least one block)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.blocks: OrderedDict = OrderedDict()
        self.bytes = 0
        self.fetches = 0

    def get(self, key, load):
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return self.blocks[key]
        block = _Block(load())
        self.fetches += 1
        self.blocks[key] = block
        self.bytes += block.nbytes
        while self.bytes > self.limit and len(self.blocks) > 1:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old.nbytes
        return block


_CACHES: dict = {}   # per process: one LRU of blocks per store (keyed by the store's id)


class TokenStore:
    """sample_id -> (block, row) over blocks that are ObjectRefs (a Ray run) or tables (in memory)."""

    def __init__(self, ids, block_of, row_of, blocks: list, key: str = "local", cache_bytes: int = 256 << 20):
        self.ids, self.block_of, self.row_of = ids, block_of, row_of
        self.blocks, self.key = blocks, key
        if key not in _CACHES:
            if len(_CACHES) > 4:   # stores of earlier runs in a long-lived process
                _CACHES.clear()
            _CACHES[key] = _BlockCache(cache_bytes)
        self.cache = _CACHES[key]

    @classmethod
    def from_table(cls, table: pa.Table, rows_per_block: int | None = None) -> "TokenStore":
        table = table.select(list(TOKEN_COLUMNS)).cast(_STORE_SCHEMA)
        step = rows_per_block or max(table.num_rows, 1)
        blocks = [table.slice(a, step) for a in range(0, table.num_rows, step)]
        return cls(*_index([b.column("sample_id").to_numpy() for b in blocks]), blocks,
                   key=f"local-{id(table)}", cache_bytes=1 << 62)

    def _load(self, b: int):
        block = self.blocks[b]
        if isinstance(block, pa.Table):
            return lambda: block
        import ray

        return lambda: ray.get(block)

    def batch(self, sample_ids, lengths, pad_id: int):
        """Right-padded (ids int32, mask int8) of the samples, each cut to its length."""
        sample_ids = np.asarray(sample_ids, np.int64)
        at = np.searchsorted(self.ids, sample_ids)
        found = (at < self.ids.size) & (self.ids[np.minimum(at, self.ids.size - 1)] == sample_ids)
        if not found.all():
            raise KeyError(f"sample ids not in the shards: {sample_ids[~found][:5].tolist()}")
        width = int(max(lengths))
        ids = np.full((len(at), width), pad_id, np.int32)
        mask = np.zeros((len(at), width), np.int8)
        for i, (j, n) in enumerate(zip(at, lengths)):
            b = int(self.block_of[j])
            block = self.cache.get((b,), self._load(b))
            t, m = block.row(int(self.row_of[j]), int(n))
            ids[i, :t.size], mask[i, :m.size] = t, m
        return ids, mask


def _index(block_ids: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted sample ids with the block and row of each."""
    ids = np.concatenate(block_ids).astype(np.int64) if block_ids else np.zeros(0, np.int64)
    block_of = np.concatenate([np.full(len(x), b, np.int32) for b, x in enumerate(block_ids)]) if block_ids \
        else np.zeros(0, np.int32)
    row_of = np.concatenate([np.arange(len(x), dtype=np.int32) for x in block_ids]) if block_ids \
        else np.zeros(0, np.int32)
    order = np.argsort(ids, kind="stable")
    return ids[order], block_of[order], row_of[order]


# ----------------------------------------------------------------------------- built by Ray Data
def _store_block(batch: pa.Table, vocab_size: int | None, names: dict) -> pa.Table:
    """A read block, validated (errors name the shard and the sample_id), cut to the store's columns."""
    from dflash_ray.data.shards import SCHEMA, SUPERVISED, validate_tokens

    paths = batch.column("path").to_numpy(zero_copy_only=False)
    for path in np.unique(paths):
        part = batch.filter(pa.array(paths == path))
        name = names.get(str(path), str(path))
        sample_ids = part.column("sample_id").to_numpy(zero_copy_only=False)
        for col in ("input_ids", "loss_mask"):
            nulls = part.column(col).is_null().to_numpy(zero_copy_only=False)
            if nulls.any():
                raise UserError(f"{name}: sample_id {sample_ids[np.flatnonzero(nulls)[0]]}: null {col}")
        cols = [c for c in list(SCHEMA.names) + [SUPERVISED] if c in part.column_names]
        validate_tokens(name, part.select(cols), vocab_size, row_names=sample_ids)
    return batch.select(list(TOKEN_COLUMNS)).cast(_STORE_SCHEMA)


def _ids_and_tokens(block: pa.Table) -> tuple[np.ndarray, int]:
    return block.column("sample_id").to_numpy(), sum(len(c.values) for c in block.column("input_ids").chunks)


def _read_one_block(files, columns: list, vocab_size: int | None, names: dict) -> pa.Table:
    """Every shard read here and validated by `_store_block`, as the Ray Data path does, in one table."""
    import pyarrow.parquet as pq

    parts = []
    for f in files:
        with f.fs.open_input_file(f.path) as fh:
            table = pq.read_table(fh, columns=columns)
        table = table.append_column("path", pa.array([f.path] * table.num_rows, pa.string()))
        parts.append(_store_block(table, vocab_size, names))
    return pa.concat_tables(parts).combine_chunks()


def build_token_store(shards: str, vocab_size: int | None, block_mb: float = ClusterConfig.token_block_mb,
                      cache_mb: float = ClusterConfig.token_cache_mb,
                      ray_data: bool | None = None) -> tuple[dict, StoreInfo]:
    """Ray Data reads and validates every shard into object-store blocks; returns what the join needs
    (the index and the block refs, to be put in the object store by the caller) and the store's size.
    ray_data: None decides by size (a corpus of one block is read here), True / False force either path."""
    import time

    import ray
    from ray.data import DataContext

    import pyarrow.parquet as pq

    from dflash_ray.data.shards import SCHEMA, SUPERVISED, list_shards, read_lengths

    t0 = time.perf_counter()
    files = list_shards(shards)
    with files[0].fs.open_input_file(files[0].path) as f:
        schema = pq.read_schema(f)
    columns = list(SCHEMA.names) + ([SUPERVISED] if SUPERVISED in schema.names else [])
    lengths = read_lengths(shards)
    # rows per block from the mean row's bytes (int32 id + int8 mask per token, + offsets and sample_id)
    row_bytes = 5 * float(lengths.num_tokens.mean()) + 16
    rows_per_block = max(1, int(block_mb * 2**20 / row_bytes))
    names = {f.path: str(f) for f in files}
    if ray_data is False or (ray_data is None and len(lengths.num_tokens) <= rows_per_block):
        block = _read_one_block(files, columns, vocab_size, names)
        ids, tokens = _ids_and_tokens(block)
        ids, block_of, row_of = _index([ids])
        info = StoreInfo(samples=int(ids.size), tokens=tokens, blocks=1, bytes=int(block.nbytes),
                         seconds=time.perf_counter() - t0)
        refs = [ray.put(block)]
        return _handle(ids, block_of, row_of, refs, cache_mb), info
    ctx = DataContext.get_current()
    saved = ctx.enable_progress_bars, ctx.raise_original_map_exception
    ctx.enable_progress_bars = False
    ctx.raise_original_map_exception = True   # a bad shard's UserError, not Ray Data's wrapper
    try:
        ds = ray.data.read_parquet([f.path for f in files], filesystem=files[0].fs, include_paths=True, shuffle=None)
        ds = (ds.select_columns(columns + ["path"])
              .map_batches(_store_block, batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                           fn_kwargs={"vocab_size": vocab_size, "names": names})
              # strict: blocks of rows_per_block across shards (not strict, Ray 2.59 kept a short block per shard)
              .repartition(target_num_rows_per_block=rows_per_block, strict=True)
              .materialize())
    except Exception as e:
        user = _user_error(e)
        if user is not None:
            raise user from None
        raise
    finally:
        ctx.enable_progress_bars, ctx.raise_original_map_exception = saved
    refs = ds.to_arrow_refs()
    ids_task = ray.remote(_ids_and_tokens).options(num_cpus=0.25)   # runs where each block lives
    per_block = ray.get([ids_task.remote(r) for r in refs])
    ids, block_of, row_of = _index([ids for ids, _ in per_block])
    info = StoreInfo(samples=int(ids.size), tokens=int(sum(n for _, n in per_block)), blocks=len(refs),
                     bytes=int(ds.size_bytes()), seconds=time.perf_counter() - t0)
    return _handle(ids, block_of, row_of, refs, cache_mb), info


def _handle(ids, block_of, row_of, refs: list, cache_mb: float) -> dict:
    import ray

    return {"ids": ids, "block_of": block_of, "row_of": row_of, "blocks": refs,
            "key": f"store-{ray.get_runtime_context().get_job_id()}-{id(refs)}", "cache_bytes": int(cache_mb * 2**20)}


def _user_error(e: BaseException) -> UserError | None:
    """The UserError a Ray Data task raised (a bad shard), out of Ray's wrappers."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)   # RayTaskError: the task's own exception
        if isinstance(cause, BaseException) and cause is not e:
            e = cause
        elif isinstance(e, UserError):
            return UserError(str(e).splitlines()[0])   # Ray Data appends its retry advice
        else:
            e = e.__cause__ or e.__context__
    return None
