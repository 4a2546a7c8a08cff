"""Target work per batch by length bucket: the planner's attention-weighted budget against the token budget.

    .venv/bin/python benchmarks/bench_target_balance.py [--check] [--json] [--repeats 3]

The CPU default's data (the embedded default's synthetic corpus and buckets, prepared under a temporary run
directory) is planned twice: with the attention term (`data.attention_tokens` from the target's shape, the
default) and with the token budget only (`data.attention_tokens=0`). Every batch of each plan runs through
the target actor's own forward (`target_forward.target_context` on `load_feature_extractor`, the tiny default
target's shape, random weights, one thread as an actor has); a batch's time is the median of --repeats
runs. The table shows the mean busy time per batch by bucket, relative to the plan's mean batch, next to
the planner's predicted `target cost`.

Goal: busy time per batch max/min over buckets <= 1.5 with the default planner (`--check` exits
1 otherwise). The token-budget-only plan is the comparison: the same tokens cost more in long rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

GOAL = 1.5


def measure(plan, extract, repeats: int, rng) -> dict:
    from dflash_ray.runtime.stream.target_forward import target_context

    vocab = int(extract.config.vocab_size)
    busy = np.zeros(plan.num_batches)
    for k in range(plan.num_batches):
        lengths = plan.lengths[plan.offsets[k]:plan.offsets[k + 1]]
        ids = rng.integers(0, vocab, size=(lengths.size, int(plan.max_len[k])))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            target_context(extract, ids, lengths, "cpu")
            times.append(time.perf_counter() - t0)
        busy[k] = statistics.median(times)
    rows = []
    cost = plan.target_cost() if plan.plan_spec.attention_tokens else None
    for b in range(len(plan.plan_spec.boundaries)):
        sel = plan.bucket == b
        if sel.any():
            rows.append({"bucket": b, "batches": int(sel.sum()), "rows": float(np.diff(plan.offsets)[sel].mean()),
                         "mean_busy_ms": 1000 * float(busy[sel].mean()),
                         "busy_relative": float(busy[sel].mean() / busy.mean()),
                         "predicted_relative": float(cost[sel].mean() / cost.mean()) if cost is not None else None})
    means = [r["mean_busy_ms"] for r in rows]
    return {"attention_tokens": plan.plan_spec.attention_tokens, "batches": plan.num_batches,
            "buckets": rows, "max_over_min": max(means) / min(means), "total_busy_s": float(busy.sum())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the default plan misses the goal")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import ensure_data
    from dflash_ray.data.plan import plan_from_config
    from dflash_ray.model.target import build_synthetic_target, default_target_layer_ids, load_feature_extractor

    torch.set_num_threads(1)  # a target actor on the CPU default runs one thread
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"run.root={tmp}", "data.synthetic.regenerate=false"]
        cfg = compose_config(base)
        ensure_data(cfg, log=lambda *a: None)
        target_cfg = dict(cfg.model.target_config)
        target = build_synthetic_target(target_cfg, 512, os.path.join(tmp, "target"))
        layers = default_target_layer_ids(int(target_cfg["num_hidden_layers"]), int(cfg.model.num_draft_layers))
        extract = load_feature_extractor(target, layers, device="cpu")
        for name, extra in (("attention-weighted (default)", []), ("token budget only", ["data.attention_tokens=0"])):
            cfg = compose_config(base + extra)
            results[name] = measure(plan_from_config(cfg), extract, args.repeats, np.random.default_rng(0))
    default = results["attention-weighted (default)"]
    passed = default["max_over_min"] <= GOAL
    if args.json:
        print(json.dumps({"results": results, "goal": GOAL, "pass": passed}, indent=2))
    else:
        for name, r in results.items():
            la = f"La = {r['attention_tokens']:,.0f}" if r["attention_tokens"] else "no attention term"
            print(f"{name} ({la}): {r['batches']} batches, {r['total_busy_s']:.2f} s of target work")
            print(f"  {'bucket':>6} {'batches':>7} {'rows':>5} {'busy ms/batch':>13} {'relative':>8} {'predicted':>9}")
            for b in r["buckets"]:
                pred = "-" if b["predicted_relative"] is None else f"{b['predicted_relative']:.2f}"
                print(f"  {b['bucket']:>6} {b['batches']:>7} {b['rows']:>5.1f} {b['mean_busy_ms']:>13.2f} "
                      f"{b['busy_relative']:>8.2f} {pred:>9}")
            print(f"  busy time per batch, max/min over buckets: {r['max_over_min']:.2f}")
        print(f"goal: max/min <= {GOAL} with the default planner: {'PASS' if passed else 'FAIL'} "
              f"({default['max_over_min']:.2f}; token budget only: {results['token budget only']['max_over_min']:.2f})")
    return 1 if (args.check and not passed) else 0


if __name__ == "__main__":
    sys.exit(main())
