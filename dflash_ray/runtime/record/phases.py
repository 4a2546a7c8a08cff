"""The main job's phases and their wall time (and tokens, where a phase counts them): what a run costs and
where its time goes, printed at the end of the job and kept in summary.json under "phases"."""
from __future__ import annotations

import contextlib
import os
import time


class PhaseClock:
    """`with clock("regeneration") as phase: ...; phase["tokens"] = n` records one phase; nested phases
    are recorded with their parent's name ("inputs/regeneration"), in the order they started."""

    def __init__(self):
        self.rows: list[dict] = []
        self._stack: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        row = {"phase": "/".join([*self._stack, name]), "seconds": None}
        self.rows.append(row)
        self._stack.append(name)
        t0 = time.monotonic()
        try:
            yield row
        finally:
            row["seconds"] = round(time.monotonic() - t0, 2)
            self._stack.pop()

    def add(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (the process's start-up, before the clock existed)."""
        self.rows.append({"phase": "/".join([*self._stack, name]), "seconds": round(float(seconds), 2)})

    def table(self) -> str:
        """One line a phase: its seconds, its share of the top-level total, and its tokens if counted."""
        total = sum(r["seconds"] or 0.0 for r in self.rows if "/" not in r["phase"]) or 1.0
        lines = [f"{'phase':<32} {'seconds':>9} {'share':>6}  tokens"]
        for r in self.rows:
            depth = r["phase"].count("/")
            name = "  " * depth + r["phase"].rsplit("/", 1)[-1]
            tokens = f"{r['tokens']:,}" if r.get("tokens") is not None else ""
            share = f"{100 * (r['seconds'] or 0) / total:5.1f}%"
            lines.append(f"{name:<32} {r['seconds'] or 0:>9.1f} {share:>6}  {tokens}".rstrip())
        lines.append(f"{'total':<32} {total:>9.1f}")
        return "\n".join(lines)


def phase(clock: PhaseClock | None, name: str):
    """clock(name), or a context that records nothing when there is no clock."""
    return clock(name) if clock is not None else contextlib.nullcontext({})


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime; None
    elsewhere): a command's start-up phase, its imports and config, before any clock of its own."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
