"""The target's feature capture at the forward sizes the plan makes: how much a small batch costs.

    python benchmarks/bench_target_sizes.py [--cpu-small] [--json PATH]

At the recipe's density the plan cuts short rows' batches at the drafter's block-token budget
(model.max_block_tokens_per_batch=16384: ~1,300 context tokens a batch in the shortest bucket on
seed-shaped data, benchmarks/bench_density.py), where long rows fill the target's 16,384-token budget. This
builds a Qwen3-8B-shaped target once (random weights, bf16 on a GPU) and times the runtime's extractor
(model/target.py) on batches of rows x length: 1-3 rows of 512 (the shortest bucket's batches), 4 x 1,024,
2 x 3,072 (where the H200's 33,009 tokens/s was measured), 2 x 8,192 (the longest bucket's). It prints
context tokens/s per size and each size's rate relative to the largest batch's: the target's efficiency
at the plan's small forwards. Only a GPU's figure decides anything (benchmarks/gpu_check.sh runs it on a
GPU machine); --cpu-small runs the same code at a small shape (CI).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_target_capture import CPU_SMALL, QWEN3_8B, build_target  # noqa: E402

from dflash_ray.model.target import TargetFeatureExtractor, default_target_layer_ids  # noqa: E402

SIZES = [(1, 512), (2, 512), (3, 512), (4, 1024), (2, 3072), (2, 8192)]   # rows x tokens a row
CPU_SIZES = [(1, 64), (2, 64), (4, 128), (2, 512)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-small", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.cpu_small
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape, sizes = (QWEN3_8B, SIZES) if cuda else (CPU_SMALL, CPU_SIZES)
    model = build_target(shape, device, dtype)
    extractor = TargetFeatureExtractor(model, default_target_layer_ids(shape["layers"], shape["draft_layers"]))
    rows = []
    for n, length in sizes:
        ids = torch.randint(0, shape["vocab"], (n, length), generator=torch.Generator().manual_seed(n)).to(device)
        mask = torch.ones_like(ids)   # the runtime always passes an attention mask
        best = float("inf")
        for i in range(a.steps + 1):   # the first is a warm-up
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                extractor(ids, attention_mask=mask)
            if cuda:
                torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - t)
        rows.append({"rows": n, "length": length, "tokens": n * length, "ms": best * 1e3,
                     "tokens_per_second": n * length / best})
    top = rows[-1]["tokens_per_second"]
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads), small shape"
    print(f"target feature capture by forward size ({name}; {shape['layers']} layers, H={shape['hidden']})")
    print(f"{'rows x length':>14} {'tokens':>7} {'ms':>8} {'tokens/s':>10} {'vs largest':>10}")
    for r in rows:
        r["relative"] = r["tokens_per_second"] / top
        print(f"{r['rows']:>6} x {r['length']:<6} {r['tokens']:>7,} {r['ms']:>8.1f} {r['tokens_per_second']:>10,.0f} "
              f"{r['relative']:>10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "sizes": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
