"""The first command a newcomer runs, timed: `dflash-ray train` on its embedded default, as
./scripts/run-default.sh runs it (packages installed), three times in one go:

    quiet    a cold machine cache (the demo world built: corpus, tokenizer, target trained, regenerated),
             nothing else running
    busy     the same, cold again, beside one CPU-bound process this script starts and stops (a busy loop)
    second   quiet, another run.name, the demo world cached by the quiet run: how soon it trains

    python benchmarks/bench_first_run.py                 # about 25 minutes on two cores
    python benchmarks/bench_first_run.py --runs quiet second
    python benchmarks/bench_first_run.py --json out.json -- train.epochs=1   # overrides after --

Prints the job's phases (summary.json "phases", seconds) for each run side by side, the wall time of each
command (process start to exit), busy / quiet, the second run's first step (seconds from its launch to
the first step's metrics line) and the held-out tau of each run. Goals: quiet <= 240 s,
busy <= 2x quiet, second run's first step <= 60 s, tau >= 4.0; each printed PASS or FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"quiet_s": 240.0, "busy_over_quiet": 2.0, "second_first_step_s": 60.0, "tau": 4.0}


def run_job(name: str, root: Path, cache: Path, overrides: list[str], busy: bool) -> dict:
    """One `dflash-ray train` in a fresh process; its wall time, summary and first step's time."""
    exe = Path(sys.executable).parent / "dflash-ray"
    cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "dflash_ray"]),
           "train", f"run.root={root}", f"run.name={name}", *overrides]
    env = {**os.environ, "DFLASH_RAY_CACHE": str(cache), "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    log = root / f"{name}.log"
    try:
        t0 = time.time()
        with open(log, "w") as out:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        wall = time.time() - t0
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if rc != 0:
        raise SystemExit(f"{name}: dflash-ray train exited {rc}; its output: {log}")
    run = root / name
    summary = json.loads((run / "summary.json").read_text())
    with open(run / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    tau = (summary.get("heldout_tau") or {}).get("trained", {}).get("tau")
    return {"wall_s": round(wall, 1), "first_step_s": round(first["time"] - t0, 1), "tau": tau,
            "phases": summary["phases"], "steps": summary["steps"], "log": str(log)}


def table(results: dict) -> str:
    names = list(results)
    phases = []
    for r in results.values():
        for p in r["phases"]:
            if p["phase"] not in phases:
                phases.append(p["phase"])
    lines = [f"{'phase (s)':<40}" + "".join(f"{n:>10}" for n in names)]
    for ph in phases:
        depth = ph.count("/")
        label = "  " * depth + ph.rsplit("/", 1)[-1]
        cells = []
        for n in names:
            v = next((p["seconds"] for p in results[n]["phases"] if p["phase"] == ph), None)
            cells.append(f"{v:>10.1f}" if v is not None else f"{'-':>10}")
        lines.append(f"{label:<40}" + "".join(cells))
    for key, label in (("wall_s", "command wall time"), ("first_step_s", "first step after launch"),
                       ("steps", "steps"), ("tau", "held-out tau, trained")):
        lines.append(f"{label:<40}" + "".join(
            f"{results[n][key]:>10.2f}" if isinstance(results[n][key], float) else f"{results[n][key]!s:>10}"
            for n in names))
    return "\n".join(lines)


def goals(results: dict) -> list[str]:
    out = []

    def line(ok, text):
        out.append(f"{'PASS' if ok else 'FAIL'}  {text}")
    if "quiet" in results:
        q = results["quiet"]["wall_s"]
        line(q <= GOALS["quiet_s"], f"quiet, cold cache: {q:.0f} s <= {GOALS['quiet_s']:.0f} s")
        if "busy" in results:
            ratio = results["busy"]["wall_s"] / q
            line(ratio <= GOALS["busy_over_quiet"], f"busy / quiet: {ratio:.2f} <= {GOALS['busy_over_quiet']:.1f}")
    if "second" in results:
        s = results["second"]["first_step_s"]
        line(s <= GOALS["second_first_step_s"], f"second run's first step: {s:.0f} s <= {GOALS['second_first_step_s']:.0f} s")
    for n, r in results.items():
        if r["tau"] is not None:
            line(r["tau"] >= GOALS["tau"], f"{n}: held-out tau {r['tau']:.2f} >= {GOALS['tau']}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["quiet", "busy", "second"], choices=["quiet", "busy", "second"])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", help="run directories and caches here (default: a temporary directory, removed)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-first-run-") as tmp:
        root = Path(a.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = {}
        for name in a.runs:
            cache = root / ("cache-busy" if name == "busy" else "cache-quiet")
            if name == "second" and "quiet" not in a.runs:
                run_job("warm-up", root, cache, a.overrides, busy=False)   # the world the second run finds
            print(f"{name} ...", file=sys.stderr, flush=True)
            results[name] = run_job(name, root, cache, a.overrides, busy=name == "busy")
        print(f"\n`dflash-ray train` (embedded default{', ' + ' '.join(a.overrides) if a.overrides else ''}), "
              f"{os.cpu_count()} CPUs\n")
        print(table(results))
        print()
        print("\n".join(goals(results)))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
