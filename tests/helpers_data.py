"""Small shared builders for the data tests: a locally trained tokenizer, corpora, shards."""
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray.data.shards import SCHEMA
from dflash_ray.data.synthetic import train_tokenizer, write_corpus


def make_tokenizer(root: Path) -> tuple[Path, Path]:
    corpus = write_corpus(root / "corpus.jsonl", 120, min_tokens=40, max_tokens=300, seed=1)
    return corpus, train_tokenizer(corpus, root / "tokenizer")


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_shard(path: Path, sample_ids, lengths, vocab=100, seed=0, **override) -> Path:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]
    cols = {
        "sample_id": pa.array(np.asarray(sample_ids, dtype=np.int64)),
        "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
        "loss_mask": pa.array([np.ones(n, np.int8) for n in lengths], type=pa.list_(pa.int8())),
        "num_tokens": pa.array(np.asarray(lengths, dtype=np.int32)),
    }
    cols.update(override)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)
    return path


def corrupt_column_pages(path: Path, columns) -> Path:
    """Overwrite the pages of `columns` with garbage; the footer (schema, row counts) stays intact, so only
    a read of those columns' data notices. Checked: reading them fails, reading the others does not."""
    md = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    hit = set()
    for rg in range(md.num_row_groups):
        for i in range(md.num_columns):
            c = md.row_group(rg).column(i)
            name = c.path_in_schema.split(".")[0]
            if name in columns:
                start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
                data[start:start + c.total_compressed_size] = b"\xff" * c.total_compressed_size
                hit.add(name)
    assert hit == set(columns), (hit, columns)
    path.write_bytes(bytes(data))
    pf = pq.ParquetFile(path)
    for name in pf.schema_arrow.names:
        try:
            pf.read(columns=[name])
            readable = True
        except OSError:
            readable = False
        assert readable == (name not in columns), name
    return path


def realistic_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Long-tailed chat lengths between 64 and 8192 tokens (log-normal, median ~900)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(np.log(900), 0.9, size=n)), 64, 8192).astype(np.int64)


__all__ = ["make_tokenizer", "write_jsonl", "write_shard", "corrupt_column_pages", "realistic_lengths", "SCHEMA"]
