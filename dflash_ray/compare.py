"""`dflash-ray compare KEY=V1,V2[,...] [overrides]`: one knob's values, trained side by side.

The same drafter (same data, target, seed, hence the same initial weights) is trained once per value of
KEY with everything else equal. More keys with as many values each (`KEY2=W1,W2` among the overrides:
any override with two values or more) move together, run i taking every key's i-th value (a knob made of
two keys, e.g. thinning = model.anchors_per_batch=32 with model.max_block_tokens_per_batch=null); `compare-orders` is its first use (KEY data.interleave: the seed run's
batch-order experiment). Side by side: final training loss, held-out tau (after training: at equal
target tokens, as every run trains the same epochs), held-out tau at equal training time (the in-training
evaluations, train.heldout_every, of each run at the shortest run's training time), context tokens and
trained block tokens (the density), training seconds, loss roughness, how evenly each quarter of the
epoch held each bucket, and where each bucket ran out. Two PNGs: the loss curves, the bucket strips.

Loss roughness: the mean absolute step-to-step change of the training loss, and the mean absolute
residual around its centred moving average (window 9): a "fluffy" curve scores high on both.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_ray.data.interleave import STRATEGIES
from dflash_ray.search_space import split_values


def roughness(losses, window: int = 9) -> dict:
    x = np.asarray(losses, dtype=np.float64)
    if x.size < 2:
        return {"mean_abs_step_change": 0.0, "mean_abs_residual": 0.0}
    w = min(window, x.size)
    pad = np.pad(x, (w // 2, w - 1 - w // 2), mode="edge")
    smooth = np.convolve(pad, np.ones(w) / w, mode="valid")
    return {"mean_abs_step_change": float(np.abs(np.diff(x)).mean()),
            "mean_abs_residual": float(np.abs(x - smooth).mean())}


def bucket_usage(ledger: list[dict], num_buckets: int) -> dict:
    """From the ledger of epoch 0 (in training order): the bucket of each batch, each quarter's share of
    each bucket (percent) and, per bucket, the fraction of the epoch's batches trained when its last
    batch was."""
    buckets = [b for r in ledger if int(r["epoch"]) == 0 for b in r["buckets"] if b >= 0]
    n = len(buckets)
    if n == 0:
        return {"buckets_in_order": [], "quarter_shares_pct": [], "bucket_end_fraction": [None] * num_buckets}
    seq = np.asarray(buckets)
    quarters = [seq[int(q * n / 4):int((q + 1) * n / 4)] for q in range(4)]
    shares = [[round(100.0 * float((part == b).mean()), 1) if part.size else 0.0 for b in range(num_buckets)]
              for part in quarters]
    ends = [float((np.nonzero(seq == b)[0].max() + 1) / n) if (seq == b).any() else None for b in range(num_buckets)]
    return {"buckets_in_order": buckets, "quarter_shares_pct": shares, "bucket_end_fraction": ends}


def parse_sweep(sweep: str) -> tuple[str, list[str]]:
    """KEY=V1,V2[,...] -> (KEY, [V1, V2, ...]); one line naming what is wrong otherwise."""
    from dflash_ray.errors import UserError

    key, eq, values = sweep.partition("=")
    vals = split_values(values) if eq else []
    if not key or not eq or len(vals) < 2 or any(v == "" for v in vals):
        raise UserError(f"compare: expected KEY=V1,V2[,...] (two values at least), got '{sweep}'")
    if key.startswith(("run.", "+", "~")) or "/" in key:
        raise UserError(f"compare: '{key}' cannot be compared (the runs are named by compare itself)")
    return key, vals


def take_sweeps(sweep: str, overrides: list[str]) -> tuple[dict, list[str]]:
    """({key: values} of the sweep and of every override with two values or more, in order; the other
    overrides). Every swept key has as many values as the first."""
    from dflash_ray.errors import UserError

    key, values = parse_sweep(sweep)
    sweeps, rest = {key: values}, []
    for o in overrides:
        k, eq, v = o.partition("=")
        if eq and not k.startswith(("+", "~")) and len(split_values(v)) > 1:
            k, vals = parse_sweep(o)
            if k in sweeps:
                raise UserError(f"compare: '{k}' is swept twice")
            if len(vals) != len(values):
                raise UserError(f"compare: '{k}' has {len(vals)} values and '{key}' {len(values)}: keys swept "
                                "together need as many values each (run i takes every key's i-th)")
            sweeps[k] = vals
        else:
            rest.append(o)
    runs = list(zip(*sweeps.values()))
    if len(set(runs)) != len(runs):
        raise UserError(f"compare: a run is given twice ({', '.join(sweeps)} = {', '.join(runs[0])} ...): each "
                        "run needs its own values")
    return sweeps, rest


def run_label(key: str, value: str) -> str:
    """A run name's part for KEY=VALUE: the key's last part and the value, filesystem-safe."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{key.rsplit('.', 1)[-1]}-{value}").strip("_")


