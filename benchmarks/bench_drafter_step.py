"""Benchmark one DFlash drafter training step (forward, chunked-head loss, backward, AdamW) without Ray.

Default shape on a GPU: the Qwen3-8B drafter (hidden 4096, 5 layers, 32 query / 8 KV heads, head dim 128,
intermediate 12288, vocab 151,936, B=16, 512 anchors, context 3072), bf16 autocast, FlexAttention compiled,
decoder layers compiled. On a CPU (or with --cpu-small) a scaled-down shape that finishes in seconds.

    python benchmarks/bench_drafter_step.py                # GPU: Qwen3-8B shape
    python benchmarks/bench_drafter_step.py --cpu-small    # CPU: scaled-down shape

Reports tokens/s (context tokens of the training sequences, and block tokens the drafter processes), peak
memory, and model FLOPs utilisation. FLOPs are counted, not estimated from parameter counts:

    linear layers      2*m*n*k forward; backward 2x forward (input and weight grads), except `fc`
                       whose input (the target's features) needs no grad: 1x
    attention          4*D*heads per *visible* (query, key) pair forward (QK^T and PV), backward 2x;
                       visible pairs counted from the sampled anchors: sum over blocks of (a + B) * B
    LM head (frozen)   only supervised slots: 2*M*H*V for the logits + 2*M*H*V for d/dhidden, no weight grad

MFU = counted FLOPs / step time / peak. Peak: --peak-tflops, else 989 TFLOP/s (H100/H200 bf16 dense) on
CUDA, else a measured fp32 matmul rate on the CPU (so CPU "MFU" means: fraction of what this CPU's matmul
reaches). The table is printed last, then the goals, each PASS, FAIL or n/a:

    MFU >= 45%         the Qwen3-8B drafter step on an H200 (bf16). It applies on CUDA at the
                       Qwen3-8B shape only; on a CPU or at another shape it prints n/a (a CPU "MFU" is
                       against a measured fp32 matmul rate, not the H200 figure the goal is set for)
    loss finite        every timed step's loss is a finite number (applies everywhere)

With --check the exit code is 1 when any goal fails.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dflash_ray.model.drafter import DFlashDrafter, drafter_config  # noqa: E402
from dflash_ray.sizing.memory import Shape, drafter_step_memory  # noqa: E402

QWEN3_8B = dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                vocab=151936, block=16, anchors=512, context=3072, target_layers=36, batch=1)
MFU_GOAL = 0.45  # the Qwen3-8B drafter step on an H200
CPU_SMALL = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=768,
                 vocab=8192, block=16, anchors=32, context=512, target_layers=12, batch=1)


def write_json(path: str, figures: dict) -> None:
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(figures, f, indent=2, default=str)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-small", action="store_true", help="scaled-down shape (default when no CUDA)")
    for key, value in QWEN3_8B.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"Qwen3-8B: {value}")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="GPU: skip torch.compile of the layers")
    p.add_argument("--backend", default="auto", choices=["auto", "flex", "sdpa"])
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--ce-chunk-rows", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)")
    p.add_argument("--anchors-per-batch", type=int, default=None,
                   help="the per-batch anchor budget (model.anchors_per_batch; Qwen3-8B config: 512)")
    p.add_argument("--recompute-layers", action="store_true", help="train.recompute_layers: recompute layers in backward")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 when any goal fails")
    return p.parse_args()


def count_flops(shape, anchors: torch.Tensor, supervised_rows: int) -> dict:
    h, d = shape["hidden"], shape["head_dim"]
    q_out, kv_out = shape["heads"] * d, shape["kv_heads"] * d
    n_tap = 5 if shape["layers"] >= 5 else shape["layers"]
    s, b = shape["context"], shape["block"]
    bsz, n = anchors.shape
    blk = bsz * n * b                                   # block tokens
    ctx = bsz * s                                       # context tokens
    per_layer = (2 * blk * h * q_out                    # q_proj
                 + 2 * 2 * (blk + ctx) * h * kv_out     # k_proj, v_proj on block and context tokens
                 + 2 * blk * q_out * h                  # o_proj
                 + 3 * 2 * blk * h * shape["intermediate"])  # gate, up, down
    linear_fwd = shape["layers"] * per_layer
    fc_fwd = 2 * ctx * n_tap * h * h
    visible = int(((anchors.double() + b) * b).sum())
    attn_fwd = shape["layers"] * 4 * d * shape["heads"] * visible
    head = 2 * 2 * supervised_rows * h * shape["vocab"]
    total = 3 * linear_fwd + 2 * fc_fwd + 3 * attn_fwd + head
    return dict(total=total, linear=3 * linear_fwd + 2 * fc_fwd, attention=3 * attn_fwd, head=head,
                visible_pairs=visible)


def cpu_matmul_peak() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    return reps * 2 * 1024 ** 3 / (time.perf_counter() - t)


def main():
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_small
    shape = dict(QWEN3_8B if cuda else CPU_SMALL)
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    steps = args.steps or (10 if cuda else 5)
    warmup = args.warmup or (3 if cuda else 1)
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(args.threads)
    head_dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)

    n_tap = 5 if shape["layers"] >= 5 else shape["layers"]
    target_layer_ids = list(range(1, 1 + n_tap))
    target_cfg = dict(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      head_dim=shape["head_dim"], num_hidden_layers=shape["target_layers"],
                      vocab_size=shape["vocab"], max_position_embeddings=40960, rms_norm_eps=1e-6,
                      tie_word_embeddings=False)
    config = drafter_config(target_cfg, shape["layers"], shape["block"], shape["vocab"] - 1, target_layer_ids)
    embed = torch.randn(shape["vocab"], shape["hidden"], dtype=head_dtype, device=device) * 0.02
    head = torch.randn(shape["vocab"], shape["hidden"], dtype=head_dtype, device=device) * 0.02
    drafter = DFlashDrafter(config, embed, head, num_anchors=shape["anchors"], attention_backend=args.backend,
                            ce_chunk_rows=args.ce_chunk_rows, anchors_per_batch=args.anchors_per_batch).to(device)
    drafter.recompute_layers = args.recompute_layers
    compiled = cuda and not args.no_compile
    if compiled:
        drafter.compile_layers()
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-4, fused=cuda)

    bsz, s = shape["batch"], shape["context"]
    ids = torch.randint(0, shape["vocab"] - 1, (bsz, s), device=device)
    loss_mask = torch.ones(bsz, s, dtype=torch.long, device=device)
    loss_mask[:, : s // 8] = 0                                  # a prompt, unsupervised
    lengths = torch.full((bsz,), s, device=device)
    context = torch.randn(bsz, s, n_tap * shape["hidden"], dtype=head_dtype, device=device)
    gen = torch.Generator().manual_seed(0)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = drafter.training_loss(ids, loss_mask, context, lengths, gen)
        loss = out.loss_sum / out.weight_sum
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    replay = torch.Generator().manual_seed(0)
    for _ in range(warmup):  # keep the replay generator in step with `gen`
        drafter.sample_anchors(loss_mask, lengths, replay)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, flops, losses = [], [], []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t)
        losses.append(float(out.loss_sum.detach()) / max(float(out.weight_sum), 1e-30))
        # The anchors this step trained on: same generator state, replayed (after the timed region).
        anchors, _ = drafter.sample_anchors(loss_mask, lengths, replay)
        flops.append(count_flops(shape, anchors, int(out.slot_count.sum()))["total"])
    # Median step: robust to background load on a shared machine (per-step sync costs ~nothing here).
    elapsed = sorted(times)[len(times) // 2]
    flops = sum(flops) / len(flops)
    if cuda:
        peak_mem = torch.cuda.max_memory_allocated() / 2**30
        mem_label = "peak CUDA memory allocated"
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        mem_label = "peak process RSS"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (989e12 if cuda else cpu_matmul_peak())
    parts = count_flops(shape, anchors, int(out.slot_count.sum()))
    n_anchor = anchors.shape[1]
    # the memory model `dflash-ray plan` prints, for this step (on a GPU: against max_memory_allocated)
    _, valid = drafter.sample_anchors(loss_mask, lengths, torch.Generator().manual_seed(0))
    model = drafter_step_memory(Shape.of(target_cfg), draft_layers=shape["layers"], taps=n_tap,
                                block_tokens=int(valid.sum()) * shape["block"], context_tokens=bsz * s, gpu=cuda,
                                frozen_bytes=2 if cuda else 4, recompute_layers=args.recompute_layers,
                                mask_pairs=bsz * n_anchor * shape["block"] * (s + n_anchor * shape["block"]))
    model_gib = model["total"] / 2**30

    rows = [
        ("device", torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"),
        ("shape", f"H={shape['hidden']} L={shape['layers']} heads={shape['heads']}/{shape['kv_heads']} "
                  f"D={shape['head_dim']} I={shape['intermediate']} V={shape['vocab']}"),
        ("batch", f"{bsz} x context {s}, {n_anchor} anchors x B={shape['block']}"),
        ("precision", "bf16 autocast, fp32 master weights" if cuda else "fp32"),
        ("attention", f"{'flex' if cuda and args.backend != 'sdpa' else 'sdpa'}"
                      f"{' + compiled layers' if compiled else ''}"),
        ("step time (ms, median)", f"{elapsed * 1e3:.1f} over {steps} steps"),
        ("context tokens/s", f"{bsz * s / elapsed:,.0f}"),
        ("block tokens/s", f"{bsz * n_anchor * shape['block'] / elapsed:,.0f}"),
        (mem_label + " (GiB)", f"{peak_mem:.2f} (memory model, the step alone: {model_gib:.2f})"),
        ("counted TFLOP/step", f"{flops / 1e12:.3f} (linear {parts['linear'] / 1e12:.3f}, "
                               f"attention {parts['attention'] / 1e12:.3f}, head {parts['head'] / 1e12:.3f})"),
        ("achieved TFLOP/s", f"{flops / elapsed / 1e12:.3f}"),
        ("peak TFLOP/s used", f"{peak / 1e12:.3f}" + ("" if cuda or args.peak_tflops else " (measured fp32 matmul)")),
        ("MFU", f"{100 * flops / elapsed / peak:.1f}%"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nDFlash drafter training step")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")

    mfu = flops / elapsed / peak
    if not cuda:
        mfu_ok, mfu_note = None, "on CPU; the goal is for an H200 at the Qwen3-8B shape"
    elif shape != QWEN3_8B:
        mfu_ok, mfu_note = None, "shape differs from Qwen3-8B; the goal is set for that shape"
    else:
        mfu_ok, mfu_note = mfu >= MFU_GOAL, f"vs {peak / 1e12:.0f} TFLOP/s peak"
    finite = all(math.isfinite(x) for x in losses)
    goals = [
        (f"MFU (goal >= {100 * MFU_GOAL:.0f}%)", f"{100 * mfu:.1f}%", mfu_ok, mfu_note),
        ("loss finite on every timed step", f"{losses[-1]:.4f}", finite, f"{len(losses)} steps"),
    ]
    print("\ngoals")
    gw = max(len(g[0]) for g in goals)
    for what, value, ok, note in goals:
        verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        print(f"  {what:<{gw}}  {value:>8}  {verdict:<4}  ({note})")
    failed = sum(ok is False for _, _, ok, _ in goals)
    applied = sum(ok is not None for _, _, ok, _ in goals)
    print(f"  {applied - failed} of {applied} applicable goals met" + (f", {failed} FAILED" if failed else ""))
    if args.json:
        write_json(args.json, {
            "device": rows[0][1], "shape": shape, "batch": bsz, "context": s, "anchors_per_row": n_anchor,
            "anchors_per_batch": args.anchors_per_batch, "blocks": int(out.num_blocks), "compiled": compiled,
            "ce_chunk_rows": args.ce_chunk_rows,
            "step_ms_median": elapsed * 1e3, "peak_memory_gib": peak_mem, "memory": mem_label,
            "memory_model_gib": model_gib, "recompute_layers": args.recompute_layers,
            "tflop_per_step": flops / 1e12, "mfu": mfu, "peak_tflops": peak / 1e12, "losses_finite": finite,
            "goals": [{"what": w, "value": v, "pass": ok, "note": n} for w, v, ok, n in goals]})
    if args.check and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
