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


class BlockCounter:
    """The anchor blocks a peer trains, counted from its own sampler's output: wraps `_sample_anchor_positions`
    (SpecForge's OnlineDFlashModel and Model Optimizer's DFlash model both name it so and return (anchor
    positions, keep mask)) on an object or a class, and sums the keep mask of every call."""

    def __init__(self, owner):
        self.total, self.taken = 0, 0
        original = owner._sample_anchor_positions
        is_class = isinstance(owner, type)

        def counted(*args, **kwargs):
            anchors, keep = original(*args, **kwargs)
            self.total += int(keep.sum())
            return anchors, keep

        if is_class:   # the method unbound: `self` comes first in args
            def counted_method(model, *args, **kwargs):
                anchors, keep = original(model, *args, **kwargs)
                self.total += int(keep.sum())
                return anchors, keep
            owner._sample_anchor_positions = counted_method
        else:
            owner._sample_anchor_positions = counted

    def take(self, *_) -> int:
        """Blocks counted since the last take (a timed loop's `anchors` callable)."""
        n, self.taken = self.total - self.taken, self.total
        return n


def peer_args():
    """A peer script's arguments: the work file, timed steps, warm-up steps, steps to profile after."""
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--profile", type=int, default=0, help="then profile this many more steps")
    ap.add_argument("--objective-chunk-blocks", type=int, default=128,
                    help="SpecForge's training.objective_chunk_blocks (its default 128: the LM head's logits "
                         "recomputed in backward, chunk by chunk; 0: computed once, kept)")
    return ap.parse_args()


def time_steps(trainer: str, one, anchors, work: dict, args, **extra) -> dict:
    """`one(step)` (one optimizer step on batch `step`, returning its loss) over warm-up + timed batches;
    `anchors(rows)`: the anchor blocks the peer trained in that step (BlockCounter.take: counted from its
    sampler's output). What step_loop.py reads."""
    rows, ids = work["shape"]["rows"], work["input_ids"]
    losses, blocks, elapsed = [], 0, 0.0
    for step in range(args.steps + args.warmup):
        t0 = time.perf_counter()
        loss = one(step)
        dt = time.perf_counter() - t0
        trained = anchors(slice(step * rows, (step + 1) * rows))   # every step's: a counter is read each step
        if step >= args.warmup:
            elapsed += dt
            blocks += trained
            losses.append(float(loss))
    return {"trainer": trainer, "steps": args.steps, "seconds": elapsed,
            "block_tokens": blocks * work["shape"]["block"], "context_tokens": int(args.steps * rows * ids.shape[1]),
            "losses": losses, **extra,
            "profile": profile_steps(lambda: one(0), args.profile) if args.profile else None}
