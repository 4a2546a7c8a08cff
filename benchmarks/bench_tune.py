"""A 4-trial sweep (two learning rates x two anchor counts) on Ray Tune against the same four configs trained
one after the other with `dflash-ray train`, as a user would by hand, on the embedded default's demo world.

    .venv/bin/python benchmarks/bench_tune.py --steps 150 --json benchmarks/results/tune_2cpu_<date>.json

Runs, in one invocation on the same machine: the four `train` runs (each its own command and local Ray, the
target computing its features in every run, as train.features=online, the default); `tune` with
--scheduler none (the same work: every trial to its last step, the target's features computed once before
the trials and read by all); `tune` with ASHA on held-out tau (what a user runs: hopeless trials stopped).
Prints the wall time of each, the target's computed tokens (the pass's and every run's target actors') and
the steps trained, and the ratios from this run. On a machine of two cores the trials run one at a time
(--max-concurrent 1); on a cluster they run side by side as its free resources allow.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LRS = ("3e-3", "1.5e-3")
ANCHORS = ("null", "16")


def cli(args: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "dflash_ray", *args], stdout=f, stderr=subprocess.STDOUT).returncode
    if rc not in (0,):
        raise SystemExit(f"{' '.join(args[:3])}... exited {rc}: see {log}")
    return time.perf_counter() - t0


def run_counts(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    return {"steps": s["steps"], "target_tokens": sum(a["tokens"] for a in s["target_actors"].values()),
            "tau": ((s.get("heldout_tau") or {}).get("trained") or {}).get("tau"), "final_loss": s["final_loss"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/dflash-ray-bench-tune")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--heldout-every", type=int, default=50)
    ap.add_argument("--json", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    common = [f"run.root={root}", f"train.max_steps={args.steps}", f"train.heldout_every={args.heldout_every}",
              f"train.checkpoint_every={args.steps}"]
    settings = [(lr, a) for lr in LRS for a in ANCHORS]
    out = {"args": vars(args), "settings": settings, "commit": subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(), "machine": os.uname().nodename}

    seq = {"seconds": 0.0, "runs": []}
    for i, (lr, a) in enumerate(settings):
        name = f"seq-{i}"
        seq["seconds"] += cli(["train", *common, f"run.name={name}", f"train.lr={lr}", f"model.anchors_per_batch={a}"],
                              root / f"{name}.log")
        seq["runs"].append(run_counts(root / name))
        print(f"train {lr} {a}: {seq['runs'][-1]}", flush=True)
    seq["target_tokens"] = sum(r["target_tokens"] for r in seq["runs"])
    seq["steps"] = sum(r["steps"] for r in seq["runs"])
    out["sequential"] = seq

    for scheduler in ("none", "asha"):
        name = f"sweep-{scheduler}"
        seconds = cli(["tune", f"train.lr={','.join(LRS)}", f"model.anchors_per_batch={','.join(ANCHORS)}",
                       "--scheduler", scheduler, "--max-concurrent", "1", *common, f"run.name={name}"],
                      root / f"{name}.log")
        summary = json.loads((root / f"{name}-tune" / "summary.json").read_text())
        pass_tokens = sum(n["computed_tokens"] for p in summary["feature_passes"] for n in p["nodes"])
        trial_tokens, steps = 0, 0
        for r in summary["rows"]:
            steps += r["step"] or 0
            f = Path(r["run_dir"]) / "summary.json"
            if f.exists():
                trial_tokens += run_counts(Path(r["run_dir"]))["target_tokens"]
        out[name] = {"seconds": seconds, "pass_tokens": pass_tokens, "trial_target_tokens": trial_tokens,
                     "target_tokens": pass_tokens + trial_tokens, "steps": steps,
                     "statuses": [r["status"] for r in summary["rows"]],
                     "best": {k: summary["best"][k] for k in ("trial", "tau", "loss")} if summary["best"] else None}
        print(f"tune --scheduler {scheduler}: {out[name]}", flush=True)

    print(f"\nfour configs ({', '.join(f'lr {lr} anchors {a}' for lr, a in settings)}), {args.steps} steps each, "
          f"the demo world, one at a time\n")
    print("| how | wall s | steps trained | target-computed tokens | wall / sequential |\n|---|---|---|---|---|")
    base = seq["seconds"]
    print(f"| 4 x `train`, one after the other | {base:,.0f} | {seq['steps']} | {seq['target_tokens']:,} | 1.00 |")
    for scheduler in ("none", "asha"):
        r = out[f"sweep-{scheduler}"]
        print(f"| `tune --scheduler {scheduler}` | {r['seconds']:,.0f} | {r['steps']} | {r['target_tokens']:,} "
              f"(pass {r['pass_tokens']:,}) | {r['seconds'] / base:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
