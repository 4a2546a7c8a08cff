"""The driver's progress display: a tqdm bar on a terminal, a line every few seconds in logs (where a
redrawn bar would be noise). Polls the run record; never blocks training."""
from __future__ import annotations

import sys
import threading
import time


class Progress:
    """The driver's progress bar: step/total, tokens/s, loss, ETA (tqdm), failures survived."""

    def __init__(self, record, enabled: bool = True):
        self.record, self.enabled = record, enabled
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.t0, self.s0 = None, 0

    def __enter__(self):
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.enabled:
            self.thread.join(timeout=5)

    def _run(self):
        import ray

        bar, last_line, last_step = None, 0.0, -1
        tty = sys.stderr.isatty()
        while not self.stop.is_set():
            try:
                p = ray.get(self.record.progress.remote(), timeout=10)
            except Exception:
                break
            if p["total_steps"]:
                if tty:
                    bar = self._tqdm(bar, p)
                elif p["step"] != last_step and (time.time() - last_line > 5 or p["step"] == p["total_steps"]):
                    print(self.line(p), file=sys.stderr, flush=True)
                    last_line, last_step = time.time(), p["step"]
            self.stop.wait(1.0)
        # the run's end: its last step, which the last poll may have missed (a log then ended one short)
        try:
            p = ray.get(self.record.progress.remote(), timeout=10)
        except Exception:
            p = None
        if bar is not None:
            if p is not None:
                bar = self._tqdm(bar, p)
            bar.close()
        elif p is not None and p["total_steps"] and p["step"] != last_step:
            print(self.line(p), file=sys.stderr, flush=True)

    def line(self, p) -> str:
        """One progress line (for logs, where a redrawn bar would be noise)."""
        if self.t0 is None or p["step"] < self.s0:
            self.t0, self.s0 = time.time(), p["step"]
        done = p["step"] - self.s0
        rate = done / max(time.time() - self.t0, 1e-9)
        eta = f"{(p['total_steps'] - p['step']) / rate:.0f}s" if rate > 0 else "-"   # no step timed yet
        loss = "-" if p["loss"] is None else f"{p['loss']:.4f}"
        tau = "" if p.get("heldout_tau") is None else f"  held-out tau {p['heldout_tau']:.2f}"
        return (f"step {p['step']}/{p['total_steps']}  tokens/s {p['tokens_per_second']:.0f} "
                f"(block {p.get('block_tokens_per_second', 0.0):.0f})  loss {loss}{tau}  "
                f"ETA {eta}  failures survived {p['failures_survived']}")

    def _tqdm(self, bar, p):
        from tqdm import tqdm

        if bar is None:
            bar = tqdm(total=p["total_steps"], desc="train", unit="step", dynamic_ncols=True)
        bar.total, bar.n = p["total_steps"], p["step"]
        loss = "-" if p["loss"] is None else f"{p['loss']:.4f}"
        tau = "" if p.get("heldout_tau") is None else f" tau={p['heldout_tau']:.2f}"
        bar.set_postfix_str(f"tok/s={p['tokens_per_second']:.0f} block={p.get('block_tokens_per_second', 0.0):.0f} "
                            f"loss={loss}{tau} failures={p['failures_survived']}",
                            refresh=False)
        bar.refresh()
        return bar
