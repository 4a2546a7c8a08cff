"""RunRecord: the writer of what a run produces while it trains (run_layout.py names every file of the run
directory), hosted as an async actor pinned to the driver's node (so no shared file system is needed) that
outlives trainer restarts. The driver writes the rest itself, each file once: run_inputs.json at the first
start (record/run_inputs.py), export/ after training (training/export.py), summary.json and the export's
model card at the end (train.py).

It owns, and nothing else writes:
* ledger.jsonl and metrics.jsonl: rank 0's committed steps (training/record_client.py batches them), rolled back to the
  checkpoint's step when a restarted worker group begins;
* events.jsonl: restarts, stops, failed evaluations, removed checkpoints, test faults;
* evals.jsonl and best/, through the held-out evaluations it hosts (record/heldout.py HeldoutEvaluations:
  each a Ray task on this node that training does not wait for; the best drafter so far kept exported);
* what the target actors did (batches, busy seconds, restarts, the bytes of features that crossed nodes)
  and what the checkpoints cost;
* the fan-out of each step to the `dflash_*` Ray metrics (gauges.py) and the experiment trackers.

`report()` is what the driver's summary is built from; `progress()` is what its progress line shows.
The flight window and the attempt/segment bookkeeping are the RunCoordinator's (runtime/coordinator.py).
"""
from __future__ import annotations

import json
import time

from dflash_ray.run_layout import RunLayout
from dflash_ray.runtime.record.heldout import HeldoutEvaluations
from dflash_ray.runtime.record.ledger import read_jsonl, rollback
from dflash_ray.runtime.record.quarantine import Quarantine


