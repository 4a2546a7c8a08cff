"""The worker side of the run record: what the train loop calls to tell the RunRecord (and the flight
window) what happened. Rank 0 keeps its steps' ledger and metrics lines and sends them in one call: at the
first step, at least every COMMIT_INTERVAL_S, before every checkpoint (waited for: the ledger is on disk
before the checkpoint can be registered), at a stop, and whenever the rows it trained but did not report
would exceed the flight window's slack for them. Lines not sent when a worker dies belong to steps after
the last checkpoint, which a restart rolls back anyway. Other ranks tell nothing but that they started.
"""
from __future__ import annotations

import os
import time

from dflash_ray.runtime.stream.rows import QUARANTINED

# One actor call a step costs the record ~1 ms of CPU, which matters only for tiny steps
# (benchmarks/bench_load.py), not at GPU scale.
COMMIT_INTERVAL_S = 0.5


def commit_due(s: int, since_sent: float, unreported_rows: int, report_slack_rows: int) -> bool:
    """Rank 0 sends its unsent commits after step s (0-based, of this attempt): the first step at once
    (start-up and progress show it), then every COMMIT_INTERVAL_S, and whenever the rows trained but not
    reported exceed the flight window's slack for them (coordinator.reset_feed: 0, every step, unless a
    stream block holds several rows), so the window the stream sees is never short of what it needs."""
    return s == 0 or since_sent >= COMMIT_INTERVAL_S or unreported_rows > report_slack_rows


def ledger_line(result, step: int) -> dict:
    """The ledger line of a committed step (a skipped one is marked: its batches trained nothing)."""
    line = {"epoch": result.epoch, "step": step, "positions": result.positions, "buckets": result.buckets,
            "tokens": result.batch_tokens}
    aside = [p for p, b in zip(result.positions, result.buckets) if b == QUARANTINED]
    if aside:   # set aside after failing their worker group (record/quarantine.py): in their step, not trained
        line["quarantined"] = aside
    if result.skipped_oom:   # a batch did not fit even as single rows (step.py)
        line["skipped"] = "oom"
    elif result.skipped_nonfinite:
        line["skipped"] = "nonfinite"
    return line


def metrics_line(result, step: int, *, timings: dict, feed: dict, epoch_batches: int, nonfinite_streak: int,
                 oom_streak: int = 0) -> dict:
    """The metrics line of a step: the step's result, its timings (step, wait, compute seconds and the
    compute thread's CPU), where it is in the epoch and the run."""
    real = [p for p in result.positions if p >= 0]
    return {"step": step, "epoch": result.epoch, "loss": result.loss, "tokens": result.tokens,
            "block_tokens": result.block_tokens,
            "weight_sum": result.weight_sum, "lr": result.lr, "grad_norm": result.grad_norm, **timings,
            "slot_accuracy": result.slot_accuracy, "train_tau": result.train_tau,
            "train_tau_if_slots_independent": result.train_tau_if_slots_independent,
            "epoch_progress": (max(real) + 1) / epoch_batches if real else 1.0,
            "total_steps": feed["total_steps"], "schedule_steps": feed["schedule_steps"],
            "batches_per_step": feed["batches_per_step"], "skipped_nonfinite": int(result.skipped_nonfinite),
            "nonfinite_streak": nonfinite_streak, "oom_splits": result.oom_splits,
            "skipped_oom": int(result.skipped_oom), "oom_streak": oom_streak, "time": time.time()}


