"""A run trained as several Ray Train fits of `train.stream_segment_blocks` stream blocks each (Ray Data's
per-stream state stays bounded on a long run) is the run trained as one: same ledger, same weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_ray.runtime.training.checkpoint_format import load_weights
from dflash_ray.runtime.record.ledger import read_jsonl


def test_a_run_in_segments_equals_the_run_in_one_stream(split_run, job_run):
    # one plan batch a block (as on a GPU), 12 blocks a segment at 2 batches a step: steps 1-6, then 7-10 of
    # the reference's 10 (which ran the default blocks of many batches: the weights must not depend on that);
    # the run's target is split over two stages too (conftest.split_run: one fit serves both checks)
    spec, s = split_run
    ref = job_run["summary"]
    assert ref["steps"] == 10 and s["steps"] == ref["steps"] and s["tokens"] == ref["tokens"]
    assert s["stream_segments"] == 2 and s["trainer_restarts"] == 0
    assert s["ledger"]["ok"] is True
    run_dir = Path(spec.run_dir)
    streams = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "streams"]
    assert len(streams) == 2
    # each segment ended with a checkpoint: the ledger's steps and the checkpoints' steps
    steps = [json.loads(line)["step"] for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))
    a, b = load_weights(Path(s["checkpoint"])), load_weights(Path(ref["checkpoint"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
