"""What the CPU's training step costs at SmolLM2-135M's shape (model=smollm2_135m), by compute dtype and
attention kernel, and what bf16 buys the target's work: the figures behind `model.compute_dtype: bfloat16`
and the CPU's split attention kernel. Random weights of the preset's shape (nothing to convert or load).

    .venv/bin/python benchmarks/bench_cpu_dtype.py [--threads 1] [--rows 8 --length 220]

Rows of the drafter step: fp32 vs bf16 autocast, each with the split kernel (what the CPU trains with) and
SDPA over the dense mask; one thread (a CPU trainer worker's). Then the frozen head's matmul (fwd + input
grad, 2,048 x 576 x 49,152) and the target's prefill and batched greedy decoding, fp32 vs bf16, on --threads.
Ratios are measured in the same run (the machine is shared and noisy).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SMOL = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
            max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)


def best_of(fn, repeats: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def drafter_rows(rows: int, length: int, repeats: int) -> list[tuple[str, float, int]]:
    from transformers import LlamaConfig

    from dflash_ray.model.drafter import DrafterConfig, build_drafter

    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOL)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    taps = (1, 8, 14, 20, 27)
    dcfg = DrafterConfig(num_draft_layers=5, block_size=8, num_anchors=512, target_layer_ids=taps, mask_token_id=16)
    ids = torch.randint(20, 49000, (rows, length))
    mask = torch.zeros(rows, length, dtype=torch.long)
    mask[:, length // 4:] = 1          # a quarter prompt, the rest supervised (the real rows: ~60%)
    ctx = torch.randn(rows, length, cfg.hidden_size * len(taps))
    lengths = torch.full((rows,), length)
    out = []
    for dtype in ("float32", "bfloat16"):
        for kernel in ("split", "sdpa"):
            d = build_drafter(dcfg, cfg, embed, embed, seed=0, attention_backend=kernel)
            context = ctx.to(getattr(torch, dtype))
            blocks = []

            def step():
                autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
                with autocast:
                    loss = d.training_loss(ids, mask, context, lengths, torch.Generator().manual_seed(0))
                (loss.loss_sum / loss.weight_sum).backward()
                blocks.append(int(loss.num_blocks))
                d.zero_grad(set_to_none=True)

            out.append((f"drafter step, {dtype}, {kernel}", best_of(step, repeats), blocks[-1]))
    return out


def head_rates(repeats: int) -> dict:
    w = torch.randn(49152, 576)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2048, 576, dtype=dtype, requires_grad=True)
        wd = w.to(dtype)

        def fn():
            (x @ wd.t()).sum().backward()

        rates[str(dtype).split(".")[1]] = 4 * 2048 * 576 * 49152 / best_of(fn, repeats) / 1e9
    return rates


def target_rates(repeats: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOL)).eval()
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        ids = torch.randint(20, 49000, (16, 256))
        prompts = torch.randint(20, 49000, (64, 40))
        with torch.no_grad():
            prefill = best_of(lambda: m.model(ids), repeats)
            decode = best_of(lambda: m.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=32,
                                                min_new_tokens=32, do_sample=False, pad_token_id=0), 1)
        rates[str(dtype).split(".")[1]] = (ids.numel() / prefill, 64 * 32 / decode)
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=220)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads for the head and target rows (the step: 1)")
    a = p.parse_args()
    torch.set_num_threads(1)
    steps = drafter_rows(a.rows, a.length, a.repeats)
    torch.set_num_threads(a.threads)
    head, target = head_rates(a.repeats), target_rates(a.repeats)
    base = steps[0][1]
    print(f"\nSmolLM2-135M shape, drafter 5 layers, block 8, {a.rows} rows x {a.length} tokens; step on 1 thread, "
          f"the rest on {a.threads}")
    print(f"{'what':<40} {'figure':>14} {'vs first row':>13}")
    for name, seconds, blocks in steps:
        print(f"{name:<40} {seconds:>12.2f} s {base / seconds:>12.2f}x   ({blocks} blocks)")
    print(f"{'head fwd+input grad, float32':<40} {head['float32']:>8.0f} GFLOPS")
    print(f"{'head fwd+input grad, bfloat16':<40} {head['bfloat16']:>8.0f} GFLOPS {head['bfloat16'] / head['float32']:>12.2f}x")
    for dtype in ("float32", "bfloat16"):
        pre, dec = target[dtype]
        print(f"{'target prefill 16x256, ' + dtype:<40} {pre:>8.0f} tok/s {pre / target['float32'][0]:>12.2f}x")
        print(f"{'target greedy decode, batch 64, ' + dtype:<40} {dec:>8.0f} tok/s {dec / target['float32'][1]:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
