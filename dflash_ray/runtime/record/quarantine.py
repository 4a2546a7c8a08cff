"""Poison batches: a plan batch whose training ends its worker group `train.quarantine_after` times in a row is
set aside, so the exactly-once plan (which makes a restart meet the same batch again) cannot make the run fail
on it for good. Kept by the run record (record.py), no Ray.

What each stream generation (a worker group's attempt) had in flight when it ended, from two reports:
  - every rank, at each step's start, the step and the plan batches (epoch, position) it trains
    (`in_flight`; an empty list once the step is done: a checkpoint, the end), sent without waiting;
  - a rank whose step raised, the step, its batches and the error's first line (`failed`, waited for).
When a new stream replaces a generation (`end`), its fail point is: the batches of the first rank whose step
raised (the others' errors follow from it: a peer gone from a collective), else those of every rank still in
the step it was training (a process killed outright says nothing: every batch of that step is suspect), else
none (it ended outside a step: a checkpoint, a segment's end). The
same batches as the fail point of the `limit` generations before in a row: they are quarantined. The next
feed marks them (stream/feed.py: trained by no rank, computed by no target actor), the ledger line names
them, and `quarantine.json` in the run directory keeps them for a rerun of the same run.name.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

NO_LINE = "a worker died while training it, with no error line (killed, or a crash)"


class Quarantine:
    def __init__(self, path: Path):
        self.path = Path(path)
        # "epoch:position" -> {"epoch", "position", "step", "reason", "time"}
        self.entries: dict[str, dict] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.markers: dict[int, dict[int, tuple]] = {}   # gen -> rank -> (step, batches)
        self.errors: dict[int, list] = {}                # gen -> [(step, batches, first line)], as they came
        self.history: list = []                          # fail point of each ended generation, in order

    def in_flight(self, gen: int, rank: int, step: int, batches: list) -> None:
        self.markers.setdefault(int(gen), {})[int(rank)] = (int(step), [tuple(b) for b in batches])

    def failed(self, gen: int, rank: int, step: int, batches: list, line: str) -> None:
        self.errors.setdefault(int(gen), []).append((int(step), [tuple(b) for b in batches], line))

    def fail_point(self, gen: int):
        """(step, frozenset of (epoch, position), the error's first line or None), or None."""
        errors = self.errors.get(gen)
        if errors:
            step, batches, line = errors[0]
            return step, frozenset(batches), line
        busy = [(s, b) for s, b in self.markers.get(gen, {}).values() if b]
        if not busy:
            return None
        step = max(s for s, _ in busy)
        return step, frozenset(x for s, b in busy if s == step for x in b), None

    def end(self, gen: int, limit: int) -> list[dict]:
        """Generation `gen` ended: its fail point joins the history; the entries this quarantines (new ones)."""
        if gen <= 0:
            return []
        point = self.fail_point(int(gen))
        self.history.append(point)
        recent = self.history[-limit:] if limit > 0 else []
        if len(recent) < limit or any(p is None for p in recent) or len({p[1] for p in recent}) != 1:
            return []
        step, batches, line = point
        line = next((p[2] for p in reversed(recent) if p[2]), None) or NO_LINE
        new = []
        for epoch, position in sorted(batches):
            key = f"{epoch}:{position}"
            if key not in self.entries:
                self.entries[key] = {"epoch": int(epoch), "position": int(position), "step": step,
                                     "reason": line, "failures": limit, "time": time.time()}
                new.append(self.entries[key])
        if new:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.entries, indent=1))
            tmp.replace(self.path)
        return new

    def batches(self) -> list[tuple[int, int]]:
        """Every quarantined (epoch, position) of the run."""
        return sorted((e["epoch"], e["position"]) for e in self.entries.values())

    def listing(self) -> list[dict]:
        return sorted(self.entries.values(), key=lambda e: (e["epoch"], e["position"]))
