"""Where a step's CPU time goes, grouped the same way for every side of benchmarks/peers/step_loop.py
(--profile): plain torch, importable from this project's venv and the peers' alike."""
from __future__ import annotations

import json

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


def dump(result: dict) -> str:
    return json.dumps(result)
