"""Regeneration's speed on the real model, with and without stopping greedy loops early: the same conversations
through the same Regenerator (model/generation.py, no Ray: what one regeneration actor runs), SmolLM2-135M-
Instruct, the smol_prompts preset's cap (160 new tokens) and batches, on_max_tokens=drop.

    .venv/bin/python benchmarks/bench_regenerate.py --input /tmp/dflash-ray-peers/whole_job/world/corpus.jsonl \
        --conversations 96 --dtype float32

--input: a conversations file (the smol_prompts world's corpus.jsonl: benchmarks/peers/whole_job.py makes one,
or `dflash-ray train model=smollm2_135m data=smol_prompts` in its run directory). The two settings alternate
(off, on, off, on, ...: a noisy neighbour hits both) and the table gives, per setting, the median wall
seconds, the tokens generated, the tokens of the turns kept (what training gets) and kept tokens per second,
turns kept and dropped by reason, and the ratio of the medians. Both settings keep exactly the same turns
except those that loop: a kept turn is the greedy answer in both (tests/test_regenerate.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True)
    ap.add_argument("--conversations", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every usable core)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch

    from dflash_ray.config import compose_config
    from dflash_ray.data.prepare import template_kwargs
    from dflash_ray.data.supervision import Rendering
    from dflash_ray.model.generation import LOOP_MAX_PERIOD, Regenerator
    from dflash_ray.paths import resolve_model_paths
    from dflash_ray.runtime.jobs.regenerate import read_conversations
    from dflash_ray.threads import usable_cores
    from dflash_ray.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads or usable_cores())
    cfg = compose_config(["model=smollm2_135m", "data=smol_prompts"])
    resolve_model_paths(cfg, log=lambda *a, **k: None)
    rows, _ = read_conversations(args.input)
    rows = rows[: args.conversations]
    rendering = Rendering(load_tokenizer(str(cfg.data.tokenizer or cfg.model.target_path)), template_kwargs(cfg))
    regen = {name: Regenerator(str(cfg.model.target_path), rendering, max_new_tokens=cfg.regenerate.max_new_tokens,
                               batch_size=cfg.regenerate.batch_size, on_max_tokens="drop",
                               dtype=getattr(torch, args.dtype), loop_max_period=period)
             for name, period in (("loops run to the cap", 0), ("loops stopped", LOOP_MAX_PERIOD))}
    runs: dict = {name: [] for name in regen}
    outputs: dict = {}
    for _ in range(args.repeats):
        for name, r in regen.items():
            t0 = time.perf_counter()
            out, counts = r([x["messages"] for x in rows], [x["tools"] for x in rows])
            runs[name].append(time.perf_counter() - t0)
            outputs[name] = (out, counts)
            print(f"{name}: {runs[name][-1]:.0f} s", flush=True)
    tok = rendering.tok
    table = {}
    for name, (out, counts) in outputs.items():
        kept = sum(len(tok.encode(m["content"], add_special_tokens=False)) + 1
                   for conv in out if conv for m in conv if m["role"] == "assistant")
        wall = statistics.median(runs[name])
        table[name] = {"seconds": wall, "runs": runs[name], "generated": counts["generated tokens"], "kept_tokens": kept,
                       "kept_tokens_per_s": kept / wall, "regenerated turns": counts["regenerated turns"],
                       "dropped at the cap": counts["turns dropped: hit max_new_tokens"],
                       "dropped as loops": counts["turns dropped: a greedy loop"],
                       "conversations kept": sum(o is not None for o in out)}
    print(f"\n{len(rows)} conversations, SmolLM2-135M-Instruct, {args.dtype}, cap {cfg.regenerate.max_new_tokens}, "
          f"batches of {cfg.regenerate.batch_size}, {torch.get_num_threads()} threads\n")
    print("| setting | wall s (median) | tokens generated | tokens of kept turns | kept tokens/s | turns kept "
          "| dropped at the cap | dropped as loops | conversations kept |\n|---|---|---|---|---|---|---|---|---|")
    for name, t in table.items():
        print(f"| {name} | {t['seconds']:.0f} | {t['generated']:,} | {t['kept_tokens']:,} | {t['kept_tokens_per_s']:.0f} "
              f"| {t['regenerated turns']} | {t['dropped at the cap']} | {t['dropped as loops']} | {t['conversations kept']} |")
    off, on = table["loops run to the cap"], table["loops stopped"]
    same = sum(a == b for a, b in zip(outputs["loops run to the cap"][0], outputs["loops stopped"][0]) if b is not None)
    print(f"\nloops stopped / run to the cap: wall {on['seconds'] / off['seconds']:.2f}, kept tokens/s "
          f"{on['kept_tokens_per_s'] / off['kept_tokens_per_s']:.2f}; conversations kept with loops stopped that "
          f"equal the other setting's: {same}/{on['conversations kept']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
