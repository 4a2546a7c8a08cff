"""RunCoordinator: the run's single controller, one async actor pinned to the driver's node.

It outlives trainer restarts (the driver owns it), so it is where the run's memory lives:

* the flight window: a block of batches enters the pipeline (tokens joined, then target forwards) only
  when its last feed row index < consumed + window (max_batches_in_flight; with blocks of several tiny
  batches, a step and two rounds of blocks: see reset_feed), so the object store never holds more than
  that many batches' features, and the rows a step needs always fit: the window cannot deadlock.
* the ledger and metrics.jsonl (written on the driver's node, so no shared file system is needed),
  rolled back to the checkpoint's step when training restarts after a failure;
* what the target actors did (batches, busy seconds, restarts) and the trainer restarts survived;
* the `dflash_*` metrics (ray.util.metrics) and the progress the driver's bar shows;
* held-out tau during training: rank 0 hands it the drafter's weights every `train.heldout_every` steps;
  it runs the evaluation as a Ray task on its own node (training does not wait), records the result in
  evals.jsonl and keeps the best drafter so far, exported, in <run.dir>/best.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

from dflash_ray.runtime.record.ledger import LEDGER, read_jsonl, rollback

METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
EVALS = "evals.jsonl"
BEST = "best"


class _Metrics:
    """The dflash_* metrics. Exported by Ray as ray_dflash_* on each node's metrics port."""

    def __init__(self, run: str, num_buckets: int):
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = ("run",)
        self.run = {"run": run}
        g = lambda name, desc, keys=tags: Gauge(name, description=desc, tag_keys=keys)  # noqa: E731
        self.loss = g("dflash_loss", "training loss of the last optimizer step")
        self.tokens_per_s = g("dflash_tokens_per_second", "trained tokens per second (recent steps)")
        self.heldout_tau = g("dflash_heldout_tau", "acceptance length on held-out prompts (speculative decoding)")
        self.step = g("dflash_step", "optimizer steps committed")
        self.train_tau = g("dflash_train_tau", "acceptance length measured on the last step's training blocks")
        self.epoch_progress = g("dflash_epoch_progress", "fraction of the current epoch trained")
        self.in_flight = g("dflash_batches_in_flight", "batches admitted to the pipeline and not yet trained")
        self.ckpt_s = g("dflash_checkpoint_seconds", "seconds training waited for the last checkpoint")
        self.ckpt_upload_s = g("dflash_checkpoint_upload_seconds", "seconds rank 0's last checkpoint upload took")
        self.ckpt_bytes = g("dflash_checkpoint_bytes", "bytes of rank 0's files in the last checkpoint")
        self.failures = g("dflash_failures_survived", "trainer group restarts + target actor restarts")
        self.idle = g("dflash_target_idle_fraction", "idle share of a target actor's lifetime", ("run", "actor"))
        self.bucket = Histogram("dflash_batch_bucket", description="length bucket of each trained batch",
                                boundaries=[b + 0.5 for b in range(max(num_buckets, 1))], tag_keys=tags)
        self.target_batches = Counter("dflash_target_batches", description="batches a target actor computed",
                                      tag_keys=("run", "actor"))
        self.target_busy = Counter("dflash_target_busy_seconds", description="seconds a target actor computed",
                                   tag_keys=("run", "actor"))


