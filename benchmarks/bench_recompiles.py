"""How many graphs torch.compile builds for the drafter's layers over a stream of mixed batch shapes.

The runtime compiles each decoder layer (`DFlashDrafter.compile_layers`, GPU runs) and the real stream
changes rows, sequence length and sampled anchors every batch; the benchmark's three fixed shapes never
showed what that costs. This runs training steps over a seeded random sequence of bucket shapes (rows x
length, the seed run's buckets on CUDA, scaled down on the CPU) and counts the graphs dynamo compiled and
its recompile messages (`TORCH_LOGS=recompiles`), for automatic dynamic shapes (torch's default, what
the runtime uses) and for `dynamic=True` (symbolic from the first call). The bound, derived by hand:
a layer's code is one code object for all layers, and its guards split on (a) whether the input needs a
gradient (layer 0's input comes from the frozen embedding, the others' do not) and (b) the first shape
(static), any later one (a dynamic graph) and a batch of one row (torch specialises sizes 0 and 1): 2 x 3
= 6 graphs, under dynamo's recompile limit of 8 per code object (above it a layer runs uncompiled).

    python benchmarks/bench_recompiles.py                  # CPU: eager backend (dynamo's guards, no codegen)
    python benchmarks/bench_recompiles.py --batches 40     # CUDA: inductor, Qwen3-8B drafter, flex attention
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dflash_ray.model.drafter import DFlashDrafter, compiled_graphs, drafter_config  # noqa: E402

# (rows, length) per bucket: the seed run's six buckets at the recipe's cut (16,384 block tokens, 16K tokens)
GPU_BUCKETS = [(3, 512), (8, 1024), (4, 2048), (3, 3072), (2, 4096), (2, 8192), (1, 8192)]
CPU_BUCKETS = [(16, 24), (8, 48), (5, 80), (3, 128), (2, 200), (1, 256), (1, 400)]
GRAPH_BOUND = 6


class _Recompiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        msg = record.getMessage()
        if "Recompiling" in msg:
            self.messages.append(msg)


def shapes(buckets, n: int, seed: int = 1) -> list[tuple[int, int]]:
    rnd = random.Random(seed)
    return [rnd.choice(buckets) for _ in range(n)]


def build(cuda: bool):
    if cuda:
        h, v, inter, heads, kv, hd, layers, taps = 4096, 151936, 12288, 32, 8, 128, 5, 5
    else:
        h, v, inter, heads, kv, hd, layers, taps = 64, 512, 128, 4, 2, 16, 2, 2
    target = dict(hidden_size=h, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=hd, num_hidden_layers=36, vocab_size=v, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg = drafter_config(target, layers, 16 if cuda else 4, v - 1, list(range(1, 1 + taps)))
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    embed = torch.randn(v, h, device=dev, dtype=dtype) * 0.02
    head = torch.randn(v, h, device=dev, dtype=dtype) * 0.02
    return DFlashDrafter(cfg, embed, head, num_anchors=512 if cuda else 8).to(dev), taps * h


def count_graphs(sequence, *, dynamic, backend: str, cuda: bool) -> dict:
    """Train one step per (rows, length) of `sequence` with compiled layers; graphs and recompiles."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    drafter, width = build(cuda)
    drafter.compile_layers(dynamic=dynamic, backend=backend)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-4, fused=cuda or None)
    gen = torch.Generator().manual_seed(0)
    dev = next(drafter.parameters()).device
    vocab = drafter.embed_weight.shape[0]
    handler = _Recompiles()
    torch._logging.set_logs(recompiles=True)
    log = logging.getLogger("torch._dynamo")
    log.addHandler(handler)
    graphs_after, t0 = [], time.perf_counter()
    try:
        for rows, length in sequence:
            ids = torch.randint(0, vocab - 1, (rows, length), device=dev)
            mask = torch.ones(rows, length, dtype=torch.long, device=dev)
            mask[:, : length // 8] = 0
            lengths = torch.full((rows,), length, device=dev)
            lengths[0] = length - 3
            context = torch.randn(rows, length, width, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                out = drafter.training_loss(ids, mask, context, lengths, gen)
            (out.loss_sum / out.weight_sum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            graphs_after.append(compiled_graphs())
        if cuda:
            torch.cuda.synchronize()
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
    return {"dynamic": str(dynamic), "backend": backend, "batches": len(sequence), "graphs": graphs_after[-1],
            "recompiles": len(handler.messages), "last_new_graph_at_batch": 1 + graphs_after.index(graphs_after[-1]),
            "seconds": time.perf_counter() - t0,
            "distinct_shapes": len(set(sequence)),
            "reasons": sorted({m.split("- ", 1)[-1].split("\n")[0][:100] for m in handler.messages})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=None, help="steps over mixed buckets (CPU 40, CUDA 30)")
    p.add_argument("--backend", default=None, help="torch.compile backend (CPU: eager; CUDA: inductor)")
    p.add_argument("--cpu-small", action="store_true", help="the CPU shapes even where CUDA is there")
    p.add_argument("--modes", default="auto,true", help="dynamic modes to run: auto (None), true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_small
    if not cuda:
        torch.set_num_threads(1)
    backend = args.backend or ("inductor" if cuda else "eager")
    seq = shapes(GPU_BUCKETS if cuda else CPU_BUCKETS, args.batches or (30 if cuda else 40))
    rows = [count_graphs(seq, dynamic={"auto": None, "true": True}[m], backend=backend, cuda=cuda)
            for m in args.modes.split(",")]
    print(f"{'dynamic':8} {'backend':9} {'batches':>7} {'shapes':>6} {'graphs':>6} {'recompiles':>10} "
          f"{'last new at':>11} {'seconds':>8}")
    for r in rows:
        print(f"{r['dynamic']:8} {r['backend']:9} {r['batches']:>7} {r['distinct_shapes']:>6} {r['graphs']:>6} "
              f"{r['recompiles']:>10} {r['last_new_graph_at_batch']:>11} {r['seconds']:>8.1f}")
    for r in rows:
        for reason in r["reasons"]:
            print(f"  {r['dynamic']}: {reason}")
    ok = all(r["graphs"] <= GRAPH_BOUND for r in rows)
    print(f"graphs <= {GRAPH_BOUND} (2 grad states x static/dynamic/one-row): {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": "cuda" if cuda else "cpu", "runs": rows, "bound": GRAPH_BOUND, "ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
