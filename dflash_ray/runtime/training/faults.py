"""Test-only fault injection (tests/reliability/): read from $DFLASH_TEST_FAULTS on the driver
(runtime/fit.py) and handed to the workers in the loop's config, since a Ray worker does not see the
driver's later environment. Empty in any real run."""
from __future__ import annotations

import dataclasses
import json
import os

TEST_FAULTS_ENV = "DFLASH_TEST_FAULTS"


def faults_for_tests() -> dict:
    """The faults, as JSON in $DFLASH_TEST_FAULTS. Keys:

      nonfinite         {"steps": [s, ...], "rank": r}: rank r's batches of those steps get a NaN context
                        feature (as a broken target forward would deliver)
      checkpoint_pause  {"step": s, "seconds": t, "where": "write" | "upload", "attempts": [a, ...]}: rank 0
                        stops for t seconds inside the checkpoint of step s, after drafter.safetensors is
                        written ("write") or after its files are in storage, before the checkpoint is
                        registered ("upload"), having logged a `test_fault` event (with its pid) first
    """
    raw = os.environ.get(TEST_FAULTS_ENV)
    return json.loads(raw) if raw else {}


def poisoned(rows: list, step: int, rank: int, faults: dict) -> list:
    """The step's rows, with a NaN in each one's first context feature when the faults say so."""
    poison = faults.get("nonfinite") or {}
    if step not in poison.get("steps", ()) or rank != poison.get("rank", 0):
        return rows
    from dflash_ray.runtime.stream.rows import decode_features, encode_features

    out = []
    for row in rows:
        context = decode_features(row.context, row.context_dtype).clone()
        context.view(-1)[0] = float("nan")
        encoded, dtype = encode_features(context)
        out.append(dataclasses.replace(row, context=encoded, context_dtype=dtype))
    return out


_ARMED: dict = {}   # where -> the pause armed for this process's next checkpoint (tests only; empty otherwise)


def arm_checkpoint_pause(faults: dict, step: int, rank: int, record) -> None:
    """Before the checkpoint of `step`: when the faults say so, arm rank 0's pause at its "write" or "upload"
    point (`pause_point`), which tells the record (the test waits for that event, then kills a process) and
    sleeps. Armed for one firing; the checkpoint code carries no fault parameter."""
    pause = faults.get("checkpoint_pause") or {}
    where = pause.get("where", "write")
    if rank != 0 or pause.get("step") != step or record.attempt not in pause.get("attempts", [record.attempt]):
        return

    def fault_pause():
        import time

        record.fault_injected("checkpoint_pause", step=step, where=where)
        time.sleep(float(pause.get("seconds", 60)))

    _ARMED[where] = fault_pause


def pause_point(where: str) -> None:
    """A point inside a checkpoint where a test may pause rank 0 ("write": drafter.safetensors written, the
    rest not; "upload": the files in storage, the checkpoint not registered). A no-op unless armed."""
    pause = _ARMED.pop(where, None)
    if pause is not None:
        pause()
