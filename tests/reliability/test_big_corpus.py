"""A corpus larger than the object store of the only node (the driver's) trains: the token store's blocks
spill to disk and come back on demand. The main job runs as a user runs it (`python -m dflash_ray train`,
a local Ray started by the job with `cluster.object_store_memory`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers_cluster import REPO

STORE_BYTES = 80_000_000      # the local Ray's whole object store


def _write_corpus(root, vocab: int, samples: int, files: int, seed: int = 0) -> int:
    """Random tokens (all supervised but the first); returns the tokens written."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 500, size=samples)
    per = -(-samples // files)
    total = 0
    for f in range(files):
        lens = lengths[f * per:(f + 1) * per]
        flat = rng.integers(4, vocab, size=int(lens.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        mask = np.ones(flat.size, np.int8)
        mask[offsets[:-1]] = 0
        pq.write_table(pa.table({
            "sample_id": pa.array(np.arange(f * per, f * per + lens.size, dtype=np.int64)),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            "num_tokens": pa.array(lens.astype(np.int32)),
            "num_supervised": pa.array((lens - 1).astype(np.int32)),
        }), root / f"shard-{f:03d}.parquet")
        total += int(lens.sum())
    return total


@pytest.mark.slow
def test_a_corpus_larger_than_the_object_store_trains(tiny_data, tmp_path):
    from transformers import AutoTokenizer

    given = dict(a.split("=", 1) for a in tiny_data)
    tokenizer, target = given["data.tokenizer"], given["model.target_path"]
    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    shards = tmp_path / "shards"
    shards.mkdir()
    tokens = _write_corpus(shards, vocab, samples=60_000, files=6)
    assert tokens * 5 > 1.3 * STORE_BYTES            # int32 ids + int8 mask: well over the store
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run(
        [sys.executable, "-m", "dflash_ray", "train", f"run.root={tmp_path}", "run.name=big",
         f"data.input={given['data.input']}",   # not the demo world: no held-out tau (minutes on 2 cores)
         f"data.shards={shards}", f"data.tokenizer={tokenizer}", f"model.target_path={target}",
         f"cluster.object_store_memory={STORE_BYTES}", "cluster.token_block_mb=4", "train.max_steps=6"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "big" / "summary.json").read_text())
    store = summary["token_store"]
    assert store["samples"] == 60_000 and store["tokens"] == tokens
    assert store["bytes"] > STORE_BYTES and store["blocks"] >= store["bytes"] / (6 * 2**20)
    assert summary["steps"] == 6 and summary["ledger"]["ok"] is True
    assert np.isfinite(summary["final_loss"])
