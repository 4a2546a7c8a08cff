"""`prepare` single-process vs as a Ray Data job, on the same generated conversations.

    .venv/bin/python benchmarks/bench_prepare.py [--conversations 20000] [--json]

The embedded default's corpus generator writes N conversations (48-512 tokens) and trains its tokenizer;
each path prepares them into shards; the table gives conversations/s of each and their ratio, measured in
the same run (the Ray path includes Ray Data's start-up and the pool's tokenizer loads, not Ray's own
start). Both paths must write the same samples (checked). On a cluster the Ray path scales with the
actors it gets; on a 2-core machine it has little to scale with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--rows-per-task", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import ray

    from dflash_ray.data.prepare import prepare
    from dflash_ray.data.shards import read_lengths
    from dflash_ray.data.synthetic import train_tokenizer, write_corpus
    from dflash_ray.runtime.jobs.prepare_on_ray import prepare_on_ray

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = write_corpus(root / "corpus.jsonl", args.conversations, min_tokens=48, max_tokens=512, seed=3)
        tok = train_tokenizer(corpus, root / "tok")
        opts = dict(min_supervised=16, shard_size=10000)
        t0 = time.perf_counter()
        local = prepare(str(corpus), str(tok), str(root / "local"), progress=False, **opts)
        t_local = time.perf_counter() - t0
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
        try:
            t0 = time.perf_counter()
            on_ray = prepare_on_ray(str(corpus), str(tok), str(root / "ray"), rows_per_task=args.rows_per_task, **opts)
            t_ray = time.perf_counter() - t0
        finally:
            ray.shutdown()
        a, b = read_lengths(root / "local"), read_lengths(root / "ray")
        same = sorted(zip(a.sample_ids, a.num_tokens)) == sorted(zip(b.sample_ids, b.num_tokens))
    n = args.conversations
    result = {"conversations": n, "cpus": os.cpu_count(), "samples": local.samples, "same_samples": same,
              "local_seconds": t_local, "ray_seconds": t_ray, "local_per_s": n / t_local, "ray_per_s": n / t_ray,
              "ray_over_local": t_local / t_ray, "ray_samples": on_ray.samples}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{n:,} conversations, {local.samples:,} samples, {os.cpu_count()} CPUs; same samples on both paths: "
              f"{'yes' if same else 'NO'}")
        print(f"{'path':>16} {'seconds':>8} {'conversations/s':>16}")
        print(f"{'single process':>16} {t_local:>8.1f} {n / t_local:>16,.0f}")
        print(f"{'Ray Data job':>16} {t_ray:>8.1f} {n / t_ray:>16,.0f}")
        print(f"Ray / single-process throughput: {t_local / t_ray:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
