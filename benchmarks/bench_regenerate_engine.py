"""Regeneration's two engines on the real model, same conversations, same process, alternating: `batched`
(generate() over batches of like-length prompts, each running to its longest row, a greedy loop ending a row
early) against `continuous` (transformers' continuous batching: batch_size rows in flight, a finished row's slot
taken by the next prompt at once). Prints conversations/s and useful tokens/s for each, and whether the two
engines regenerated the same conversations token for token.

    .venv/bin/python benchmarks/bench_regenerate_engine.py --conversations 128 --repeats 1   # ~10 min on 2 cores

The conversations are the smol_prompts world's (its corpus.jsonl: two-turn instructions), the target
SmolLM2-135M-Instruct as the `smollm2_135m` preset gives it, in the dtype the preset picks on this processor.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="conversations .jsonl (e.g. <run dir>/corpus.jsonl of the world)")
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=0, help="rows in flight (0: the preset's regenerate.batch_size)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    import torch

    from dflash_ray.config import compose_config
    from dflash_ray.data.prepare import template_kwargs
    from dflash_ray.data.supervision import Rendering
    from dflash_ray.model.generation import Regenerator
    from dflash_ray.paths import resolve_model_paths
    from dflash_ray.config import compute_dtype
    from dflash_ray.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    cfg = compose_config(["model=smollm2_135m", "data=smol_prompts", "run.root=/tmp/dflash-ray-bench-regen"])
    resolve_model_paths(cfg)
    rows = [json.loads(line) for line in Path(args.corpus).read_text().splitlines()[: args.conversations]]
    convs = [r["conversations"] for r in rows]
    dtype = compute_dtype(cfg)
    rendering = Rendering(load_tokenizer(str(cfg.data.tokenizer or cfg.model.target_path)), template_kwargs(cfg))
    batch = args.batch_size or cfg.regenerate.batch_size
    engines = {name: Regenerator(str(cfg.model.target_path), rendering, max_new_tokens=cfg.regenerate.max_new_tokens,
                                 batch_size=batch, on_max_tokens=cfg.regenerate.on_max_tokens,
                                 dtype=getattr(torch, dtype) if dtype else None, engine=name)
               for name in ("batched", "continuous")}
    runs = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.repeats):
        for name, regen in engines.items():
            t0 = time.perf_counter()
            out, counts = regen(convs)
            seconds = time.perf_counter() - t0
            runs[name].append({"seconds": seconds, "generated_tokens": counts["generated tokens"],
                               "regenerated_turns": counts["regenerated turns"],
                               "dropped_loops": counts["turns dropped: a greedy loop"],
                               "kept_conversations": sum(c is not None for c in out)})
            outputs[name] = out
            print(f"{name:>10}: {seconds:.1f} s, {counts['generated tokens']} tokens, "
                  f"{counts['regenerated turns']} turns", flush=True)
    same = sum(a == b for a, b in zip(outputs["batched"], outputs["continuous"]))
    print(f"\n{len(convs)} conversations (2 turns each), {batch} rows in flight, dtype {dtype or 'float32'}, "
          f"{args.threads} threads\n")
    print("| engine | seconds (median) | conversations/s | useful tokens/s | turns kept | greedy loops dropped |")
    print("|---|---|---|---|---|---|")
    med = {}
    for name, rs in runs.items():
        s = statistics.median(r["seconds"] for r in rs)
        med[name] = s
        r = rs[-1]
        print(f"| {name} | {s:.1f} | {len(convs) / s:.2f} | {r['generated_tokens'] / s:.0f} | {r['regenerated_turns']} | "
              f"{r['dropped_loops']} |")
    print(f"\ncontinuous / batched time: {med['continuous'] / med['batched']:.2f}; conversations regenerated the "
          f"same by both: {same}/{len(convs)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "dtype": dtype, "batch_size": batch, "runs": runs,
                                               "same_conversations": same}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
