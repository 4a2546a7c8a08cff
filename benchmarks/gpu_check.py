"""The runtime's GPU-only code paths, without Ray (the GPU machine's image need not have Ray, OmegaConf or Hydra):

    collective   the real `train_step` on a drafter on the device, bf16 autocast, its stats vector
                 all-reduced on a torch.distributed process group of world size 1 (NCCL on CUDA: a CPU
                 tensor there fails with "No backend type associated with device type cpu")
    features     bf16 context features on the device -> the row encoding (int16 bits) -> back, bit for bit
    checkpoint   write_checkpoint / load_checkpoint of a drafter, AdamW and scheduler living on the device;
                 the restored weights and optimizer state equal the saved ones
    recompute    train.recompute_layers: one training step with the layers checkpointed (flex attention
                 and bf16 autocast on CUDA; SDPA on the CPU) gives the loss and gradients of the plain step
    host_copy    (CUDA) a batch of context features (8K tokens x 5 taps x 4096, bf16) copied host -> device
                 from pageable memory (what the trainer does today) and from pinned memory: GB/s of each,
                 so the next change knows whether pinning pays
    fsdp         train.parallelism=fsdp on a world of one (NCCL on CUDA): its step's loss is the DDP step's and
                 the checkpoint's gather gives whole host tensors
    staging      (CUDA) the trainer's prefetch thread copying the next rows to the GPU on a side stream
                 (loop.device_stager, TrainRow.stage) against the copy inside the step: seconds per row of
                 a stand-in step (~0.2 s of bf16 matmuls reading the features) each way, Qwen3-8B-sized rows
                 (16K tokens x 5 taps x 4096), and the staged tensors equal to the copied ones bit for bit

    oom_split    (CUDA) train.oom_split against the real allocator: the step's peak measured whole and with its
                 batch in 4 slices, then the process capped between the two (set_per_process_memory_fraction):
                 the whole batch runs out of memory for real, the step retrains it in slices, and its loss and
                 weights equal the uncapped whole step's; seconds of the split step against the whole one

    python benchmarks/gpu_check.py --out FILE.json [--device cpu]   # cpu: the same code on gloo

Writes one JSON: {"device", "collective", "features", "checkpoint", "recompute", "host_copy", "staging", "ok"}; exit 1
when a part fails.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def tiny_drafter(device):
    import torch
    from transformers import Qwen3Config

    from dflash_ray.model.drafter import DrafterConfig, build_drafter

    vocab, hidden = 512, 128
    target = Qwen3Config(hidden_size=hidden, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=vocab, max_position_embeddings=1024)
    embed = (torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.02).to(device)
    if device.type == "cuda":  # the target's frozen embedding/head in its dtype, as from a bf16 checkpoint
        embed = embed.to(torch.bfloat16)
    cfg = DrafterConfig(num_draft_layers=2, block_size=8, num_anchors=16, mask_token_id=vocab - 1, anchors_per_batch=24)
    return build_drafter(cfg, target, embed, embed, seed=0, device=device)  # initialised on the device


def check_collective(device, parallelism: str = "ddp") -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from dflash_ray.runtime.stream.rows import TrainRow, encode_features, token_row
    from dflash_ray.runtime.training.model import LossModule, make_optimizer
    from dflash_ray.runtime.training.step import train_step

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        drafter = tiny_drafter(device)
        if parallelism == "fsdp":   # a world of one: the sharding code path, nothing to shard over
            from dflash_ray.runtime.training.sharding import shard

            model = shard(drafter, LossModule(drafter), device)
        else:
            model = torch.nn.parallel.DistributedDataParallel(
                LossModule(drafter), device_ids=[device.index or 0] if device.type == "cuda" else None,
                broadcast_buffers=False, gradient_as_bucket_view=True)
        train = argparse.Namespace(lr=1e-3, weight_decay=0.0, warmup_ratio=0.0)
        opt, sched = make_optimizer(train, drafter, 10)
        g = torch.Generator().manual_seed(1)
        rows = []
        for index in range(2):
            ids = torch.randint(0, 500, (3, 64), generator=g).numpy().astype(np.int32)
            mask = np.ones_like(ids, dtype=np.int8)
            mask[:, :8] = 0
            feats = torch.randn(3, 64, 128 * len(drafter.target_layer_ids), generator=g).to(device)
            if device.type == "cuda":
                feats = feats.to(torch.bfloat16)
            context, dtype = encode_features(feats)
            cols = token_row(dict(index=index, epoch=0, position=index, epoch_batches=2, bucket=0, num_tokens=192),
                             1, ids, mask, np.full(3, 64))
            rows.append(TrainRow.from_batch({**cols, "context": context[None], "context_dtype": np.array([dtype])}))
        if device.type == "cuda":
            autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
        else:
            import contextlib
            autocast = contextlib.nullcontext
        t0 = time.perf_counter()
        result = train_step(model, drafter, opt, sched, rows, rank=0, workers=1, batches_per_step=2, seed=0,
                            grad_clip=1.0, device=device, autocast=autocast, all_reduce=dist.all_reduce)
        out = {"ok": bool(np.isfinite(result.loss)) and result.positions == [0, 1], "backend": backend,
               "parallelism": parallelism, "loss": result.loss, "train_tau": result.train_tau,
               "seconds": time.perf_counter() - t0}
        if parallelism == "fsdp":   # the checkpoint's gather: whole tensors on the host, all finite
            from dflash_ray.runtime.training.checkpoint_format import gather_state

            snap = gather_state(drafter, opt, sched, 0)
            out["gathered_tensors"] = len(snap.weights)
            out["ok"] = out["ok"] and all(bool(torch.isfinite(t).all()) and t.device.type == "cpu"
                                          for t in snap.weights.values())
        return out
    finally:
        dist.destroy_process_group()


def check_fsdp(device) -> dict:
    """train.parallelism=fsdp's step and gather on a world of one (NCCL on CUDA): the DDP step's loss."""
    fsdp, ddp = check_collective(device, "fsdp"), check_collective(device, "ddp")
    return {**fsdp, "ddp_loss": ddp["loss"], "ok": fsdp["ok"] and abs(fsdp["loss"] - ddp["loss"]) <= 1e-3 * abs(ddp["loss"])}


def check_features(device) -> dict:
    import torch

    from dflash_ray.runtime.stream.rows import decode_features, encode_features

    x = torch.randn(2, 33, 640, device=device).to(torch.bfloat16)
    array, name = encode_features(x)
    y = decode_features(array, name).to(device)
    return {"ok": name == "bfloat16" and y.dtype == torch.bfloat16 and torch.equal(x, y),
            "bytes_per_value": int(array.dtype.itemsize)}


def check_checkpoint(device) -> dict:
    import torch

    from dflash_ray.runtime.training.checkpoint_format import load_checkpoint, write_checkpoint
    from dflash_ray.runtime.stream.feed import Cursor
    from dflash_ray.runtime.training.model import lr_lambda

    def fresh():
        d = tiny_drafter(device)
        opt = torch.optim.AdamW(d.trainable_parameters(), lr=1e-3)
        return d, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.1))

    drafter, opt, sched = fresh()
    for p in drafter.trainable_parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_checkpoint(Path(tmp), drafter=drafter, optimizer=opt, scheduler=sched, cursor=Cursor(0, 4, 2),
                         world_size=1)
        seconds = time.perf_counter() - t0
        d2, opt2, sched2 = fresh()
        cursor = load_checkpoint(Path(tmp), drafter=d2, optimizer=opt2, scheduler=sched2, rank=0)
    same_weights = all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), d2.state_dict().values()))
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    same_optim = all(torch.equal(s1[k]["exp_avg"].cpu(), s2[k]["exp_avg"].cpu()) for k in s1)
    on_device = all(p.device.type == device.type for p in d2.parameters())
    return {"ok": same_weights and same_optim and on_device and cursor == Cursor(0, 4, 2) and sched2.last_epoch == 1,
            "write_seconds": seconds, "weights_equal": same_weights, "optimizer_equal": same_optim,
            "restored_on_device": on_device}


def check_recompute(device) -> dict:
    import torch

    drafter = tiny_drafter(device)
    g = torch.Generator().manual_seed(0)
    bsz, seq, vocab = 2, 96, drafter.embed_weight.shape[0]
    ids = torch.randint(0, vocab - 1, (bsz, seq), generator=g).to(device)
    mask = torch.ones(bsz, seq, dtype=torch.long, device=device)
    mask[:, :10] = 0
    lengths = torch.tensor([seq, seq - 20], device=device)
    context = torch.randn(bsz, seq, drafter.fc.in_features, generator=g).to(device)

    def run(flag):
        drafter.zero_grad()
        drafter.recompute_layers = flag
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = drafter.training_loss(ids, mask, context, lengths, torch.Generator().manual_seed(1))
        (out.loss_sum / out.weight_sum).backward()
        return float(out.loss_sum.detach()), [p.grad.float().clone() for p in drafter.trainable_parameters()]

    loss0, grads0 = run(False)
    loss1, grads1 = run(True)
    worst = max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(grads0, grads1))
    return {"ok": abs(loss1 - loss0) <= 1e-3 * abs(loss0) and worst <= 2e-2, "loss": loss0,
            "loss_recomputed": loss1, "max_relative_grad_difference": worst}


def check_host_copy(device) -> dict:
    import torch

    if device.type != "cuda":
        return {"ok": True, "skipped": "no CUDA device"}
    x = torch.randn(8192, 5 * 4096).to(torch.bfloat16)
    pinned = x.pin_memory()
    out = {}
    for name, src in (("pageable", x), ("pinned", pinned)):
        src.to(device, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            src.to(device, non_blocking=True)
        torch.cuda.synchronize()
        out[f"{name}_gb_per_s"] = 5 * x.numel() * x.element_size() / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    x.pin_memory()
    out["pin_seconds"] = time.perf_counter() - t0   # what pinning a fresh batch costs on the host
    out["ok"] = True
    return out


def check_staging(device) -> dict:
    import numpy as np
    import torch

    from dflash_ray.runtime.stream.rows import TrainRow, encode_features
    from dflash_ray.runtime.training.loop import Prefetcher, device_stager

    if device.type != "cuda":
        return {"ok": True, "skipped": "no CUDA device"}
    rows_n, tokens, width = 6, 16384, 5 * 4096
    feats, dtype = encode_features(torch.randn(1, tokens, width, dtype=torch.bfloat16))
    ids = np.random.randint(0, 1000, (1, tokens)).astype(np.int32)

    def rows():
        for i in range(rows_n):
            yield TrainRow(index=i, gen=0, epoch=0, position=i, epoch_batches=rows_n, bucket=0, num_tokens=tokens,
                           input_ids=ids, loss_mask=np.ones((1, tokens), np.int8),
                           lengths=np.array([tokens], np.int32), context=feats, context_dtype=dtype)

    w = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def step(row):   # a stand-in step: the features read once, then ~0.2 s of matmuls
        _, _, context, _ = row.tensors(device)
        acc = context[0, :8192, :8192].float().sum()
        x = w
        for _ in range(100):
            x = (x @ w) * 1e-3
        return acc + x.float().sum()

    out, sums = {}, {}
    for name, stage in (("in_step", None), ("staged", device_stager(device))):
        stream = Prefetcher(rows(), size=1, stage=stage)
        step(next(stream))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = [step(row) for row in stream]
        torch.cuda.synchronize()
        out[f"{name}_seconds_per_row"] = (time.perf_counter() - t0) / len(got)
        sums[name] = torch.stack(got).cpu()
    out["saved_seconds_per_row"] = out["in_step_seconds_per_row"] - out["staged_seconds_per_row"]
    out["bytes_per_row"] = int(feats.nbytes)
    out["equal"] = bool(torch.equal(sums["in_step"], sums["staged"]))
    out["ok"] = out["equal"]
    return out


def check_oom_split(device) -> dict:
    """A real CUDA out-of-memory error in the drafter's step, survived by training the batch in slices."""
    if device.type != "cuda":
        return {"ok": True, "skipped": "CPU: its allocator does not raise (tests/reliability/test_oom_split.py "
                                       "injects the exception type instead)"}
    import copy

    import numpy as np
    import torch

    from dflash_ray.runtime.stream.rows import TrainRow, encode_features, token_row
    from dflash_ray.runtime.training.model import LossModule, make_optimizer
    from dflash_ray.runtime.training.step import train_step

    base = tiny_drafter(device)
    base.num_anchors, base.anchors_per_batch = 256, None   # activations big enough to measure the cap against
    rows_n, width = 32, 1024
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (rows_n, width), generator=g).numpy().astype(np.int32)
    mask = np.ones_like(ids, dtype=np.int8)
    mask[:, :64] = 0
    feats = torch.randn(rows_n, width, 128 * len(base.target_layer_ids), generator=g).to(device, torch.bfloat16)

    def make_row(n):   # the batch's first n rows
        context, dtype = encode_features(feats[:n])
        cols = token_row(dict(index=0, epoch=0, position=0, epoch_batches=1, bucket=0, num_tokens=n * width),
                         1, ids[:n], mask[:n], np.full(n, width))
        return TrainRow.from_batch({**cols, "context": context[None], "context_dtype": np.array([dtype])})

    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    train = argparse.Namespace(lr=1e-3, weight_decay=0.0, warmup_ratio=0.0)

    def step(row):
        drafter = copy.deepcopy(base)
        opt, sched = make_optimizer(train, drafter, 10)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        r = train_step(LossModule(drafter), drafter, opt, sched, [row], rank=0, workers=1, batches_per_step=1,
                       seed=0, grad_clip=1.0, device=device, autocast=autocast, split_on_oom=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        weights = [p.detach().float().cpu() for p in drafter.trainable_parameters()]
        peak = torch.cuda.max_memory_allocated() - before
        del drafter, opt, sched
        torch.cuda.empty_cache()
        return r, weights, before, peak, seconds

    whole_row = make_row(rows_n)
    step(whole_row)   # warm-up
    whole, w_whole, before, peak_whole, s_whole = step(whole_row)
    _, _, _, peak_quarter, _ = step(make_row(rows_n // 4))
    total = torch.cuda.get_device_properties(device).total_memory
    cap = before + (peak_whole + peak_quarter) // 2   # over a quarter's peak, under the whole batch's
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        split, w_split, _, _, s_split = step(whole_row)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    diff = max(float((a - b).abs().max()) for a, b in zip(w_whole, w_split))
    return {"ok": split.oom_splits == 1 and not split.skipped_oom and abs(split.loss - whole.loss) <= 1e-3 * abs(whole.loss)
            and diff <= 1e-3, "rows": rows_n, "width": width, "peak_whole_gib": peak_whole / 2**30,
            "peak_quarter_gib": peak_quarter / 2**30, "cap_gib": cap / 2**30, "oom_splits": split.oom_splits,
            "loss_whole": whole.loss, "loss_split": split.loss, "max_weight_diff": diff,
            "seconds_whole": s_whole, "seconds_split": s_split, "split_over_whole": s_split / s_whole}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON of results")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    args = ap.parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        torch.set_num_threads(1)
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    checks = (("collective", check_collective), ("features", check_features), ("checkpoint", check_checkpoint),
              ("recompute", check_recompute), ("host_copy", check_host_copy), ("staging", check_staging),
              ("fsdp", check_fsdp), ("oom_split", check_oom_split))
    for name, check in checks:
        try:
            report[name] = check(device)
        except Exception:  # every part reports, whatever another did
            report[name] = {"ok": False, "error": traceback.format_exc(limit=4)}
    report["ok"] = all(report[name]["ok"] for name, _ in checks)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: (v["ok"] if isinstance(v, dict) else v) for k, v in report.items()}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
