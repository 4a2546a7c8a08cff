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
      poison_batch      {"epoch": e, "position": p, "how": "exit" | "raise"}: the rank whose step trains plan
                        batch (e, p) dies (os._exit, as a crash would) or raises, every time it meets it
      oom               {"steps": [s, ...], "rank": r | null (every rank), "where": "forward" | "backward",
                        "micro_batch": a | null (any), "max_rows": n}: torch.OutOfMemoryError, the allocator's
                        own exception type, in the drafter's step for any slice of more than n rows (0: even
                        single rows), after the forward (its activations exist) or inside the backward (after
                        part of the gradient was added): OomFault
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


class OomFault:
    """Raises torch.OutOfMemoryError where an allocator would, for the step it was made for (`oom_fault`):
    a CPU cannot be made to run out of device memory, so the tests inject the real exception type at the
    two points a GPU runs out, and count what they raised."""

    def __init__(self, spec: dict):
        self.where = spec.get("where", "forward")
        self.micro_batch = spec.get("micro_batch")
        self.max_rows = int(spec.get("max_rows", 1))
        self.raised = 0

    def _hits(self, a: int, rows: int) -> bool:
        return (self.micro_batch is None or a == self.micro_batch) and rows > self.max_rows

    def _error(self, a: int, rows: int):
        import torch

        self.raised += 1
        return torch.OutOfMemoryError(f"test fault: out of memory ({self.where}, micro-batch {a}, {rows} rows)")

    def after_forward(self, a: int, rows: int) -> None:
        if self.where == "forward" and self._hits(a, rows):
            raise self._error(a, rows)

    def in_backward(self, a: int, rows: int, drafter):
        """A hook that raises inside the backward once the first trainable parameter's gradient is computed
        (the layers after it have added theirs by then); its handle, or None."""
        if self.where != "backward" or not self._hits(a, rows):
            return None

        def hook(grad):
            raise self._error(a, rows)

        return drafter.trainable_parameters()[0].register_hook(hook)


def oom_fault(faults: dict, step: int, rank: int) -> OomFault | None:
    """The out-of-memory fault of this step and rank, or None (every real run)."""
    spec = faults.get("oom") or {}
    if step not in spec.get("steps", ()) or spec.get("rank") not in (None, rank):
        return None
    return OomFault(spec)


def crash_on_poison(rows: list, faults: dict) -> None:
    """The worker ends when one of its rows is the faults' poison batch: `exit` as a process that crashes
    part-way into its step (its in-flight report, sent at the step's start, has had the time a forward takes to
    go out), `raise` as a step whose code fails."""
    poison = faults.get("poison_batch")
    if not poison or not any(r.epoch == poison["epoch"] and r.position == poison["position"] and not r.trains_nothing
                             for r in rows):
        return
    if poison.get("how", "exit") == "raise":
        raise IndexError(f"test fault: poison batch {poison['epoch']}:{poison['position']} (index out of range)")
    import time

    time.sleep(0.5)
    os._exit(1)
