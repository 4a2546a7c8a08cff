"""What the data commands print: `plan` and `order-stats` tables and plots, `prepare`'s drops, and the
progress of a long phase (prepare, eval) on stderr. The handlers are in cli.py."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from dflash_ray.data.interleave import order_measures


def format_measures(m: dict, name: str = "") -> str:
    hist = m["run_length_hist"]
    runs = ", ".join(f"{k}:{v}" for k, v in sorted(hist.items())[:6]) + (" ..." if len(hist) > 6 else "")
    last = ", ".join("-" if x is None else f"{x:.4f}" for x in m["last_batch_fraction"])
    unit = m.get("unit", "batches")   # steps when a step's batches come from one bucket (data/plan.py step_order)
    head = f"order{(' (' + name + ')') if name else ''}: {m['batches']} {unit}\n"
    return head + "\n".join([
        f"  quarter share, max deviation from global share : {m['quarter_max_dev_pp']:.3f} pp",
        f"  prefix discrepancy ({unit.split()[0]})".ljust(50) + f": {m['prefix_discrepancy']:.2f}",
        f"  longest same-bucket run (least possible)        : {m['longest_run']} ({m['least_possible_longest_run']})",
        f"  {unit.split()[0]} in runs of 1".ljust(50) + f": {100 * m['fraction_in_runs_of_1']:.1f}%",
        f"  run-length histogram (length:runs)              : {runs}",
        f"  last batch of each bucket (fraction of epoch)   : {last}",
    ])


def format_plan(s: dict) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    la = s["attention_tokens"]
    lines = [f"epoch {s['epoch']} plan (seed {s['seed']}, strategy {s['strategy']}): "
             f"{s['batches']} batches, {s['tokens']} tokens",
             f"budgets per batch: target {s['max_tokens_per_batch']} padded tokens"
             + (f" (rows weighted by attention: a row of L tokens costs L x (1 + L / {la:,.0f}))" if la else "")
             + f"; drafter {drafter_budget(s)}"]
    c = s["samples"]
    lines.append(f"samples: {c['in']} in, {c['kept']} planned, {c['truncated']} truncated, "
                 f"{c['dropped_overlong']} dropped (over the last boundary), {c['dropped_too_short']} dropped "
                 f"(too short), {c.get('dropped_unsupervised', 0)} dropped (fewer than 2 supervised tokens)")
    lines.append(f"{'bucket':>6} {'tokens/sample':>13} {'samples':>9} {'batches':>8} {'tokens':>12} {'share':>7} "
                 f"{'padding eff':>11} | {'rows':>5} {'target fill':>11} {'target cost':>11} | "
                 f"{'anchors':>7} {'block tokens':>12} {'drafter fill':>12} {'density':>7} {'blk/ctx':>7}")
    for r in s["buckets"]:
        lines.append(f"{r['bucket']:>6} {r['range']:>13} {r['samples']:>9} {r['batches']:>8} {r['tokens']:>12} "
                     f"{100 * r['share']:>6.1f}% {num(r['padding_efficiency'], '.3f'):>11} | "
                     f"{num(r['rows_per_batch'], '.1f'):>5} {num(r['target_fill'], '.3f'):>11} "
                     f"{num(r['target_cost'], '.3f'):>11} | {num(r['anchors_per_batch'], '.0f'):>7} "
                     f"{num(r['block_tokens_per_batch'], '.0f'):>12} {num(r['drafter_fill'], '.3f'):>12} "
                     f"{num(r['anchor_density'], '.3f'):>7} {num(r['block_tokens_per_token'], '.2f'):>7}")
    lines.append(f"padding efficiency (real / padded batch tokens): {s['padding_efficiency']:.4f}")
    lines.append(f"per-batch work, max/min over buckets: target {num(s['target_cost_max_over_min'], '.2f')} "
                 f"(target cost: relative to the mean batch), drafter {num(s['drafter_block_tokens_max_over_min'], '.2f')} "
                 f"(block tokens); density = anchors trained / valid anchors (supervised tokens - 1, at most "
                 f"{s['num_anchors']} a row); blk/ctx = block tokens trained per context token")
    lines.append(f"drafter work: {s['block_tokens']:,} block tokens for {s['tokens']:,} context tokens = "
                 f"{s['block_tokens_per_token']:.2f} block tokens per context token, anchor density "
                 f"{s['anchor_density']:.3f}")
    lines.append(format_measures(s["order"]))
    return "\n".join(lines)


def drafter_budget(s: dict) -> str:
    """The drafter's side of a batch in words: the plan's block-token budget, the thinning cap, or none."""
    parts = []
    if s.get("max_block_tokens_per_batch"):
        parts.append(f"{s['max_block_tokens_per_batch']:,} block tokens (every valid anchor up to "
                     f"{s['num_anchors']} a row; short rows: fewer rows a batch)")
    if s["anchors_per_batch"]:
        parts.append(f"thinned to {s['anchors_per_batch']} anchors x block {s['block_size']} = "
                     f"{s['anchors_per_batch'] * s['block_size']:,} block tokens (model.anchors_per_batch)")
    return "; ".join(parts) if parts else f"no bound beyond {s['num_anchors']} anchors a row"


def compare_table(measures: dict) -> str:
    rows = [f"{'strategy':>10} {'quarter dev pp':>14} {'prefix disc':>11} {'longest run':>11} "
            f"{'runs of 1':>9} {'first bucket to end':>19}"]
    for n, m in measures.items():
        rows.append(f"{n:>10} {m['quarter_max_dev_pp']:>14.3f} {m['prefix_discrepancy']:>11.2f} "
                    f"{m['longest_run']:>11} {100 * m['fraction_in_runs_of_1']:>8.1f}% {m['earliest_bucket_end']:>19.4f}")
    return "\n".join(rows)


def plot_orders(orders: dict, counts: list[int], path: str) -> None:
    """Per strategy: the bucket of each batch along the epoch, how much of each bucket is used up by each
    point of the epoch (the diagonal is the ideal: buckets run out together), and the run lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(counts)
    fig, axes = plt.subplots(len(orders), 3, figsize=(15, 1.9 * len(orders) + 0.8),
                             gridspec_kw={"width_ratios": [3, 1.2, 1]}, squeeze=False)
    cmap = plt.get_cmap("tab10", max(k, 2))
    for row, (name, order) in enumerate(orders.items()):
        n = order.size
        step = max(1, n // 2000)  # show every step-th batch: one pixel column each
        ax = axes[row][0]
        ax.imshow(order[::step][None, :], aspect="auto", cmap=cmap, vmin=-0.5, vmax=k - 0.5,
                  interpolation="nearest", extent=[0, n, 0, 1])
        ax.set_yticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=11)
        ax = axes[row][1]
        x = np.arange(1, n + 1)
        for b in range(k):
            if counts[b]:
                used = np.cumsum(order == b) / counts[b]
                ax.plot(x[::step] / n, used[::step], color=cmap(b), lw=1)
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.tick_params(labelsize=7)
        m = order_measures(order, k)
        hist = m["run_length_hist"]
        lengths = sorted(hist)[:12]
        axes[row][2].bar([str(v) for v in lengths], [hist[v] for v in lengths], color="gray")
        axes[row][2].set_yscale("log")
        axes[row][2].tick_params(labelsize=7)
        axes[row][2].set_title(f"runs by length (longest {m['longest_run']})", fontsize=8)
    axes[0][0].set_title("bucket of each batch along the epoch (colour = bucket)", fontsize=9)
    axes[0][1].set_title("share of each bucket used vs share of epoch", fontsize=9)
    axes[-1][0].set_xlabel("position in the epoch (batches)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- prepare's drops
DROPS = {  # prepare's drop reasons, as a sentence says them ({min}: the supervised-token threshold)
    "no_assistant_turn": "conversations without an assistant turn",
    "no_trusted_assistant_turn": "conversations whose assistant turns all have untrusted masks",
    "assistant_turns_over_1023": "rows past a conversation's 1023rd assistant turn (sample id = conversation x 1024 + turn)",
    "too_few_supervised_tokens": "samples with fewer than {min} supervised tokens",
}


def format_drops(dropped: dict, min_supervised: int | None = None) -> str:
    """prepare's drops in words with their counts, e.g. "samples with fewer than 32 (2 x model.block_size)
    supervised tokens: 3"; "none" when nothing was dropped. `min_supervised`: the threshold prepare
    used, named by its rule alone when not given."""
    rule = "2 x model.block_size" if min_supervised is None else f"{min_supervised} (2 x model.block_size)"
    return ", ".join(f"{DROPS.get(reason, reason).format(min=rule)}: {n}"
                     for reason, n in sorted(dropped.items()) if n) or "none"


# ----------------------------------------------------------------------------- progress
LINE_EVERY_S = 5.0  # off a terminal: a progress line at most this often


def _now() -> float:
    return time.monotonic()


class ProgressCount:
    """A count toward a known total on stderr: a tqdm bar on a terminal; elsewhere (logs, where a redrawn
    bar is noise) a line "desc: n/total unit (p%), elapsed, ETA" at most every LINE_EVERY_S seconds and a
    last one at the end of a phase that printed any. As runtime/progress.py shows training's steps."""

    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool = True):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.n, self.t0 = 0, _now()
        self.last_line, self.printed = self.t0, None   # when and at which count the last line was printed
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=sys.stderr, dynamic_ncols=True)

    def __enter__(self) -> "ProgressCount":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set(self, n: int) -> None:
        """The count is now n."""
        if self.bar is not None:
            self.bar.update(n - self.n)
        self.n = n
        if self.enabled and self.bar is None and n != self.printed and _now() - self.last_line >= LINE_EVERY_S:
            self.print_line()

    def update(self, k: int = 1) -> None:
        self.set(self.n + k)

    def line(self) -> str:
        elapsed = _now() - self.t0
        if not self.total:
            return f"{self.desc}: {self.n} {self.unit}, {elapsed:.0f} s"
        eta = (self.total - self.n) * elapsed / self.n if self.n else float("nan")
        return (f"{self.desc}: {self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%), "
                f"{elapsed:.0f} s, ETA {eta:.0f} s")

    def print_line(self) -> None:
        print(self.line(), file=sys.stderr, flush=True)
        self.last_line, self.printed = _now(), self.n

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.printed is not None and self.printed != self.n:
            self.print_line()   # where the phase ended


class Tracked(list):
    """A list whose iteration reports progress: a ProgressCount over its items, each counted as done when the
    next one is asked for (or the loop ends). For a library that loops over a list once, as tqdm(items) wraps
    an iterable, with the line form off a terminal; it is still the list (len, ==, indexing)."""

    def __init__(self, items, desc: str, unit: str, enabled: bool = True):
        super().__init__(items)
        self.desc, self.unit, self.enabled = desc, unit, enabled

    @property
    def items(self) -> list:
        """The plain list (iterating it reports nothing)."""
        return list(list.__iter__(self))

    def __iter__(self):
        with ProgressCount(len(self), self.desc, self.unit, self.enabled) as progress:
            for item in list.__iter__(self):
                yield item
                progress.update()
