"""Run the tests that assert what a model computes, decodes or learns (pytest marker `rounding`) with the math
libraries held to other instruction sets: a processor other than this one rounds float sums otherwise, and
these settings change the rounding here the way it would (a test that passes only on this processor's
rounding fails under one of them).

    scripts/check-rounding.sh                      # native, avx2 and sse, one after another
    scripts/check-rounding.sh sse -- -x -k regen   # one setting; what follows -- goes to pytest

Each setting is first probed: in a fresh process and in a Ray worker (where the runs' target actors and
trainers compute), torch's CPU capability, oneDNN's ISA line, and the bits of the ops these models use
(matmuls in fp32 and bf16, softmax, SDPA, RMSNorm's rsqrt, SiLU, exp, a seeded normal_ initialisation)
compared with the machine's own. A setting that changes none of them proves nothing and fails the check.
The table at the end says, per setting, what took effect and pytest's last line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# MKL reads MKL_ENABLE_INSTRUCTIONS on Intel processors only; MKL_CBWR=COMPATIBLE (its SSE2 path) holds it on
# any x86 one. oneDNN above its ISA cap reports no bf16, so torch computes bf16 matmuls itself.
SETTINGS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "sse": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
            "MKL_CBWR": "COMPATIBLE"},
}
KNOBS = sorted({k for env in SETTINGS.values() for k in env})


def probe() -> dict:
    """What this process computes with: torch's CPU capability and a digest of each op's result bits."""
    import hashlib

    import torch

    def digest(t) -> str:
        return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:12]

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    q = torch.randn(1, 4, 64, 16, generator=g)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        init = torch.empty(4096).normal_(0, 0.02)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ops = {"matmul fp32": digest(a @ b), "matmul bf16": digest(a.bfloat16() @ b.bfloat16()),
               "softmax": digest(torch.softmax(a, -1)),
               "sdpa": digest(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)),
               "rsqrt(mean x^2)": digest(torch.rsqrt(a.pow(2).mean(-1) + 1e-6)),
               "silu": digest(torch.nn.functional.silu(a)), "exp": digest(a.exp()), "normal_ init": digest(init)}
    finally:
        torch.set_num_threads(threads)
    return {"capability": torch.backends.cpu.get_cpu_capability(), "ops": ops,
            "env": {k: os.environ[k] for k in KNOBS if k in os.environ}}


def _probe_in_ray() -> dict:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=80_000_000, logging_level="ERROR")
    try:
        return ray.get(ray.remote(num_cpus=1)(probe).remote())
    finally:
        ray.shutdown()


def onednn_isa(env: dict) -> str:
    """oneDNN's ISA line for a bf16 matmul under `env`, or why there is none."""
    code = "import torch; torch.randn(64, 64).bfloat16() @ torch.randn(64, 64).bfloat16()"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "ONEDNN_VERBOSE": "1"}, capture_output=True,
                         text=True, timeout=120).stdout
    line = next((x for x in out.splitlines() if ",isa:" in x), None)
    return line.split(",isa:", 1)[1] if line else "not used (torch computes bf16 matmuls itself)"


def probe_setting(name: str) -> dict:
    env = {**os.environ, **SETTINGS[name]}
    # on the path of the probe's process and of the Ray workers it starts (they import `probe` by name)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), env.get("PYTHONPATH")]))
    code = "import json, rounding; print(json.dumps({'process': rounding.probe(), 'ray worker': rounding._probe_in_ray()}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit(f"the probe failed under {name}: {out.stderr.strip().splitlines()[-1:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return {**found, "onednn": onednn_isa(env)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/check-rounding.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("settings", nargs="*", default=list(SETTINGS), help=f"of {', '.join(SETTINGS)} (default: all)")
    ap.add_argument("--probe-only", action="store_true", help="probe the settings, run no test")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        print(f"scripts/check-rounding.sh: unknown setting {unknown[0]!r} (one of {', '.join(SETTINGS)})", file=sys.stderr)
        return 2

    native = probe_setting("native")
    rows, failed = [], False
    for name in args.settings:
        found = native if name == "native" else probe_setting(name)
        proc, worker = found["process"], found["ray worker"]
        changed = [op for op, d in proc["ops"].items() if d != native["process"]["ops"][op]]
        took = f"capability {proc['capability']}; oneDNN {found['onednn']}; " + (
            f"rounds otherwise: {', '.join(changed)}" if changed else "rounds as native")
        print(f"[{name}] {' '.join(f'{k}={v}' for k, v in SETTINGS[name].items()) or '(nothing set)'}: {took}",
              flush=True)
        if worker != proc:
            print(f"[{name}] a Ray worker computes otherwise than its driver: {worker}", flush=True)
            failed = True
        if name != "native" and not changed:
            print(f"[{name}] changes no op's rounding on this processor: it proves nothing", flush=True)
            rows.append((name, took, "not run: the setting changes nothing here", 0.0))
            failed = True
            continue
        if args.probe_only:
            rows.append((name, took, "probed only", 0.0))
            continue
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "rounding", "-p", "no:cacheprovider", *extra]
        run = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **SETTINGS[name]}, capture_output=True, text=True)
        lines = [x for x in run.stdout.splitlines() if x.strip()]
        if run.returncode:
            print("\n".join(lines[-40:]), flush=True)
            failed = True
        rows.append((name, took, lines[-1] if lines else f"pytest exited {run.returncode}", time.time() - t0))
        print(f"[{name}] {rows[-1][2]}", flush=True)

    print("\n| setting | what took effect | pytest -m rounding | s |\n|---|---|---|---|")
    for name, took, last, secs in rows:
        print(f"| {name} | {took} | {last.strip('= ')} | {secs:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
