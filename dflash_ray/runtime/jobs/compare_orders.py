"""`dflash-ray compare-orders [overrides]`: the seed run's batch-order experiment, reproduced.

The same drafter (same data, target, seed, hence the same initial weights and the same batches in each
epoch) is trained once per interleaving strategy with the same budget; only the order of the batches
differs. Side by side: final training loss, held-out tau, loss roughness, how evenly each quarter of
the epoch held each bucket, and where each bucket ran out. Two PNGs: the loss curves, the bucket strips.

Loss roughness: the mean absolute step-to-step change of the training loss, and the mean absolute
residual around its centred moving average (window 9): a "fluffy" curve scores high on both.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_ray.data.interleave import STRATEGIES


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


def compare_orders(cfg, overrides: list[str], *, log=print, strategies=STRATEGIES) -> dict:
    """Train once per strategy (runs named <run.name>-order-<strategy>) on the data, target and seed of
    the base config; returns the table's rows and writes the PNGs under <run.dir>-orders/."""
    from omegaconf import OmegaConf

    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import make_demo_inputs, make_missing_inputs
    from dflash_ray.runtime.cluster import ray_cluster
    from dflash_ray.runtime.record.layout import RunLayout
    from dflash_ray.runtime.record.ledger import read_jsonl
    from dflash_ray.runtime.record.record import last_metrics
    from dflash_ray.runtime.spec import resolve_spec
    from dflash_ray.train import main_job

    out_dir = Path(str(cfg.run.dir) + "-orders")
    rows = {}
    with ray_cluster(OmegaConf.to_object(cfg.cluster), log=log):
        # the data, target and held-out prompts every run shares (each run checks its own record, not the base's)
        make_demo_inputs(cfg, log=log)
        make_missing_inputs(cfg, log=log)
        base = resolve_spec(cfg, log=log, record=False)
        shared = [f"data.input={cfg.data.input}", f"data.tokenizer={base.tokenizer}", f"data.shards={base.shards}",
                  f"model.target_path={base.target_path}"]
        if base.heldout:
            shared.append(f"data.prompts={base.heldout}")
        for strategy in strategies:
            run_cfg = compose_config([*overrides, *shared, f"run.name={cfg.run.name}-order-{strategy}",
                                      f"data.interleave={strategy}"])
            log(f"compare-orders: training with data.interleave={strategy}")
            spec, summary = main_job(run_cfg, progress=False, log=lambda *a, **k: None, plan_log=lambda *a, **k: None)
            metrics = last_metrics(spec.run_dir)
            num_buckets = len(spec.plan.boundaries)
            tau = (summary.get("heldout_tau") or {}).get("trained") or {}
            rows[strategy] = {
                "final_loss": summary["final_loss"], "heldout_tau": tau.get("tau"),
                "losses": [m["loss"] for m in metrics],
                **roughness([m["loss"] for m in metrics]),
                **bucket_usage(read_jsonl(RunLayout(spec.run_dir).ledger), num_buckets),
                "run_dir": spec.run_dir}
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = plot_comparison(rows, out_dir)
    (out_dir / "compare_orders.json").write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk not in ("losses", "buckets_in_order")} for k, v in rows.items()},
        indent=2))
    return {"rows": rows, "pngs": [str(p) for p in pngs], "dir": str(out_dir)}


def format_comparison(rows: dict) -> str:
    lines = [f"{'strategy':>10} {'final loss':>10} {'held-out tau':>12} {'|dloss| mean':>12} {'residual':>9} "
             f"{'max quarter dev':>15} {'first bucket end':>16}"]
    for name, r in rows.items():
        shares = np.asarray(r["quarter_shares_pct"]) if r["quarter_shares_pct"] else np.zeros((1, 1))
        dev = float(np.abs(shares - shares.mean(axis=0)).max())
        ends = [e for e in r["bucket_end_fraction"] if e is not None]
        tau = "-" if r["heldout_tau"] is None else f"{r['heldout_tau']:.2f}"
        lines.append(f"{name:>10} {r['final_loss']:>10.4f} {tau:>12} {r['mean_abs_step_change']:>12.4f} "
                     f"{r['mean_abs_residual']:>9.4f} {dev:>13.1f}pp {min(ends) if ends else float('nan'):>16.3f}")
    return "\n".join(lines)


def plot_comparison(rows: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in rows.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title("the same drafter, data and budget; only the batch order differs")
    fig.tight_layout()
    losses_png = out_dir / "compare_orders_loss.png"
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
    strips_png = out_dir / "compare_orders_buckets.png"
    fig.savefig(strips_png, dpi=100)
    plt.close(fig)
    return [losses_png, strips_png]
