"""Two one-thread drafter workers (DDP over gloo, the CPU preset's layout) against one worker with two
threads, on epochs read from a warm feature cache (no target forwards): Model Optimizer's offline loop, one
process with two threads, trained an epoch ~10% faster than ours on two cores (benchmarks/peers/whole_job.py);
this measures whether the layout is why.

    .venv/bin/python benchmarks/bench_drafter_workers.py --root /tmp/dflash-ray-peers/whole_job

The same work on both sides: SmolLM2-135M's regenerated conversations (the world whole_job.py makes, reused
when there), fp32, 16 anchors a row, tokens per optimizer step equal (two workers x one batch against one
worker x two accumulated batches), the same feature cache, warmed once first (an epoch through the target,
not timed). The layouts alternate --repeats times; prints each run's training phase, the block tokens/s and
the ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from whole_job import run_ours, world  # noqa: E402  (the world and the job as the peers' benchmark runs them)

LAYOUTS = {
    "2 workers x 1 thread": ("cluster.drafter_workers=2", "train.grad_accum=1", "cluster.cpu_threads.trainer=1"),
    "1 worker x 2 threads": ("cluster.drafter_workers=1", "train.grad_accum=2", "cluster.cpu_threads.trainer=2"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/dflash-ray-peers/whole_job")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--anchors-per-row", type=int, default=16)
    ap.add_argument("--json", help="also write the runs as JSON")
    args = ap.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    w = world(root)
    cache = Path(tempfile.mkdtemp(prefix="dflash-ray-feature-cache-"))
    common = ("train.features=hybrid", f"train.feature_cache_dir={cache}")
    runs = {name: [] for name in LAYOUTS}
    try:
        warm = run_ours(root, w, argparse.Namespace(**{**vars(args), "epochs": 1}), name="workers-warm", extra=common)
        print(f"cache warmed: {warm['seconds']:.0f} s", flush=True)
        for r in range(args.repeats):
            for name, knobs in LAYOUTS.items():
                run = run_ours(root, w, args, name=f"workers-{r}-{name.split()[0]}", extra=(*common, *knobs))
                assert run["target_tokens"] == 0, f"{name}: the target computed {run['target_tokens']} tokens"
                runs[name].append(run)
                print(f"{name}: training {run['phases']['training']:.0f} s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print("\n| layout | training s (each run) | block tokens/s (median) | steps | final loss |\n|---|---|---|---|---|")
    med = {}
    for name, rs in runs.items():
        secs = [r["phases"]["training"] for r in rs]
        rate = statistics.median(r["block_tokens"] / r["phases"]["training"] for r in rs)
        med[name] = rate
        print(f"| {name} | {', '.join(f'{s:.0f}' for s in secs)} | {rate:,.0f} | {rs[0]['steps']} "
              f"| {', '.join(format(r['final_loss'], '.4f') for r in rs)} |")
    a, b = med.values()
    print(f"\n1 worker x 2 threads / 2 workers x 1 thread: {b / a:.2f}x block tokens/s "
          f"({args.epochs} cached epoch(s), {args.repeats} runs each, alternating)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
