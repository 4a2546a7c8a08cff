"""What every side of benchmarks/peers/step_loop.py shares: a peer script's arguments, the timed loop over a
work file's batches, and where a step's CPU time goes (--profile), grouped the same way for every side.
Plain torch: importable from this project's venv and the peers' alike."""
from __future__ import annotations

import argparse
import time

# op name fragments -> the part of a DFlash step they belong to (first match wins)
PARTS = [
    ("cross-entropy over the vocabulary", ("log_softmax", "nll_loss", "cross_entropy", "logsumexp",
                                           "chunkedheadce", "argmax")),
    ("attention", ("attention", "sdpa", "softmax", "baddbmm", "bmm", "flex", "masked_fill", "where")),
    ("matmuls (linear layers and the LM head)", ("addmm", "aten::mm", "matmul", "linear")),
    ("optimizer", ("adam", "_foreach", "lerp", "addcdiv", "sqrt", "norm")),
    ("copies and casts", ("copy_", "to_copy", "clone", "contiguous", "cat", "index", "gather", "scatter")),
]


def profile_steps(step, n: int) -> dict:
    """Run `step()` n times under torch.profiler; seconds of self CPU time by part of the step."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    parts: dict[str, float] = {}
    ops: dict[str, float] = {}
    for e in prof.key_averages():
        sec = e.self_cpu_time_total / 1e6 / n
        name = e.key.lower()
        part = next((p for p, frags in PARTS if any(f in name for f in frags)), "other")
        parts[part] = parts.get(part, 0.0) + sec
        ops[e.key] = sec
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12])
    return {"seconds_per_step": sum(parts.values()), "by_part": parts, "top_ops": top}


def peer_args():
    """A peer script's arguments: the work file, timed steps, warm-up steps, steps to profile after."""
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--profile", type=int, default=0, help="then profile this many more steps")
    return ap.parse_args()


def time_steps(trainer: str, one, anchors, work: dict, args, **extra) -> dict:
    """`one(step)` (one optimizer step on batch `step`, returning its loss) over warm-up + timed batches;
    `anchors(rows)`: the anchors the peer trains on those rows by its own rule. What step_loop.py reads."""
    rows, ids = work["shape"]["rows"], work["input_ids"]
    losses, blocks, elapsed = [], 0, 0.0
    for step in range(args.steps + args.warmup):
        t0 = time.perf_counter()
        loss = one(step)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            elapsed += dt
            blocks += anchors(slice(step * rows, (step + 1) * rows))
            losses.append(float(loss))
    return {"trainer": trainer, "steps": args.steps, "seconds": elapsed,
            "block_tokens": blocks * work["shape"]["block"], "context_tokens": int(args.steps * rows * ids.shape[1]),
            "losses": losses, **extra,
            "profile": profile_steps(lambda: one(0), args.profile) if args.profile else None}
