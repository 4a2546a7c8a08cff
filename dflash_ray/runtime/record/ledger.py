"""The ledger: one JSON line per committed optimizer step (epoch, step, plan positions, buckets, tokens).

Lines are appended as steps finish. When a failure sends training back to a checkpoint at step S, the
lines after S are rolled back (the file is rewritten atomically without them) before training goes on,
so the ledger always describes one timeline: the one the weights went through. `verify_ledger` checks
the promise: every planned batch of every finished epoch appears exactly once, nothing appears twice.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a torn last line from a killed writer: not committed
                    break
    return out


def rewrite_jsonl(path, records: list[dict]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rollback(path, to_step: int) -> int:
    """Keep the records with step <= to_step; returns how many were dropped."""
    records = read_jsonl(path)
    keep = [r for r in records if int(r["step"]) <= to_step]
    if len(keep) != len(records) or (Path(path).exists() and _has_torn_line(path)):
        rewrite_jsonl(path, keep)
    return len(records) - len(keep)


def _has_torn_line(path) -> bool:
    with open(path, "rb") as f:
        data = f.read()
    return bool(data) and not data.endswith(b"\n")


def verify_ledger(records: list[dict], plan_sizes: dict[int, int], finished_epochs) -> dict:
    """Coverage of the ledger against the plans (epoch -> number of planned batches).

    ok means: no (epoch, position) twice, every position of each finished epoch present, steps 1..n in
    order. Returns {"ok", "steps", "batches", "duplicates", "missing" (per finished epoch),
    "steps_in_order", "finished_epochs"}."""
    seen = Counter()
    for r in records:
        for p in r["positions"]:
            if p >= 0:
                seen[(int(r["epoch"]), int(p))] += 1
    dups = sorted(k for k, c in seen.items() if c > 1)
    missing = {}
    for e in finished_epochs:
        miss = [p for p in range(plan_sizes[e]) if seen[(e, p)] == 0]
        if miss:
            missing[int(e)] = miss
    steps = [int(r["step"]) for r in records]
    in_order = steps == list(range(1, len(steps) + 1))
    return {"ok": not dups and not missing and in_order, "steps": len(records),
            "batches": int(sum(seen.values())), "duplicates": dups[:20], "missing": missing,
            "steps_in_order": in_order, "finished_epochs": sorted(int(e) for e in finished_epochs)}