class RunRecord:
    def __init__(self, run_dir: str, run_name: str, trackers=None,
                 tracker_options: dict | None = None, params: dict | None = None):
        from dflash_ray.runtime.record.gauges import Gauges

        self.files = RunLayout(run_dir)
        self.files.root.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name
        self.gauges = Gauges(run_name)
        self.gen = 0                  # the current stream's generation: commits of a replaced one are dropped
        self.started = time.time()
        self.timeline: dict[str, float] = {}   # first time each milestone happened (seconds since `started`)
        self.attempt = 0
        self.trainer_restarts = 0
        self.rolled_back_steps = 0
        self.targets: dict[str, dict] = {}
        self.target_by_bucket: dict[int, list] = {}   # bucket -> [batches, busy seconds], all actors
        self.target_restarts = 0
        self.rank_nodes: list = []    # node of each trainer rank (the current stream's worker group)
        self.placement: list = []     # per node group: ranks and target actors (stream/pipeline.py)
        self.features = {"rows": 0, "bytes": 0, "cross_node_rows": 0, "cross_node_bytes": 0}
        self.feature_cache = {"read_tokens": 0, "read_s": 0.0}   # + feature_cache.FeatureCache's counts
        self.workers: dict[int, dict] = {}
        self.last: dict = {}
        self.stream_total_steps = 0   # the current stream's last step
        self.run_total_steps = 0      # the run's last step (a stream segment ends earlier)
        self.step_times: list[tuple[float, int, int]] = []   # (end, context tokens, block tokens) of recent steps
        self.pending_metrics: dict = {}   # an upload's seconds, for the next metrics line
        self.checkpoints: list[dict] = []
        self.removed_checkpoints: list = []   # a previous driver's unregistered checkpoint directories
        self.stopped: dict | None = None      # why the workers stopped early (non-finite steps), for the driver
        self.quarantine = Quarantine(self.files.quarantine)   # poison batches (train.quarantine_after)
        self.heldout = HeldoutEvaluations(self.files, on_result=self._heldout_result, on_failure=lambda step, error:
                                          self.event("heldout_eval_failed", step=step, error=error))
        if self.heldout.latest_tau is not None:  # a resumed run shows its latest held-out tau from the start
            self.gauges.heldout_tau(float(self.heldout.latest_tau))
        # experiment trackers: each step is logged once, when its first metrics line is written (trackers.py)
        self.trackers = None
        if trackers:
            from dflash_ray.runtime.record.trackers import Trackers, options

            self.trackers = Trackers(str(self.files.root), run_name, list(trackers),
                                     tracker_options or options(None, self.files.root),
                                     on_error=lambda name, where, e: self.event(
                                         "tracker_failed", tracker=name, where=where, error=str(e)[:500]))
            self.trackers.start(params or {}, logged_steps=(int(r["step"]) for r in read_jsonl(self.files.metrics)))

    # ------------------------------------------------------------ the run's shape
    def mark(self, what: str, at: float | None = None) -> None:
        """The first time `what` happened (`at`: time.time() when it did; default now)."""
        self.timeline.setdefault(what, round((time.time() if at is None else at) - self.started, 3))

    def end_stream(self, quarantine_after: int = 0) -> list:
        """A new stream is about to replace the current one (its worker group is gone, or its segment ended):
        commits of the old stream that still arrive are dropped, with the old timeline rolled back. Returns
        the run's quarantined plan batches, (epoch, position), with those the ended stream's failure adds
        (quarantine.py)."""
        for entry in self.quarantine.end(self.gen, quarantine_after):
            self.event("batch_quarantined", **entry)
        self.gen = -1
        return self.quarantine.batches()

    def in_flight(self, gen: int, rank: int, step: int, batches: list) -> None:
        """Rank `rank` trains `batches` [(epoch, position)] in `step` now ([]: no step in flight)."""
        self.quarantine.in_flight(gen, rank, step, batches)

    def step_failed(self, gen: int, rank: int, step: int, batches: list, line: str) -> None:
        """Rank `rank`'s `step` raised (`line`: the error's first line) while training `batches`."""
        self.quarantine.failed(gen, rank, step, batches, line)
        self.event("step_failed", gen=gen, rank=rank, step=step, batches=batches, error=line)

    def new_stream(self, gen: int, total_steps: int, rank_nodes: list | None = None,
                   placement: list | None = None) -> None:
        """A stream of generation `gen` starts (coordinator.reset_feed): its worker group's nodes."""
        self.gen, self.stream_total_steps = int(gen), int(total_steps)
        self.rank_nodes = list(rank_nodes or [])
        if placement is not None:
            self.placement = list(placement)
            self.event("streams", gen=self.gen, placement=self.placement)
        self.mark(f"feed_{gen}")

    def begin_attempt(self, step: int, world_size: int, attempt: int, restarted: bool) -> dict:
        """Rank 0 of a (re)started worker group, resuming after `step` committed steps: the ledger goes
        back to the checkpoint's timeline."""
        self.attempt = int(attempt)
        self.stopped = None   # a stop that a later failure overtook no longer holds
        dropped = rollback(self.files.ledger, step)
        self.rolled_back_steps += dropped
        if restarted:
            self.trainer_restarts += 1
            self.event("trainer_group_restarted", resume_step=step, rolled_back=dropped, world_size=world_size)
        self._failures_gauge()
        self.step_times = []
        return {"rolled_back": dropped}

    def worker_started(self, rank: int, pid: int, node: str) -> None:
        self.mark(f"worker{rank}_started")
        self.workers[int(rank)] = {"pid": pid, "node": node, "time": time.time()}

    def worker_pids(self) -> dict:
        return {r: w["pid"] for r, w in self.workers.items()}

    # ------------------------------------------------------------ steps
    def commit_steps(self, gen: int, commits: list) -> None:
        """Rank 0's steps since its last call (training/record_client.py), in order, as (ledger line, metrics line) pairs."""
        for ledger_line, metrics in commits:
            self.commit_step(gen, ledger_line, metrics)

    def commit_step(self, gen: int, ledger_line: dict, metrics: dict) -> None:
        """One optimizer step: a ledger line and a metrics line (written before returning). A commit from
        a replaced worker group's stream (gen != current) is dropped: its timeline was rolled back.
        metrics["time"]: when the step ended (rank 0's clock; commits may arrive several at a time)."""
        if gen != self.gen:
            return
        now = float(metrics.get("time") or time.time())
        if ledger_line["step"] <= 100 or ledger_line["step"] % 1000 == 0:   # the start-up's steps; bounded after
            self.mark(f"step{ledger_line['step']}", at=now)
        self.step_times = (self.step_times + [(now, int(metrics["tokens"]), int(metrics.get("block_tokens", 0)))])[-20:]
        tps = bps = 0.0
        if len(self.step_times) >= 2:
            dt = max(self.step_times[-1][0] - self.step_times[0][0], 1e-9)
            tps = sum(t for _, t, _ in self.step_times[1:]) / dt
            bps = sum(b for _, _, b in self.step_times[1:]) / dt
        # both units: context tokens/s (the target's) and trained block tokens/s (the drafter's)
        metrics = {**metrics, **self.pending_metrics, "tokens_per_second": tps, "block_tokens_per_second": bps,
                   "attempt": self.attempt,
                   "time": now, "failures_survived": self.failures_survived()}
        self.pending_metrics = {}
        ledger_line = {**ledger_line, "attempt": self.attempt}
        with open(self.files.ledger, "a") as f:
            f.write(json.dumps(ledger_line) + "\n")
        with open(self.files.metrics, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.last = metrics
        self.gauges.step(metrics, ledger_line, tps, bps)
        if self.trackers is not None:
            from dflash_ray.runtime.record.trackers import step_scalars

            self.trackers.log_step(int(metrics["step"]), step_scalars(metrics, ledger_line, self.targets))

    def stop_run(self, why: dict) -> None:
        """Rank 0: the workers stop before the feed's end (e.g. train.max_nonfinite_steps non-finite steps in
        a row); the driver turns `why` into its error line once Ray Train returns."""
        self.stopped = dict(why)
        self.event("run_stopped", **why)

    def report_stopped(self) -> dict | None:
        return self.stopped

    # ------------------------------------------------------------ held-out tau (record/heldout.py runs them)
    async def evaluate_heldout(self, run_spec, step: int, weights: list) -> None:
        """Held-out tau of the drafter weights of `step` (weights = [ObjectRef of a state dict]), beside training."""
        await self.heldout.evaluate(run_spec, step, weights[0])

    def _heldout_result(self, step: int, result: dict) -> None:
        self.gauges.heldout_tau(float(result["tau"]))
        if self.trackers is not None:
            from dflash_ray.runtime.record.trackers import eval_scalars

            self.trackers.log_eval(step, eval_scalars(result))

    # ------------------------------------------------------------ target actors
    def target_started(self, key: str, pid: int, node: str) -> None:
        self.mark("target_started")
        t = self.targets.get(key)
        if t is None:
            self.targets[key] = _target_entry(pid, node)
        else:  # Ray restarted this actor after it died: its batch is recomputed by Ray Data's retry
            t.update(pid=pid, node=node, restarts=t["restarts"] + 1)
            self.target_restarts += 1
            self.event("target_actor_restarted", actor=key, pid=pid)
        self._failures_gauge()

    def target_batches(self, key: str, report: list, cache: dict | None = None) -> None:
        """A target actor's block: (busy seconds, tokens, bucket, feed index, feature bytes, read from the
        feature cache) per batch, and what its feature cache did for the block (feature_cache.py counts).
        A batch read from the cache is no target forward: the target's rates count computed batches only.
        The last field: the slices its forward took (1; more when it ran out of device memory)."""
        for busy_s, tokens, bucket, index, nbytes, cached, pieces in report:
            if cached:
                c = self.feature_cache
                c["read_tokens"] += int(tokens)
                c["read_s"] += busy_s
            else:
                self.target_batch(key, busy_s, tokens, bucket, index, nbytes)
                if pieces > 1:
                    self.targets[key]["oom_splits"] = self.targets[key].get("oom_splits", 0) + 1
        for k, v in (cache or {}).items():
            self.feature_cache[k] = self.feature_cache.get(k, 0) + v

    def target_batch(self, key: str, busy_s: float, tokens: int, bucket: int, index: int = -1,
                     nbytes: int = 0) -> None:
        t = self.targets.setdefault(key, _target_entry(None, None))
        if index >= 0 and self.rank_nodes:
            # the rank that trains feed row `index` (feed.rank_rows) and its node: do the features cross?
            f = self.features
            f["rows"] += 1
            f["bytes"] += int(nbytes)
            if t.get("node") and t["node"] != self.rank_nodes[index % len(self.rank_nodes)]:
                f["cross_node_rows"] += 1
                f["cross_node_bytes"] += int(nbytes)
        self.mark("first_target_batch")
        t["batches"] += 1
        t["tokens"] += int(tokens)
        t["busy_s"] += busy_s
        t["last"] = time.time()
        if bucket >= 0:  # fillers (bucket -1) run no forward
            b = self.target_by_bucket.setdefault(int(bucket), [0, 0.0])
            b[0] += 1
            b[1] += busy_s
        self.gauges.target_batch(key, busy_s, idle=max(0.0, 1.0 - t["busy_s"] / max(time.time() - t["started"], 1e-9)))

    def targets_pids(self) -> dict:
        return {k: v["pid"] for k, v in self.targets.items()}

    # ------------------------------------------------------------ checkpoints
    def _checkpoint(self, attempt, step: int) -> dict:
        """The record of one checkpoint (an attempt's step: a step can be checkpointed again after a
        restart from an earlier one), made by whichever of its calls arrives first."""
        for c in reversed(self.checkpoints):
            if c["step"] == int(step) and c.get("attempt") == attempt:
                return c
        c = {"step": int(step), "attempt": attempt}
        self.checkpoints.append(c)
        return c

    def checkpoint_done(self, step: int, seconds: float, *, attempt=None, upload: str | None = None,
                        write_seconds: float | None = None, nbytes: int | None = None,
                        write: str | None = None) -> None:
        """Rank 0's `ray.train.report` of the checkpoint of `step` returned: training waited `seconds`
        for it (the write or, with write="background", the host snapshot; the ledger, the barrier, and the
        upload unless it is async)."""
        c = self._checkpoint(attempt, step)
        c.update(seconds=float(seconds), upload=upload, write_seconds=write_seconds, bytes=nbytes)
        if write is not None:
            c["write"] = write
        # the step's own line is written before its checkpoint: what training waited goes on the next one
        self.pending_metrics.update(checkpoint_seconds=float(seconds), checkpoint_seconds_step=int(step))
        self.gauges.checkpoint(seconds=float(seconds), nbytes=nbytes)

    def checkpoint_uploaded(self, attempt, step: int, seconds: float) -> None:
        """Rank 0's files of the checkpoint of `step` are in the run's storage after `seconds`. The
        step's own metrics line is written before (it holds the write's cost): the upload's seconds go on
        the next line, with the step they belong to."""
        self._checkpoint(attempt, step)["upload_seconds"] = float(seconds)
        self.pending_metrics.update(checkpoint_upload_seconds=float(seconds), checkpoint_upload_step=int(step))
        self.gauges.checkpoint(upload_seconds=float(seconds))

    def checkpoint_cost(self) -> dict:
        """What this invocation's checkpoints cost: count, seconds training waited (total, max), write
        and upload seconds, bytes."""
        def vals(key):
            return [float(c[key]) for c in self.checkpoints if c.get(key) is not None]

        waited, write, up, nbytes = vals("seconds"), vals("write_seconds"), vals("upload_seconds"), vals("bytes")
        return {"count": len(self.checkpoints), "total_seconds": sum(waited), "max_seconds": max(waited, default=0.0),
                "total_write_seconds": sum(write), "max_write_seconds": max(write, default=0.0),
                "total_upload_seconds": sum(up), "max_upload_seconds": max(up, default=0.0),
                "total_bytes": int(sum(nbytes)), "max_bytes": int(max(nbytes, default=0))}

    def checkpoints_removed(self, names: list, error: str | None = None) -> None:
        self.removed_checkpoints = list(names)
        self.event("unregistered_checkpoints_removed", dirs=list(names), **({"error": error} if error else {}))

    def fault_injected(self, kind: str, **info) -> None:
        """Test-only (DFLASH_TEST_FAULTS): a worker is about to act out a fault; the test waits for this."""
        self.event("test_fault", fault=kind, **info)

    # ------------------------------------------------------------ reporting
    def failures_survived(self) -> int:
        return self.trainer_restarts + self.target_restarts

    def _failures_gauge(self):
        self.gauges.failures(self.failures_survived())

    def event(self, kind: str, **kw) -> None:
        with open(self.files.events, "a") as f:
            f.write(json.dumps({"event": kind, "time": time.time(), **kw}) + "\n")

    def progress(self) -> dict:
        return {"step": int(self.last.get("step", 0)), "total_steps": max(self.stream_total_steps, self.run_total_steps),
                "heldout_tau": self.heldout.latest_tau,
                "loss": self.last.get("loss"), "tokens_per_second": self.last.get("tokens_per_second", 0.0),
                "block_tokens_per_second": self.last.get("block_tokens_per_second", 0.0),
                "failures_survived": self.failures_survived(), "epoch": self.last.get("epoch")}

    def set_run_total_steps(self, total_steps: int) -> None:
        """The run's last step (a stream segment ends earlier: runtime/fit.py stream_segments)."""
        self.run_total_steps = int(total_steps)

    async def report(self, eval_timeout: float = 600.0) -> dict:
        running = await self.heldout.wait(eval_timeout)   # evaluations still running belong to this run's report
        if running:
            self.event("heldout_eval_unfinished", running=running, waited_s=eval_timeout)
        now = time.time()
        total = sum(t["batches"] for t in self.targets.values()) or 1
        targets = {k: {"batches": t["batches"], "share": t["batches"] / total, "busy_s": round(t["busy_s"], 3),
                       "tokens": t["tokens"], "idle_fraction": max(0.0, 1 - t["busy_s"] / max(now - t["started"], 1e-9)),
                       "restarts": t["restarts"], "pid": t["pid"], "node": t["node"],
                       "oom_splits": t.get("oom_splits", 0)}
                   for k, t in self.targets.items()}
        # the planner balances batches' target work across buckets: what the actors measured
        by_bucket = [{"bucket": b, "batches": n, "mean_busy_ms": 1000 * s / n}
                     for b, (n, s) in sorted(self.target_by_bucket.items()) if n]
        means = [r["mean_busy_ms"] for r in by_bucket]
        return {"target_busy_by_bucket": by_bucket,
                "target_busy_max_over_min": max(means) / min(means) if means and min(means) > 0 else None,
                "trainer_restarts": self.trainer_restarts, "target_restarts": self.target_restarts,
                "failures_survived": self.failures_survived(), "rolled_back_steps": self.rolled_back_steps,
                "removed_checkpoints": self.removed_checkpoints, "targets": targets,
                "checkpoints": self.checkpoints, "checkpoint_cost": self.checkpoint_cost(), "last": self.last,
                "placement": self.placement, "feature_traffic": dict(self.features),
                "feature_cache": dict(self.feature_cache), "timeline": self.timeline,
                "evals": self.heldout.done, "stopped": self.stopped, "started": self.started,
                "quarantined": self.quarantine.listing()}

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def _target_entry(pid, node) -> dict:
    now = time.time()
    return {"pid": pid, "node": node, "batches": 0, "tokens": 0, "busy_s": 0.0, "restarts": 0, "started": now,
            "last": now, "oom_splits": 0}


def last_metrics(run_dir) -> list[dict]:
    """metrics.jsonl with replayed steps collapsed: the last record of each step wins."""
    by_step = {}
    for r in read_jsonl(RunLayout(run_dir).metrics):
        by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]