class RunCoordinator:
    def __init__(self, run_dir: str, run_name: str, window: int, num_buckets: int, tensorboard: bool = False,
                 trackers=None, tracker_options: dict | None = None, params: dict | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name
        self.base_window = int(window)   # cluster.max_batches_in_flight; a stream's blocks may need more
        self.window = self.base_window
        self.rows_per_block = 1
        self.removed_checkpoints: list = []   # a previous driver's unregistered checkpoint directories
        self.metrics = _Metrics(run_name, num_buckets)
        self.cond = asyncio.Condition()
        self.gen = 0
        self.consumed = 0             # feed rows trained, in the current generation
        self.admitted = -1            # highest feed row index admitted, current generation
        self.max_in_flight = 0
        self.attempts = 0             # train-function starts, over the whole run (checkpoint records name them)
        self.windows = 0              # fits of the run (trainer.stream_windows: one per window of feed rows)
        self.window_attempts = 0      # starts within the current window (restarts = window_attempts - 1)
        self.run_total_steps = 0      # the run's last step (a window's feed ends earlier)
        self.trainer_restarts = 0
        self.rolled_back_steps = 0
        self.targets: dict[str, dict] = {}
        self.target_by_bucket: dict[int, list] = {}   # bucket -> [batches, busy seconds], all actors
        self.target_restarts = 0
        self.rank_nodes: list = []    # node of each trainer rank (the current stream's worker group)
        self.placement: list = []     # per node group: ranks and target actors (pipeline.DatasetFactory.splits)
        self.features = {"rows": 0, "bytes": 0, "cross_node_rows": 0, "cross_node_bytes": 0}
        self.workers: dict[int, dict] = {}
        self.last: dict = {}
        self.evals: list[dict] = read_jsonl(self.dir / EVALS)   # a resumed run's earlier ones count for best/
        self.evals_running = 0
        if self.evals:  # a resumed run shows its latest held-out tau from the start
            self.metrics.heldout_tau.set(float(self.evals[-1]["tau"]), tags=self.metrics.run)
        self.total_steps = 0
        self.feed: dict = {}
        self.step_times: list[tuple[float, int]] = []
        self.checkpoints: list[dict] = []
        self.pending_metrics: dict = {}   # an upload's seconds, for the next metrics line
        self.started = time.time()
        self.timeline: dict[str, float] = {}   # first time each milestone happened (seconds since start)
        self.stopped: dict | None = None      # why the workers stopped early (non-finite steps), for the driver
        # experiment trackers (train.trackers; train.tensorboard=true is the alias of tensorboard): each
        # step is logged once, when its first metrics line is written (trackers.py says why)
        from dflash_ray.runtime.record.trackers import Trackers, options

        names = list(trackers or [])
        if tensorboard and "tensorboard" not in names:
            names.append("tensorboard")
        self.trackers = None
        if names:
            self.trackers = Trackers(str(self.dir), run_name, names, tracker_options or options(None, self.dir),
                                     on_error=lambda name, where, e: self._event(
                                         "tracker_failed", tracker=name, where=where, error=str(e)[:500]))
            self.trackers.start(params or {}, logged_steps=(int(r["step"]) for r in read_jsonl(self.dir / METRICS)))

    # ------------------------------------------------------------ flight window
    async def reset_feed(self, total_steps: int, cursor: dict, batches_per_step: int, schedule_steps: int = 0,
                         rank_nodes: list | None = None, placement: list | None = None, rows_per_block: int = 1,
                         world: int = 1) -> int:
        """A new Ray Data stream starts (first start or a restart): a new generation of row indices.
        rank_nodes: the node of each trainer rank; placement: the node streams (for the report).
        A block (one rank's next `rows_per_block` rows) is admitted by its last row, and the stream hands
        blocks out a round (one per rank) at a time: with blocks of several rows the window holds a step
        and two rounds (or cluster.max_batches_in_flight, when larger), so the round a step needs always
        fits (no deadlock) and the next one is being computed meanwhile. Less is not enough: with rank 0
        reporting 58 rows late (blocks of 63) the trainers waited for a round that waited for admission,
        for good. On top of that the window holds one block's rows more (`report_slack_rows`): rank 0
        reports what it trained only when its unreported rows would exceed them (loop.commit_due)."""
        async with self.cond:
            g = self.rows_per_block = int(rows_per_block)
            if g <= 1:
                self.window, slack = self.base_window, 0   # one row a block: rank 0 reports every step
            else:
                needed = int(batches_per_step) + 2 * g * int(world)
                self.window = max(self.base_window, needed + g)
                slack = self.window - needed
            self.rank_nodes = list(rank_nodes or [])
            if placement is not None:
                self.placement = list(placement)
                self._event("streams", gen=self.gen + 1, placement=self.placement)
            self.gen += 1
            self.consumed, self.admitted = 0, -1
            self.total_steps = int(total_steps)
            self.feed = {"gen": self.gen, "total_steps": int(total_steps), "cursor": dict(cursor),
                         "batches_per_step": int(batches_per_step),
                         "schedule_steps": int(schedule_steps or total_steps), "report_slack_rows": slack}
            self.cond.notify_all()
            self._mark(f"feed_{self.gen}")
            return self.gen

    def _mark(self, what: str, at: float | None = None) -> None:
        """The first time `what` happened (`at`: time.time() when it did; default now)."""
        self.timeline.setdefault(what, round((time.time() if at is None else at) - self.started, 3))

    def feed_info(self) -> dict:
        return dict(self.feed)

    async def admit(self, gen: int, index: int) -> bool:
        async with self.cond:
            await self.cond.wait_for(lambda: gen != self.gen or index < self.consumed + self.window)
            if gen != self.gen:
                return False  # a stream that has been replaced: let it drain
            self._mark(f"first_admit_{gen}")
            self.admitted = max(self.admitted, index)
            in_flight = self.admitted + 1 - self.consumed
            self.max_in_flight = max(self.max_in_flight, in_flight)
            self.metrics.in_flight.set(in_flight, tags=self.metrics.run)
            return True

    async def consumed_upto(self, gen: int, upto: int) -> None:
        async with self.cond:
            if gen == self.gen and upto > self.consumed:
                self.consumed = upto
                self.metrics.in_flight.set(max(self.admitted + 1 - self.consumed, 0), tags=self.metrics.run)
                self.cond.notify_all()

    # ------------------------------------------------------------ target actors
    def target_started(self, key: str, pid: int, node: str) -> None:
        self._mark("target_started")
        t = self.targets.get(key)
        if t is None:
            self.targets[key] = {"pid": pid, "node": node, "batches": 0, "busy_s": 0.0, "restarts": 0,
                                 "started": time.time(), "last": time.time()}
        else:  # Ray restarted this actor after it died: its batch is recomputed by Ray Data's retry
            t.update(pid=pid, node=node, restarts=t["restarts"] + 1)
            self.target_restarts += 1
            self._event("target_actor_restarted", actor=key, pid=pid)
        self._failures_gauge()

    def target_batches(self, key: str, report: list) -> None:
        """A target actor's block: (busy seconds, tokens, bucket, feed index, feature bytes) per batch."""
        for busy_s, tokens, bucket, index, nbytes in report:
            self.target_batch(key, busy_s, tokens, bucket, index, nbytes)

    def target_batch(self, key: str, busy_s: float, tokens: int, bucket: int, index: int = -1,
                     nbytes: int = 0) -> None:
        t = self.targets.setdefault(key, {"pid": None, "node": None, "batches": 0, "busy_s": 0.0,
                                          "restarts": 0, "started": time.time(), "last": time.time()})
        if index >= 0 and self.rank_nodes:
            # the rank that trains feed row `index` (feed.rank_rows) and its node: do the features cross?
            f = self.features
            f["rows"] += 1
            f["bytes"] += int(nbytes)
            if t.get("node") and t["node"] != self.rank_nodes[index % len(self.rank_nodes)]:
                f["cross_node_rows"] += 1
                f["cross_node_bytes"] += int(nbytes)
        self._mark("first_target_batch")
        t["batches"] += 1
        t["tokens"] = t.get("tokens", 0) + int(tokens)
        t["busy_s"] += busy_s
        t["last"] = time.time()
        if bucket >= 0:  # fillers (bucket -1) run no forward
            b = self.target_by_bucket.setdefault(int(bucket), [0, 0.0])
            b[0] += 1
            b[1] += busy_s
        tags = {"run": self.run_name, "actor": key}
        self.metrics.target_batches.inc(1, tags=tags)
        self.metrics.target_busy.inc(max(busy_s, 0.0), tags=tags)
        life = max(time.time() - t["started"], 1e-9)
        self.metrics.idle.set(max(0.0, 1.0 - t["busy_s"] / life), tags=tags)

    def targets_pids(self) -> dict:
        return {k: v["pid"] for k, v in self.targets.items()}

    # ------------------------------------------------------------ trainers
    def worker_started(self, rank: int, pid: int, node: str) -> None:
        self._mark(f"worker{rank}_started")
        self.workers[int(rank)] = {"pid": pid, "node": node, "time": time.time()}

    def worker_pids(self) -> dict:
        return {r: w["pid"] for r, w in self.workers.items()}

    def begin_window(self, run_total_steps: int) -> None:
        """A fit of the next window of the run starts (trainer.stream_windows): its first worker group is
        no restart."""
        self.windows += 1
        self.window_attempts = 0
        self.run_total_steps = int(run_total_steps)

    def report_stopped(self) -> dict | None:
        return self.stopped

    def begin_attempt(self, step: int, world_size: int) -> dict:
        """Rank 0 of a (re)started worker group, resuming after `step` committed steps."""
        self.attempts += 1
        self.window_attempts += 1
        self.stopped = None   # a stop that a later failure overtook no longer holds
        dropped = rollback(self.dir / LEDGER, step)
        self.rolled_back_steps += dropped
        if self.window_attempts > 1:
            self.trainer_restarts += 1
            self._event("trainer_group_restarted", resume_step=step, rolled_back=dropped, world_size=world_size)
        self._failures_gauge()
        self.step_times = []
        return {"attempt": self.attempts, "rolled_back": dropped}

    async def commit_steps(self, gen: int, commits: list, consumed: int) -> None:
        """Rank 0's steps since its last call (loop.commit_due), in order, as (ledger line, metrics line)
        pairs, and the feed rows of stream `gen` trained so far (the flight window's `consumed`)."""
        for record, metrics in commits:
            self.commit_step(gen, record, metrics)
        await self.consumed_upto(gen, consumed)

    def commit_step(self, gen: int, record: dict, metrics: dict) -> None:
        """One optimizer step: a ledger line and a metrics line (written before returning). A commit from
        a replaced worker group's stream (gen != current) is dropped: its timeline was rolled back.
        metrics["time"]: when the step ended (rank 0's clock; commits may arrive several at a time)."""
        if gen != self.gen:
            return
        now = float(metrics.get("time") or time.time())
        if record["step"] <= 100 or record["step"] % 1000 == 0:   # the start-up's steps; bounded after
            self._mark(f"step{record['step']}", at=now)
        self.step_times.append((now, int(metrics["tokens"])))
        self.step_times = self.step_times[-20:]
        if len(self.step_times) >= 2:
            dt = self.step_times[-1][0] - self.step_times[0][0]
            tps = sum(t for _, t in self.step_times[1:]) / max(dt, 1e-9)
        else:
            tps = 0.0
        metrics = {**metrics, **self.pending_metrics, "tokens_per_second": tps, "attempt": self.attempts,
                   "time": now, "failures_survived": self.failures_survived()}
        self.pending_metrics = {}
        record = {**record, "attempt": self.attempts}
        with open(self.dir / LEDGER, "a") as f:
            f.write(json.dumps(record) + "\n")
        with open(self.dir / METRICS, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.last = metrics
        m, tags = self.metrics, self.metrics.run
        m.loss.set(float(metrics["loss"]), tags=tags)
        m.tokens_per_s.set(tps, tags=tags)
        m.step.set(int(metrics["step"]), tags=tags)
        m.epoch_progress.set(float(metrics.get("epoch_progress", 0.0)), tags=tags)
        for b in record.get("buckets", []):
            if b >= 0:
                m.bucket.observe(b, tags=tags)
        m.train_tau.set(float(metrics.get("train_tau") or 0.0), tags=tags)
        if self.trackers is not None:
            from dflash_ray.runtime.record.trackers import step_scalars

            self.trackers.log_step(int(metrics["step"]), step_scalars(metrics, record, self.targets))

    async def evaluate_heldout(self, run_spec, step: int, weights: list) -> None:
        """Held-out tau of the drafter weights of `step` (weights = [ObjectRef of a state dict]), in a Ray
        task pinned to this node (the run directory is here); the best drafter so far stays in best/."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from dflash_ray.runtime.record.heldout import heldout_tau_of_weights

        out = self.dir / ".evals" / f"step_{int(step)}"
        node = ray.get_runtime_context().get_node_id()
        task = ray.remote(heldout_tau_of_weights).options(
            num_cpus=0.5, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        self.evals_running += 1
        try:
            result = await task.remote(run_spec, weights[0], str(out))
        except Exception as e:  # an evaluation never stops the run: it is reported
            self._event("heldout_eval_failed", step=int(step), error=str(e)[:500])
            return
        finally:
            self.evals_running -= 1
            async with self.cond:
                self.cond.notify_all()
        record = {"step": int(step), "time": time.time(), **result}
        best = max((e["tau"] for e in self.evals), default=float("-inf"))
        self.evals.append(record)
        with open(self.dir / EVALS, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.metrics.heldout_tau.set(float(result["tau"]), tags=self.metrics.run)
        if self.trackers is not None:
            from dflash_ray.runtime.record.trackers import eval_scalars

            self.trackers.log_eval(int(step), eval_scalars(result))
        if result["tau"] > best:
            _replace_dir(out, self.dir / BEST)
        else:
            shutil.rmtree(out, ignore_errors=True)

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
                        write_seconds: float | None = None, nbytes: int | None = None) -> None:
        """Rank 0's `ray.train.report` of the checkpoint of `step` returned: training waited `seconds`
        for it (the write, the ledger, the barrier, and the upload unless it is async)."""
        c = self._checkpoint(attempt, step)
        c.update(seconds=float(seconds), upload=upload, write_seconds=write_seconds, bytes=nbytes)
        # the step's own line is written before its checkpoint: what training waited goes on the next one
        self.pending_metrics.update(checkpoint_seconds=float(seconds), checkpoint_seconds_step=int(step))
        self.metrics.ckpt_s.set(float(seconds), tags=self.metrics.run)
        if nbytes is not None:
            self.metrics.ckpt_bytes.set(float(nbytes), tags=self.metrics.run)

    def checkpoint_uploaded(self, attempt, step: int, seconds: float) -> None:
        """Rank 0's files of the checkpoint of `step` are in the run's storage after `seconds`. The
        step's own metrics line is written before (it holds the write's cost): the upload's seconds go on
        the next line, with the step they belong to."""
        self._checkpoint(attempt, step)["upload_seconds"] = float(seconds)
        self.pending_metrics.update(checkpoint_upload_seconds=float(seconds), checkpoint_upload_step=int(step))
        self.metrics.ckpt_upload_s.set(float(seconds), tags=self.metrics.run)

    def checkpoint_cost(self) -> dict:
        """What this invocation's checkpoints cost: count, seconds training waited (total, max), write
        and upload seconds, bytes."""
        cs = self.checkpoints

        def vals(key):
            return [float(c[key]) for c in cs if c.get(key) is not None]

        waited, write, up, nbytes = vals("seconds"), vals("write_seconds"), vals("upload_seconds"), vals("bytes")
        return {"count": len(cs), "total_seconds": sum(waited), "max_seconds": max(waited, default=0.0),
                "total_write_seconds": sum(write), "max_write_seconds": max(write, default=0.0),
                "total_upload_seconds": sum(up), "max_upload_seconds": max(up, default=0.0),
                "total_bytes": int(sum(nbytes)), "max_bytes": int(max(nbytes, default=0))}

    def stop_run(self, why: dict) -> None:
        """Rank 0: the workers stop before the feed's end (e.g. train.max_nonfinite_steps non-finite steps in
        a row); the driver turns `why` into its error line once Ray Train returns."""
        self.stopped = dict(why)
        self._event("run_stopped", **why)

    def checkpoints_removed(self, names: list, error: str | None = None) -> None:
        self.removed_checkpoints = list(names)
        self._event("unregistered_checkpoints_removed", dirs=list(names), **({"error": error} if error else {}))

    def fault_injected(self, kind: str, **info) -> None:
        """Test-only (DFLASH_TEST_FAULTS): a worker is about to act out a fault; the test waits for this."""
        self._event("test_fault", fault=kind, **info)

    # ------------------------------------------------------------ reporting
    def failures_survived(self) -> int:
        return self.trainer_restarts + self.target_restarts

    def _failures_gauge(self):
        self.metrics.failures.set(self.failures_survived(), tags=self.metrics.run)

    def _event(self, kind: str, **kw) -> None:
        with open(self.dir / EVENTS, "a") as f:
            f.write(json.dumps({"event": kind, "time": time.time(), **kw}) + "\n")

    def progress(self) -> dict:
        return {"step": int(self.last.get("step", 0)), "total_steps": max(self.total_steps, self.run_total_steps),
                "heldout_tau": self.evals[-1]["tau"] if self.evals else None,
                "loss": self.last.get("loss"), "tokens_per_second": self.last.get("tokens_per_second", 0.0),
                "failures_survived": self.failures_survived(), "epoch": self.last.get("epoch")}

    async def report(self, eval_timeout: float = 600.0) -> dict:
        async with self.cond:  # evaluations still running belong to this run's report (within a bound)
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.evals_running == 0), eval_timeout)
            except asyncio.TimeoutError:
                self._event("heldout_eval_unfinished", running=self.evals_running, waited_s=eval_timeout)
        now = time.time()
        targets = {}
        total = sum(t["batches"] for t in self.targets.values()) or 1
        for k, t in self.targets.items():
            life = max(now - t["started"], 1e-9)
            targets[k] = {"batches": t["batches"], "share": t["batches"] / total, "busy_s": round(t["busy_s"], 3),
                          "tokens": t.get("tokens", 0),
                          "idle_fraction": max(0.0, 1 - t["busy_s"] / life), "restarts": t["restarts"],
                          "pid": t["pid"], "node": t["node"]}
        # the planner balances batches' target work across buckets: what the actors measured
        by_bucket = [{"bucket": b, "batches": n, "mean_busy_ms": 1000 * s / n}
                     for b, (n, s) in sorted(self.target_by_bucket.items()) if n]
        means = [r["mean_busy_ms"] for r in by_bucket]
        return {"target_busy_by_bucket": by_bucket,
                "target_busy_max_over_min": max(means) / min(means) if means and min(means) > 0 else None,
                "trainer_restarts": self.trainer_restarts, "target_restarts": self.target_restarts,
                "failures_survived": self.failures_survived(), "rolled_back_steps": self.rolled_back_steps,
                "attempts": self.attempts, "windows": self.windows, "max_batches_in_flight": self.max_in_flight, "window": self.window,
                "rows_per_block": self.rows_per_block, "removed_checkpoints": self.removed_checkpoints,
                "targets": targets, "checkpoints": self.checkpoints, "checkpoint_cost": self.checkpoint_cost(),
                "last": self.last, "placement": self.placement, "feature_traffic": dict(self.features),
                "timeline": self.timeline, "evals": self.evals, "stopped": self.stopped}

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def _replace_dir(src: Path, dst: Path) -> None:
    """dst becomes src, whole (the old dst is moved aside first, then removed)."""
    old = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def last_metrics(run_dir) -> list[dict]:
    """metrics.jsonl with replayed steps collapsed: the last record of each step wins."""
    by_step = {}
    for r in read_jsonl(Path(run_dir) / METRICS):
        by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]