def peer_gone(error: BaseException) -> bool:
    """An error a rank gets because another rank of its group failed (a collective's peer gone)."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "NCCL", "ProcessGroup"))


class RecordClient:
    """One per worker. `begin` (every rank) says the worker started and returns the stream's feed info;
    on rank 0 it also begins the attempt (the record rolls the ledger back to the checkpoint's step)."""

    def __init__(self, run_spec, rank: int):
        import ray

        from dflash_ray.runtime.coordinator import record_actor_name

        self.spec, self.rank = run_spec, rank
        self.coord = ray.get_actor(run_spec.coordinator, namespace=run_spec.namespace)
        self.record = ray.get_actor(record_actor_name(run_spec.coordinator), namespace=run_spec.namespace)
        self.attempt = 0
        self.unsent: list = []     # rank 0's (ledger line, metrics line) not sent yet
        self.pending: list = []    # rank 0's calls in flight
        self.reported, self.t_sent = 0, time.perf_counter()   # feed rows reported consumed, and when

    def begin(self) -> dict:
        import ray

        self.record.worker_started.remote(self.rank, os.getpid(), ray.get_runtime_context().get_node_id())
        pg = ray.util.get_current_placement_group()
        if self.rank == 0 and pg is not None:   # the worker group's: what a sweep removes when it stops the run
            self.record.event.remote("worker_placement_group", id=pg.id.hex())
        self.feed = ray.get(self.coord.feed_info.remote())
        self.gen, self.slack = self.feed["gen"], self.feed.get("report_slack_rows", 0)
        return self.feed

    def begin_attempt(self, step: int, world_size: int) -> None:
        """Rank 0, the worker group's checkpoint restored: the record numbers this attempt and rolls the
        ledger back to `step`."""
        import ray

        if self.rank == 0:
            self.attempt = ray.get(self.record.begin_attempt.remote(step, world_size))["attempt"]

    def step(self, s: int, step: int, result, *, timings: dict, epoch_batches: int, nonfinite_streak: int,
             drafter, oom_streak: int = 0) -> None:
        """Step s of this attempt (`step` of the run) is done: rank 0 keeps its lines and starts a held-out
        evaluation when one is due. They are sent by a checkpoint (`flush`, waited for), a stop, or else
        `send_due`."""
        if self.rank != 0:
            return
        self.unsent.append((ledger_line(result, step),
                            metrics_line(result, step, timings=timings, feed=self.feed, epoch_batches=epoch_batches,
                                         nonfinite_streak=nonfinite_streak, oom_streak=oom_streak)))
        every = self.spec.train.heldout_every
        if self.spec.heldout and every and step % every == 0:
            self.evaluate(step, drafter)

    def send_due(self, s: int, consumed: int) -> None:
        """After step s of this attempt, when no checkpoint followed it: rank 0 sends what it has when
        `commit_due` says so, without waiting."""
        if self.rank != 0:
            return
        if commit_due(s, time.perf_counter() - self.t_sent, consumed - self.reported, self.slack):
            self.flush(consumed)
            if len(self.pending) > 64:   # forget the finished ones (a long checkpoint interval)
                import ray

                self.pending[:] = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)[1]

    def in_flight(self, step: int, rows) -> None:
        """This rank trains `rows` in `step` now (no rows: the step is done), without waiting: what a worker
        group that dies had in flight (record/quarantine.py). Two calls a step and rank: ~1 ms of the
        record's CPU each (see COMMIT_INTERVAL_S), against steps of 0.1-2 s."""
        self.record.in_flight.remote(self.gen, self.rank, step,
                                     [[r.epoch, r.position] for r in rows if not r.trains_nothing])

    def step_failed(self, step: int, rows, error: BaseException) -> None:
        """This rank's step raised: the record has it before the worker goes (bounded wait). An error of a
        collective (a peer gone: gloo's closed connection, NCCL's) does not name this rank's batches: only
        the in-flight report counts then."""
        import ray

        if peer_gone(error):
            return
        line = (str(error).strip().splitlines() or [""])[0][:300]
        ref = self.record.in_flight.remote(self.gen, self.rank, step,
                                           [[r.epoch, r.position] for r in rows if not r.trains_nothing],
                                           error=f"{type(error).__name__}: {line}")
        try:
            ray.get(ref, timeout=10)
        except Exception:  # noqa: BLE001 - the record gone or slow: the failure itself still propagates
            pass

    def evaluate(self, step: int, drafter) -> None:
        """Held-out tau of these weights, in a task the record starts (training goes on meanwhile)."""
        import ray

        from dflash_ray.runtime.training.sharding import is_sharded

        if is_sharded(drafter):   # whole weights would be a gather on every rank: only the final tau runs (export)
            return
        weights = ray.put({k: v.detach().cpu() for k, v in drafter.state_dict().items()})
        self.record.evaluate_heldout.remote(self.spec, step, [weights])

    def flush(self, consumed: int, extra: dict | None = None, wait: bool = False) -> None:
        """Rank 0: send the unsent lines (`extra` joins the last one's metrics) and the feed rows trained
        so far; wait=True: until every line sent so far is on disk (an async actor does not promise to run
        calls in order: each one is waited for)."""
        import ray

        if self.rank != 0:
            return
        if extra and self.unsent:
            self.unsent[-1] = (self.unsent[-1][0], {**self.unsent[-1][1], **extra})
        if self.unsent:
            self.pending.append(self.record.commit_steps.remote(self.gen, list(self.unsent)))
            self.unsent.clear()
        self.pending.append(self.coord.consumed_upto.remote(self.gen, consumed))
        self.reported, self.t_sent = consumed, time.perf_counter()
        if wait:
            ray.get(self.pending)
            self.pending.clear()

    def release(self, consumed: int) -> None:
        """Rank 0, as a checkpoint starts: the target actors go on with the next rows meanwhile."""
        if self.rank == 0:
            self.coord.consumed_upto.remote(self.gen, consumed)

    def stop(self, consumed: int, why: dict) -> None:
        """Rank 0: the workers stop before the feed's end; the driver turns `why` into its error line."""
        import ray

        if self.rank == 0:
            self.flush(consumed, wait=True)
            ray.get(self.record.stop_run.remote(why))

    def checkpoint_uploaded(self, step: int, seconds: float) -> None:
        """Waited for: the record has it before the checkpoint is registered (and before the run ends)."""
        import ray

        ray.get(self.record.checkpoint.remote(self.attempt, step, {"upload_seconds": seconds}))

    def checkpoint_done(self, step: int, seconds: float, upload: str, cost: dict) -> None:
        if self.rank == 0:
            self.record.checkpoint.remote(self.attempt, step, {
                "seconds": seconds, "upload": upload, "write_seconds": cost.get("checkpoint_write_seconds"),
                "bytes": cost.get("checkpoint_bytes"), "write": cost.get("checkpoint_write")})

    def fault_injected(self, kind: str, **info) -> None:
        """Test-only (DFLASH_TEST_FAULTS): logged and waited for before the fault is acted out."""
        import ray

        ray.get(self.record.event.remote("test_fault", fault=kind, attempt=self.attempt, pid=os.getpid(), **info))