def compare(cfg, sweeps: dict, overrides: list[str], *, log=print, out_suffix: str = "-compare",
            json_name: str = "compare.json") -> dict:
    """Train once per value of the swept keys ({key: values}, run i with every key's i-th value; runs named
    <run.name>-<key's leaf>-<value>...) on the data, target and seed of the base config; returns the
    table's rows and writes the JSON and PNGs under <run.dir><out_suffix>/. The runs are a grid sweep on
    Ray Tune (sweep.py) with no early stopping: side by side where the cluster holds more than one run,
    resumed by a rerun of the same command."""
    from dflash_ray.config import compose_config
    from dflash_ray.run_layout import RunLayout
    from dflash_ray.runtime.record.ledger import read_jsonl
    from dflash_ray.runtime.record.record import last_metrics
    from dflash_ray.errors import UserError
    from dflash_ray.sweep import SweepOptions, sweep, tau_curve, train_seconds

    keys = list(sweeps)
    key = " / ".join(keys)
    runs = [[f"{k}={sweeps[k][i]}" for k in keys] for i in range(len(sweeps[keys[0]]))]
    base_overrides = [o for o in overrides if not o.startswith(("run.name=", *(f"{k}=" for k in keys)))]
    for setting in runs:   # every value composes before anything trains (a typo fails in one line, at once)
        compose_config([*base_overrides, *setting])
    names = [f"{cfg.run.name}-" + "-".join(run_label(*x.split("=", 1)) for x in setting) for setting in runs]
    out_dir = Path(str(cfg.run.dir) + out_suffix)
    # each run as configured (train.features too: a comparison trains what the user asked, nothing shared)
    result = sweep(cfg, [], base_overrides, SweepOptions(metric="loss", scheduler="none"), log=log,
                   settings=runs, names=names, out_suffix=out_suffix, features=False)
    for r in result["rows"]:
        if r["status"] != "finished":
            raise UserError(f"compare: the run with {r['setting']} {r['status']}: {r['error'] or 'see ' + r['run_dir']}")
    rows = {}
    for setting, r in zip(runs, sorted(result["rows"], key=lambda r: names.index(r["trial"]))):
        value = " / ".join(x.partition("=")[2] for x in setting)
        files = RunLayout(r["run_dir"])
        summary = json.loads(files.summary.read_text())
        metrics = last_metrics(r["run_dir"])
        tau = (summary.get("heldout_tau") or {}).get("trained") or {}
        rows[value] = {
            "final_loss": summary["final_loss"], "heldout_tau": tau.get("tau"),
            "tokens": summary["tokens"], "block_tokens": summary.get("block_tokens"),
            "block_tokens_per_token": summary.get("block_tokens_per_token"),
            "train_seconds": train_seconds(metrics),
            "tau_curve": tau_curve(metrics, read_jsonl(files.evals) if files.evals.exists() else []),
            "losses": [m["loss"] for m in metrics],
            **roughness([m["loss"] for m in metrics]),
            **bucket_usage(read_jsonl(files.ledger), len(summary["plan"]["order"]["counts"])),
            "run_dir": r["run_dir"]}
    equal_time(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = plot_comparison(rows, out_dir, f"the same drafter, data and seed; only {key} differs", out_dir.name)
    (out_dir / json_name).write_text(json.dumps({"key": key, "keys": keys,
                                                 "runs": {k: report_row(v) for k, v in rows.items()}},
                                                indent=2))
    return {"key": key, "rows": rows, "pngs": [str(p) for p in pngs], "dir": str(out_dir)}


def report_row(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("losses", "buckets_in_order")}


def equal_time(rows: dict) -> None:
    """tau at the shortest run's training time T: the shortest run's final tau, and for each other run the
    latest in-training evaluation at or before T (None when it had none by then: set train.heldout_every)."""
    if not rows:
        return
    t_min = min(r["train_seconds"] for r in rows.values())
    for r in rows.values():
        r["equal_time_seconds"] = t_min
        if r["train_seconds"] <= t_min:
            r["tau_at_equal_time"] = r["heldout_tau"]
            continue
        before = [p for p in r["tau_curve"] if p["train_seconds"] <= t_min]
        r["tau_at_equal_time"] = before[-1]["tau"] if before else None


def compare_orders(cfg, overrides: list[str], *, log=print, strategies=STRATEGIES) -> dict:
    """The batch-order experiment: compare over data.interleave (runs <run.name>-interleave-<strategy>,
    report under <run.dir>-orders/)."""
    return compare(cfg, {"data.interleave": list(strategies)}, overrides, log=log, out_suffix="-orders",
                   json_name="compare_orders.json")


def format_comparison(rows: dict, key: str = "data.interleave") -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    t_eq = next(iter(rows.values())).get("equal_time_seconds") if rows else None
    width = max([len(key)] + [len(v) for v in rows])
    lines = [f"{key:>{width}} {'final loss':>10} {'tau':>6} {'tau@time':>8} {'tokens':>9} {'block tok':>10} "
             f"{'blk/ctx':>7} {'train s':>8} {'|dloss|':>8} {'residual':>8} {'quarter dev':>11} {'1st end':>7}"]
    for name, r in rows.items():
        shares = np.asarray(r["quarter_shares_pct"]) if r["quarter_shares_pct"] else np.zeros((1, 1))
        dev = float(np.abs(shares - shares.mean(axis=0)).max())
        ends = [e for e in r["bucket_end_fraction"] if e is not None]
        lines.append(f"{name:>{width}} {r['final_loss']:>10.4f} {num(r['heldout_tau'], '.2f'):>6} "
                     f"{num(r.get('tau_at_equal_time'), '.2f'):>8} {r['tokens']:>9,} {num(r.get('block_tokens'), ','):>10} "
                     f"{num(r.get('block_tokens_per_token'), '.2f'):>7} {r['train_seconds']:>8.0f} "
                     f"{r['mean_abs_step_change']:>8.4f} {r['mean_abs_residual']:>8.4f} {dev:>9.1f}pp "
                     f"{min(ends) if ends else float('nan'):>7.3f}")
    lines.append(f"tau: held-out tau after training (at equal target tokens where the runs train the same epochs); "
                 f"tau@time: at equal training time, {num(t_eq, '.0f')} s (the shortest run's; the others' latest "
                 f"in-training evaluation by then, train.heldout_every); quarter dev: the largest gap between a "
                 f"quarter's bucket share and the epoch's; 1st end: where the first bucket ran out")
    return "\n".join(lines)


def plot_comparison(rows: dict, out_dir: Path, title: str, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in rows.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    losses_png = out_dir / f"{_png_stem(stem)}_loss.png"
    fig.savefig(losses_png, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 0.9 * len(rows) + 0.8), squeeze=False)
    k = max((max(r["buckets_in_order"], default=0) for r in rows.values()), default=0) + 1
    for ax, (name, r) in zip(axes[:, 0], rows.items()):
        strip = np.asarray(r["buckets_in_order"] or [0])[None, :]
        ax.imshow(strip, aspect="auto", cmap=plt.get_cmap("tab10", max(k, 2)), vmin=-0.5, vmax=max(k, 2) - 0.5,
                  interpolation="nearest")
        ax.set_yticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
    axes[-1, 0].set_xlabel("batch of epoch 0, in training order (colour = length bucket)")
    fig.tight_layout()
    strips_png = out_dir / f"{_png_stem(stem)}_buckets.png"
    fig.savefig(strips_png, dpi=100)
    plt.close(fig)
    return [losses_png, strips_png]


def _png_stem(dir_name: str) -> str:
    """compare_orders for the order experiment (its names since it existed), compare otherwise."""
    return "compare_orders" if dir_name.endswith("-orders") else "compare"
