"""`dflash-ray plot [RUN_DIR]`: PNGs of a run from its metrics.jsonl and ledger.jsonl.

    plots/loss.png               loss (and the measured tau on training blocks) over optimizer steps
    plots/heldout_tau.png        loss and held-out tau over steps: the fresh drafter at step 0, every evaluation
                                 during training (train.heldout_every), the trained drafter at the end
    plots/tokens_per_second.png  trained tokens per second over steps
    plots/buckets.png            the length bucket of every batch of every step, as a strip
"""
from __future__ import annotations

from pathlib import Path

from dflash_ray.errors import UserError


def plot_run(run_dir, out_dir=None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from dflash_ray.run_layout import RunLayout
    from dflash_ray.runtime.record.ledger import read_jsonl
    from dflash_ray.runtime.record.record import last_metrics

    run_dir = Path(run_dir)
    files = RunLayout(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: run directory does not exist")
    metrics = last_metrics(run_dir)
    if not metrics:
        raise UserError(f"{files.metrics}: no metrics (has this run trained a step?)")
    out = Path(out_dir) if out_dir else files.plots
    out.mkdir(parents=True, exist_ok=True)
    steps = np.array([m["step"] for m in metrics])
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [m["loss"] for m in metrics], label="loss", color="tab:blue")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (weighted CE)")
    tau = [m.get("train_tau") for m in metrics]
    if any(a is not None for a in tau):
        ax2 = ax.twinx()
        ax2.plot(steps, [np.nan if a is None else a for a in tau], color="tab:green", alpha=0.7,
                 label="tau on training blocks (measured)")
        evals = read_jsonl(files.evals)
        if evals:
            ax2.plot([e["step"] for e in evals], [e["tau"] for e in evals], "o-", color="tab:red",
                     label="held-out tau (speculative decoding)")
        ax2.set_ylabel("tau", color="tab:green")
        ax2.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{run_dir.name}: loss")
    fig.tight_layout()
    paths.append(out / "loss.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    curve = heldout_curve(run_dir, int(steps[-1]))
    if curve:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(steps, [m["loss"] for m in metrics], color="tab:blue", lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (weighted CE)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in curve], [t for _, t in curve], "o-", color="tab:red")
        ax2.set_ylabel("held-out tau (speculative decoding)", color="tab:red")
        ax2.set_ylim(bottom=min(1.0, min(t for _, t in curve)))
        ax.set_title(f"{run_dir.name}: loss and held-out tau")
        fig.tight_layout()
        paths.append(out / "heldout_tau.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [m.get("tokens_per_second", 0.0) for m in metrics], color="tab:orange")
    restarts = [m["step"] for a, m in zip(metrics, metrics[1:]) if m.get("attempt", 1) != a.get("attempt", 1)]
    for s in restarts:
        ax.axvline(s, color="red", ls="--", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{run_dir.name}: throughput" + (" (red: restarts)" if restarts else ""))
    fig.tight_layout()
    paths.append(out / "tokens_per_second.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    ledger = read_jsonl(files.ledger)
    if ledger:
        width = max(len(r["buckets"]) for r in ledger)
        strip = np.full((width, len(ledger)), np.nan)
        for j, r in enumerate(ledger):
            for i, b in enumerate(r["buckets"]):
                strip[i, j] = b if b >= 0 else np.nan
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.3 * width))
        im = ax.imshow(strip, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(0.5, len(ledger) + 0.5, width - 0.5, -0.5))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("batch in step")
        ax.set_title(f"{run_dir.name}: length bucket of each batch")
        fig.colorbar(im, ax=ax, label="bucket")
        fig.tight_layout()
        paths.append(out / "buckets.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def heldout_curve(run_dir, last_step: int) -> list[tuple[int, float]]:
    """(step, held-out tau) of a run: the fresh drafter at step 0 and the trained one at `last_step` (summary.json),
    every evaluation during training between them (evals.jsonl); [] when the run measured none."""
    import json

    from dflash_ray.run_layout import RunLayout
    from dflash_ray.runtime.record.ledger import read_jsonl

    files = RunLayout(Path(run_dir))
    points = {int(e["step"]): float(e["tau"]) for e in read_jsonl(files.evals) if e.get("tau") is not None}
    try:
        tau = json.loads(files.summary.read_text()).get("heldout_tau") or {}
    except (OSError, ValueError):
        tau = {}
    if (tau.get("initial") or {}).get("tau") is not None:
        points[0] = float(tau["initial"]["tau"])
    if (tau.get("trained") or {}).get("tau") is not None:
        points[last_step] = float(tau["trained"]["tau"])
    return sorted(points.items())
