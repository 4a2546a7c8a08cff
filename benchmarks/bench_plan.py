"""Planner benchmark: cost against numpy.argsort, near-linear growth, padding efficiency, order quality.

    .venv/bin/python benchmarks/bench_plan.py [--samples 10000000] [--check]

Times are the best of --repeats runs, measured in this process next to a numpy.argsort of the same
number of float64 keys, so the ratios hold on a shared, noisy machine.

The goals table is printed last, each goal PASS, FAIL or n/a: build_plan <= 5x numpy.argsort (README; set for
10M samples, n/a below: at small sizes fixed costs dominate), padding efficiency >= 0.95 (the bar of
tests/test_data_plan.py) and the default order's seed-run targets (tests/test_data_interleave.py). With
--check the exit code is 1 when any goal fails.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dflash_ray.data.interleave import STRATEGIES, interleave_order, order_measures
from dflash_ray.data.plan import PlanSpec, build_plan

SEED_RUN = [2120, 4019, 5468, 7477, 8038, 19581]
SEED_BOUNDS = [512, 1024, 1536, 2304, 3296, 8192]
GOAL_SAMPLES = 10_000_000  # the argsort goal is set for 10M samples


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def print_goals(goals: list[tuple[str, str, str, bool | None, str]]) -> int:
    """goals: (what, measured, goal, ok or None when it does not apply, note). Returns the FAIL count."""
    print("\n== goals ==")
    print(f"{'goal':<58} {'measured':>10} {'target':>8}  result")
    for what, value, goal, ok, note in goals:
        print(f"{what:<58} {value:>10} {goal:>8}  {verdict(ok)}{'  (' + note + ')' if note else ''}")
    failed = sum(ok is False for *_, ok, _ in goals)
    applied = sum(ok is not None for *_, ok, _ in goals)
    print(f"{applied - failed} of {applied} applicable goals met" + (f", {failed} FAILED" if failed else ""))
    return failed


def realistic_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Long-tailed chat lengths, 64 to 8192 tokens (log-normal, median ~900)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(np.log(900), 0.9, size=n)), 64, 8192).astype(np.int64)


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="exit 1 when any goal fails")
    args = ap.parse_args()
    plan_spec = PlanSpec(SEED_BOUNDS, 16384, min_tokens=32)
    big, small = args.samples, args.samples // 10

    rows = []
    keys = np.random.default_rng(1).random(big)
    t_sort = best_of(lambda: np.argsort(keys), args.repeats)
    small_keys = keys[:small].copy()
    t_sort_small = best_of(lambda: np.argsort(small_keys), args.repeats)
    times = {}
    for n in (small, big):
        lengths, ids = realistic_lengths(n), np.arange(n)
        times[n] = best_of(lambda: build_plan(ids, lengths, plan_spec, seed=0, epoch=0), args.repeats)
    plan = build_plan(np.arange(big), realistic_lengths(big), plan_spec, seed=0)
    s = plan.summary()

    print("\n== planning cost (best of %d) ==" % args.repeats)
    print(f"{'what':<44} {'seconds':>8} {'ratio':>8}")
    print(f"{'numpy.argsort of %d float64 keys' % big:<44} {t_sort:>8.2f} {1.0:>8.2f}")
    ratio = times[big] / t_sort
    ratio_ok = ratio <= 5 if big >= GOAL_SAMPLES else None
    print(f"{'build_plan, %d samples' % big:<44} {times[big]:>8.2f} {ratio:>8.2f}  (goal <= 5: {verdict(ratio_ok)})")
    print(f"{'build_plan, %d samples' % small:<44} {times[small]:>8.2f} {times[small] / t_sort:>8.2f}")
    print(f"growth {small} -> {big} samples: build_plan x{times[big] / times[small]:.1f}, "
          f"numpy.argsort x{t_sort / t_sort_small:.1f} (linear = x10)")

    print("\n== padding efficiency, %d realistic samples, budget 16384 tokens ==" % big)
    rng = np.random.default_rng(0)
    lens = np.minimum(realistic_lengths(big), 8192)
    print(f"{'batching':<52} {'efficiency':>10}")
    print(f"{'dflash-ray buckets + token budget (default)':<52} {s['padding_efficiency']:>10.4f}")
    for bs in (4, 8, 16):
        fixed = rng.permutation(lens)[: lens.size // bs * bs].reshape(-1, bs)
        eff = fixed.sum() / (fixed.max(1).sum() * bs)
        print(f"{'fixed %d per batch, shuffled, padded to longest' % bs:<52} {eff:>10.4f}")

    print("\n== interleaving %d batches (seed-run proportions) ==" % big)
    props = np.array(SEED_RUN) / sum(SEED_RUN)
    counts = np.floor(props * big).astype(np.int64)
    print(f"{'strategy':<12} {'seconds':>8}")
    for name in STRATEGIES:
        print(f"{name:<12} {best_of(lambda: interleave_order(counts, strategy=name), 1):>8.2f}")

    print("\n== order measures on the seed run's epoch (batch counts %s) ==" % ",".join(map(str, SEED_RUN)))
    print(f"{'strategy':<11} {'quarter dev pp':>14} {'prefix disc':>11} {'longest run':>11} {'runs of 1':>9} {'first bucket end':>16}")
    for name in STRATEGIES:
        m = order_measures(interleave_order(SEED_RUN, strategy=name, seed=0), 6)
        rows.append((name, m))
        print(f"{name:<11} {m['quarter_max_dev_pp']:>14.3f} {m['prefix_discrepancy']:>11.2f} {m['longest_run']:>11} "
              f"{100 * m['fraction_in_runs_of_1']:>8.1f}% {m['earliest_bucket_end']:>16.4f}")

    d = dict(rows)["default"]
    failed = print_goals([
        ("build_plan / numpy.argsort, %d samples" % big, f"{ratio:.2f}", "<= 5", ratio_ok,
         "" if big >= GOAL_SAMPLES else f"goal set for >= {GOAL_SAMPLES:,} samples"),
        ("padding efficiency, %d samples" % big, f"{s['padding_efficiency']:.4f}", ">= 0.95",
         s["padding_efficiency"] >= 0.95, ""),
        ("default order, seed run: max quarter deviation (pp)", f"{d['quarter_max_dev_pp']:.3f}", "<= 0.1",
         d["quarter_max_dev_pp"] <= 0.1, ""),
        ("default order, seed run: prefix discrepancy (batches)", f"{d['prefix_discrepancy']:.2f}", "<= 2",
         d["prefix_discrepancy"] <= 2, ""),
        ("default order, seed run: longest run", str(d["longest_run"]), f"== {d['least_possible_longest_run']}",
         d["longest_run"] == d["least_possible_longest_run"], "least possible"),
        ("default order, seed run: first bucket to run out", f"{d['earliest_bucket_end']:.4f}", ">= 0.999",
         d["earliest_bucket_end"] >= 0.999, "fraction of the epoch"),
    ])
    if args.check and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
