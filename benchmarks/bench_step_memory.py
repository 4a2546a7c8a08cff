"""Drafter memory per training step, by length bucket: at the recipe's density with the plan's block-token
cut, unbounded, and thinned.

    .venv/bin/python benchmarks/bench_step_memory.py [--check] [--json]

A scaled Qwen3-8B drafter (width 256 = 1/16, 2 layers, block 16) trains one step (forward + backward of
the real loss) on a batch of each bucket of the seed run's boundaries scaled by 1/4 (128 .. 2048 tokens,
a target budget of 4096 padded tokens: 32 rows of 128 down to 2 rows of 2048), 90% of each row
supervised. `num_anchors` 128 per row (512 / 4). Each measurement runs in a fresh process: the whole
step (drafter built, forward, backward, AdamW step), its peak resident memory above the process's memory
after the imports (ru_maxrss; Linux, KiB), beside the memory model's estimate (sizing/memory.py, what
`dflash-ray plan` prints).

Three ways to fill a batch: `recipe, plan cut` (every valid anchor, 128 a row; the plan cuts a batch at
4,096 block tokens, model.max_block_tokens_per_batch: the longest bucket's 2 rows x 128 anchors x 16, as
the real presets' 16,384 = 2 x 512 x 16), `recipe, unbounded` (every valid anchor, the target's rows) and
`thinned` (model.anchors_per_batch=128: 2,048 block tokens a batch, fewer anchors than the rows hold).

Goals (`--check` exits 1 when one fails): at the recipe's density with the plan's cut the largest
bucket's step needs at most 1.5x the memory of the smallest's (unbounded, a batch of many short
rows carries many more blocks than a batch of two long ones); the memory model's estimate is within 20%
of every measured peak, in all three.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BOUNDARIES = [128, 256, 384, 576, 824, 2048]   # the seed run's six buckets, scaled by 1/4
TOKEN_BUDGET = 4096
NUM_ANCHORS = 128
ANCHORS_PER_BATCH = 128          # thinned
BLOCK_BUDGET = 4096             # the plan's cut: 2 rows x 128 anchors x block 16
MODES = {"recipe, plan cut": (None, BLOCK_BUDGET), "recipe, unbounded": (None, None),
         "thinned": (ANCHORS_PER_BATCH, None)}
GOAL = 1.5
MODEL_GOAL = 0.20   # the memory model's estimate within 20% of every measured peak


def measure(length: int, anchors_per_batch: int | None, block_budget: int | None) -> dict:
    """One whole step in this process (drafter built, forward, backward, AdamW step); returns its peak
    memory above the process's memory after the imports (MiB), and the memory model's estimate."""
    import resource

    import torch
    from transformers import Qwen3Config

    from dflash_ray.model.drafter import DrafterConfig, anchor_quota, build_drafter
    from dflash_ray.sizing.memory import Shape, drafter_step_memory

    torch.set_num_threads(2)
    hidden, vocab, block = 256, 4096, 16
    fields = dict(hidden_size=hidden, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=vocab, max_position_embeddings=4096,
                  tie_word_embeddings=True)
    target = Qwen3Config(**fields)
    valid_row = length - 1 - max(length // 10, 1)      # the step's rule: a and a+1 supervised, a >= 1
    rows = max(1, TOKEN_BUDGET // length)
    if block_budget:   # the plan's cut (data/buckets.py): rows while their anchors fit the budget, at least one
        rows = min(rows, max(1, block_budget // (block * min(NUM_ANCHORS, valid_row))))
    before = _rss_kib()
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(vocab, hidden, generator=g) * 0.02
    cfg = DrafterConfig(num_draft_layers=2, block_size=block, num_anchors=NUM_ANCHORS, mask_token_id=vocab - 1,
                        anchors_per_batch=anchors_per_batch)
    drafter = build_drafter(cfg, target, embed, embed, seed=0, attention_backend="sdpa")
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-4)
    ids = torch.randint(0, vocab - 1, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[:, : length // 10] = 0                                     # a prompt, then the answer
    lengths = torch.full((rows,), length)
    context = torch.randn(rows, length, hidden * len(drafter.target_layer_ids), generator=g)
    out = drafter.training_loss(ids, mask, context, lengths, torch.Generator().manual_seed(1))
    (out.loss_sum / out.weight_sum).backward()
    opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # the anchors the step trained, by the step's own rule (a and a+1 supervised, a >= 1, a + 1 < length)
    valid = [valid_row] * rows
    quota = anchor_quota(valid, NUM_ANCHORS, anchors_per_batch)
    anchors, queries = sum(quota), max(quota) * block
    est = drafter_step_memory(Shape.of(fields), draft_layers=2, taps=len(drafter.target_layer_ids),
                              block_tokens=anchors * block, context_tokens=rows * length, gpu=False, frozen_bytes=4,
                              mask_pairs=rows * queries * (length + queries))
    return {"length": length, "rows": rows, "blocks": anchors, "anchors_per_batch": anchors_per_batch,
            "peak_mib": max(0, peak - before) / 1024, "model_mib": est["total"] / 2 ** 20,
            "model_activation_mib": est["activations"] / 2 ** 20}


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the budgeted max/min exceeds the goal")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=3, metavar=("LENGTH", "PER_BATCH", "BUDGET"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        per_batch, budget = (None if x == "none" else int(x) for x in args.child[1:])
        print(json.dumps(measure(int(args.child[0]), per_batch, budget)))
        return 0
    results = {}
    for mode, (per_batch, budget) in MODES.items():
        for length in BOUNDARIES:
            out = subprocess.run([sys.executable, __file__, "--child", str(length), str(per_batch or "none"),
                                  str(budget or "none")], capture_output=True, text=True, check=True)
            results.setdefault(mode, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    ratios = {k: max(r["peak_mib"] for r in v) / max(min(r["peak_mib"] for r in v), 1e-9) for k, v in results.items()}
    errors = [r["model_mib"] / r["peak_mib"] - 1 for v in results.values() for r in v]
    flat = ratios["recipe, plan cut"] <= GOAL
    model_ok = max(abs(e) for e in errors) <= MODEL_GOAL
    passed = flat and model_ok
    if args.json:
        print(json.dumps({"results": results, "max_over_min": ratios, "goal": GOAL, "model_errors": errors,
                          "model_goal": MODEL_GOAL, "pass": passed}, indent=2))
    else:
        modes = list(MODES)
        print(f"{'bucket (tokens)':>16} | " + " | ".join(f"{m + ': rows, blocks, peak MiB, model':^42}" for m in modes))
        for i, length in enumerate(BOUNDARIES):
            cells = [results[m][i] for m in modes]
            print(f"{length:>16} | " + " | ".join(f"{c['rows']:>9} {c['blocks']:>8} {c['peak_mib']:>11.0f} "
                                                  f"{c['model_mib']:>11.0f}" for c in cells))
        print("max/min peak over buckets: " + ", ".join(f"{m} {ratios[m]:.2f}" for m in modes)
              + f" (goal for the plan cut <= {GOAL}: {'PASS' if flat else 'FAIL'})")
        print(f"memory model (sizing/memory.py) vs measured: {min(errors):+.1%} .. {max(errors):+.1%} "
              f"(goal within {MODEL_GOAL:.0%}: {'PASS' if model_ok else 'FAIL'})")
    return 1 if (args.check and not passed) else 0


if __name__ == "__main__":
    sys.exit(main())
