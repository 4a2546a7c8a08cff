"""The compute dtype this CPU runs fast (`model.compute_dtype: null` on CPUs), like the thread counts: chosen by
measurement, once per machine. No Ray; torch only inside the measurement.

bfloat16 halves the features' bytes and, on processors with bf16 matrix units (AMX) or AVX-512 BF16, runs
the target's and the drafter's matmuls faster than fp32 (~4x with AMX, benchmarks/bench_cpu_dtype.py). On a
processor without them torch emulates bf16: one with AVX2 only ran a bf16 matmul of the target's shape at
1.1 GFLOPS against 63.6 in fp32 (58x slower), and the real-model command's regeneration never finished a
batch. So bf16 is chosen only where a bf16 matmul at the target's width runs at least `BF16_MIN_SPEEDUP`
times as fast as fp32's on one thread, measured here (~0.6 s on an AVX2-only processor, milliseconds where
bf16 is fast) and kept in <machine cache>/processor/<key>.json, keyed by the processor's model and flags
and torch's version. A user's explicit model.compute_dtype wins; GPUs compute in bfloat16.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

BF16_MIN_SPEEDUP = 1.2     # below it, fp32 (the exact one) is as good
SHAPE = (256, 576, 576)    # rows x the SmolLM2 target's width x width: 0.17 GFLOP, small enough where bf16 crawls


def matmul_gflops(dtype: str, repeats: int = 3) -> float:
    """One thread's GFLOPS of an (m x k) @ (k x n) matmul in `dtype`, best of `repeats` after a warm-up."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, k, n = SHAPE
        g = torch.Generator().manual_seed(0)
        a = torch.randn(m, k, generator=g).to(getattr(torch, dtype))
        b = torch.randn(k, n, generator=g).to(getattr(torch, dtype))
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * m * k * n / best / 1e9


def choose_cpu_dtype(fp32_gflops: float, bf16_gflops: float) -> tuple[str, str]:
    """(dtype, why) from one thread's matmul rates."""
    speedup = bf16_gflops / fp32_gflops
    rates = f"a bf16 matmul at {bf16_gflops:.1f} GFLOPS, fp32 at {fp32_gflops:.1f}: {speedup:.2f}x"
    if speedup >= BF16_MIN_SPEEDUP:
        return "bfloat16", f"this processor computes bf16 fast ({rates})"
    return "float32", f"this processor has no fast bf16 ({rates}; bfloat16 from {BF16_MIN_SPEEDUP}x)"


# what holds torch's math libraries to fewer instructions than the processor has (bf16 among them)
ISA_KNOBS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def processor_key() -> str:
    """The processor's model and flags, torch's version and the ISA_KNOBS set: what the measurement depends on."""
    import hashlib

    import torch

    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    except OSError:   # not Linux: the platform's own name
        import platform

        model = platform.processor() or platform.machine()
    what = json.dumps([model, sorted(flags.split()), torch.__version__] +
                      [f"{k}={os.environ[k]}" for k in ISA_KNOBS if os.environ.get(k)])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def cpu_compute_dtype(cache_dir: str | os.PathLike | None = None, measure=matmul_gflops) -> tuple[str, str]:
    """(dtype, why) for this processor: measured once per machine and cached (`measure(dtype) -> GFLOPS`)."""
    from dflash_ray.atomic import write_json_atomic
    from dflash_ray.machine_cache import cache_root

    path = Path(cache_dir or cache_root() / "processor") / f"{processor_key()}.json"
    try:
        rates = json.loads(path.read_text())
        fp32, bf16 = float(rates["float32"]), float(rates["bfloat16"])
    except (OSError, ValueError, KeyError, TypeError):   # not measured yet, or an unreadable record
        fp32, bf16 = measure("float32"), measure("bfloat16")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"float32": fp32, "bfloat16": bf16, "shape": list(SHAPE)})
        except OSError:
            pass      # a read-only cache: measured again next time
    dtype, why = choose_cpu_dtype(fp32, bf16)
    return dtype, f"{why}, measured once: {path}"
