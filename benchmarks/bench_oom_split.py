"""What a drafter step costs when its batch ran out of device memory and was trained in slices
(train.oom_split, runtime/training/step.py), against the same step whole, in one process, alternating.

The batch: rows of SmolLM2-135M's drafter shape (the `smollm2_135m` preset's: hidden 576, 2 layers, vocab
49,152, block 8, taps of 2 layers) with random features, rows x width tokens, `--anchors` a row. Each try that
runs out costs what it had done when it failed: the fault (faults.OomFault, the allocator's exception type)
fires after the forward (`--where forward`) or inside the backward (`--where backward`), at any slice of more
than `max_rows` rows, so the step does: the whole batch (fails), 2 slices (the first fails if still too big),
4, ... until the slices fit. Rows:

    whole                  the batch in one piece (no fault)
    split, fits in k       the whole batch failed, then slices: k pieces fitted (max_rows = rows / k)

Units: trained block tokens/s (anchors x block size, counted from the step's own result) and the ratio to
the whole step measured in the same round. CPU figures say what the retry costs in work (the failed
attempts, the smaller matmuls); a GPU's cost also has the allocator's and, under DDP, the lost overlap of
the gradient all-reduce, which this single process does not have.

    .venv/bin/python benchmarks/bench_oom_split.py [--rows 8 --width 256 --rounds 3 --json PATH]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dflash_ray.config import TrainConfig  # noqa: E402
from dflash_ray.model.drafter import DFlashDrafter, drafter_config  # noqa: E402
from dflash_ray.runtime.stream.rows import TrainRow, encode_features, token_row  # noqa: E402
from dflash_ray.runtime.training.faults import OomFault  # noqa: E402
from dflash_ray.runtime.training.model import LossModule, make_optimizer  # noqa: E402
from dflash_ray.runtime.training.step import train_step  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)
TAPS = [1, 27]


def make_batch(rows: int, width: int, features: int, seed: int = 0) -> TrainRow:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMOLLM2["vocab_size"] - 1, (rows, width), generator=g).numpy().astype(np.int32)
    mask = np.ones((rows, width), np.int8)
    mask[:, : width // 4] = 0
    lengths = np.full(rows, width)
    context, dtype = encode_features(torch.randn(rows, width, features, generator=g))
    scalars = dict(index=0, epoch=0, position=0, epoch_batches=1, bucket=0, num_tokens=rows * width)
    cols = token_row(scalars, 1, ids, mask, lengths)
    return TrainRow.from_batch({**cols, "context": context[None], "context_dtype": np.array([dtype])})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=32, help="anchors a row (model.num_anchors)")
    ap.add_argument("--pieces", default="2,4,8", help="the slice counts the split ends at")
    ap.add_argument("--where", default="backward", choices=["forward", "backward"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = drafter_config(SMOLLM2, 2, 8, SMOLLM2["vocab_size"] - 1, TAPS)
    embed = torch.randn(SMOLLM2["vocab_size"], SMOLLM2["hidden_size"]) * 0.02
    base = DFlashDrafter(config, embed, embed, num_anchors=args.anchors)
    row = make_batch(args.rows, args.width, len(TAPS) * SMOLLM2["hidden_size"])
    pieces = [int(p) for p in args.pieces.split(",") if int(p) <= args.rows]
    plans = [("whole", None)] + [(f"split, fits in {k}", -(-args.rows // k)) for k in pieces]

    def one(max_rows):
        drafter = copy.deepcopy(base)
        opt, sched = make_optimizer(TrainConfig(lr=1e-4), drafter, schedule_steps=10)
        fault = None if max_rows is None else OomFault({"where": args.where, "max_rows": max_rows})
        t0 = time.perf_counter()
        r = train_step(LossModule(drafter), drafter, opt, sched, [row], rank=0, workers=1, batches_per_step=1,
                       seed=0, grad_clip=1.0, device="cpu", split_on_oom=True, fault=fault)
        return time.perf_counter() - t0, r, (fault.raised if fault else 0)

    one(None)   # warm-up: first-call allocations and kernels
    times = {name: [] for name, _ in plans}
    facts = {}
    ratios = {name: [] for name, _ in plans}
    for _ in range(args.rounds):
        whole_s = None
        for name, max_rows in plans:
            seconds, r, raised = one(max_rows)
            times[name].append(seconds)
            whole_s = seconds if max_rows is None else whole_s
            ratios[name].append(seconds / whole_s)
            facts[name] = {"block_tokens": r.block_tokens, "loss": r.loss, "oom_splits": r.oom_splits,
                           "failed_tries": raised}
    print(f"\nSmolLM2-135M's drafter shape, {args.rows} rows x {args.width} tokens, {args.anchors} anchors a row, "
          f"fp32, {args.threads} thread(s); the fault {args.where}; {args.rounds} rounds, alternating\n")
    print("| step | failed tries | seconds, median (min..max) | trained block tokens/s | / whole, same round (median) | loss |")
    print("|---|---|---|---|---|---|")
    out = []
    for name, _ in plans:
        t, f = times[name], facts[name]
        med = statistics.median(t)
        print(f"| {name} | {f['failed_tries']} | {med:.3f} ({min(t):.3f}..{max(t):.3f}) | "
              f"{f['block_tokens'] / med:,.0f} | {statistics.median(ratios[name]):.2f} | {f['loss']:.6f} |")
        out.append({"step": name, "seconds": t, "ratio_to_whole": ratios[name], **f})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": out, "command": " ".join(sys.argv),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
