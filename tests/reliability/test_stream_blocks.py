"""Blocks of several plan batches on a small object store: the stream must not deadlock.

Ray Data budgets each operator's output memory out of the object store, and the equal split hands out a
round of blocks (one per rank) only when the whole round is there, while the trainers still hold the
previous round's: with blocks near a quarter of the target actors' budget the stream stopped for good
(seen at step 64 of the demo in the suite's shared 400 MB store, 26 MiB blocks; and in a bare Ray Data
pipeline of the same shape with 26 MB blocks in a 150 MB store, before its first row). The block budget
is therefore capped at 1/64 of the smallest node's object store (`pipeline.block_budget_mb`). Here
`cluster.stream_block_mb=64` asks for blocks far above that on a 100 MB store; the run, as a user runs
it (`python -m dflash_ray train`, its own local Ray), must cap them and finish with its ledger exact.
This tiny corpus does not deadlock even uncapped (the guard here is the cap itself)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoConfig

from helpers_cluster import REPO

STORE_BYTES = 100_000_000


@pytest.mark.slow
def test_big_blocks_asked_for_on_a_small_store_still_stream(tiny_data, tmp_path):
    from dflash_ray.config import compose_config
    from dflash_ray.data.plan import plan_from_config

    overrides = [*tiny_data, "train.epochs=3", f"cluster.object_store_memory={STORE_BYTES}",
                 "cluster.stream_block_mb=64", "train.checkpoint_every=20"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    run = subprocess.run([sys.executable, "-m", "dflash_ray", "train", f"run.root={tmp_path}", "run.name=blocks",
                          *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    s = json.loads((tmp_path / "blocks" / "summary.json").read_text())
    assert s["ledger"]["ok"] and s["epochs_finished"] == list(range(3)), s["ledger"]

    # the largest batch's bytes through the stream, from the plan and the target's shape (fp32 on the CPU)
    cfg = compose_config([f"run.root={tmp_path}", "run.name=blocks", *overrides])
    target = AutoConfig.from_pretrained(dict(a.split("=", 1) for a in tiny_data)["model.target_path"])
    per_token = target.hidden_size * len(s["model"]["target_layer_ids"]) * 4 + 4 + 1
    largest = max(int(plan_from_config(cfg, epoch=e).padded_tokens().max()) for e in range(3))
    rows = s["stream_rows_per_block"]
    assert rows >= 2                                            # the blocks still carry several batches ...
    assert rows * largest * per_token <= STORE_BYTES / 64       # ... within 1/64 of the store, not 64 MiB
    assert 64 * 2**20 // (largest * per_token) > rows           # what stream_block_mb alone would have given
