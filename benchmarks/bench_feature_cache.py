"""The feature cache's price and pay on the real model: `dflash-ray train` with train.features=online against
train.features=hybrid (a cold cache: epoch 0 computes and writes, the later epochs read), on SmolLM2-135M's
regenerated conversations (the world benchmarks/peers/whole_job.py makes, reused when there), the same
knobs as that benchmark's run of this project (fp32, 16 anchors a row, no held-out tau inside the job).

    .venv/bin/python benchmarks/bench_feature_cache.py --root /tmp/dflash-ray-peers/whole_job --epochs 2

Prints the wall time of each whole job, its training phase, the context tokens the target computed and the
tokens read back from the cache, trained tokens/s and block tokens/s (the density beside them), and the
ratios from the same run. The runs go one after the other on a quiet machine (two cores: anything beside
them changes both).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from whole_job import run_ours, world  # noqa: E402  (the world and the job as the peers' benchmark runs them)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/dflash-ray-peers/whole_job")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--anchors-per-row", type=int, default=16)
    ap.add_argument("--json", help="also write the runs as JSON")
    args = ap.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    w = world(root)
    cache = Path(tempfile.mkdtemp(prefix="dflash-ray-feature-cache-"))
    runs = {}
    try:
        for mode in ("online", "hybrid"):
            runs[mode] = run_ours(root, w, args, name=f"features-{mode}",
                                  extra=(f"train.features={mode}", f"train.feature_cache_dir={cache}"))
            print(f"{mode}: {runs[mode]['seconds']:.0f} s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"\n| train.features | wall s | training s | target-computed tokens | tokens read from the cache "
          f"| context tokens/s | block tokens/s | block tokens per token | final loss |\n|---|---|---|---|---|---|---|---|---|")
    for mode, r in runs.items():
        train_s = r["phases"].get("training", float("nan"))
        fc = r["feature_cache"] or {}
        print(f"| {mode} | {r['seconds']:,.0f} | {train_s:,.0f} | {r['target_tokens']:,} | {fc.get('read_tokens', 0):,} "
              f"| {r['context_tokens'] / train_s:,.0f} | {r['block_tokens'] / train_s:,.0f} "
              f"| {r['block_tokens'] / r['context_tokens']:.2f} | {r['final_loss']:.4f} |")
    on, hy = runs["online"], runs["hybrid"]
    print(f"\nhybrid / online: wall {hy['seconds'] / on['seconds']:.2f}, training "
          f"{hy['phases']['training'] / on['phases']['training']:.2f} ({args.epochs} epochs, "
          f"{on['context_tokens']:,} context tokens each); hybrid wrote "
          f"{(hy['feature_cache'] or {}).get('written_bytes', 0) / 2**20:,.0f} MiB of features")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
