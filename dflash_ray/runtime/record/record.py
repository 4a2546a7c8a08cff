"""RunRecord: the writer of what a run produces while it trains (run_layout.py names every file of the run
directory), hosted as an async actor pinned to the driver's node (so no shared file system is needed) that
outlives trainer restarts. The driver writes the rest itself, each file once: run_inputs.json at the first
start (record/run_inputs.py), export/ after training (runtime/checkpoints.py), summary.json and the export's
model card at the end (train.py).

It owns, and nothing else writes:
* ledger.jsonl and metrics.jsonl: rank 0's committed steps (training/record_client.py batches them), rolled back to the
  checkpoint's step when a restarted worker group begins;
* events.jsonl: restarts, stops, failed evaluations, removed checkpoints, test faults;
* evals.jsonl and best/, through the held-out evaluations it hosts (record/heldout.py HeldoutEvaluations:
  each a Ray task on this node that training does not wait for; the best drafter so far kept exported);
* the fan-out of each step to the `dflash_*` Ray metrics (gauges.py) and the experiment trackers.

It counts the run's stream segments, the attempts (every start of the train function: a restart is a start
after the first of its segment) and the streams' generations (each worker group's stream is a new one; the
coordinator is told the generation whose window it keeps). What the target actors did (record/targets.py
TargetActors) and what the checkpoints cost (record/checkpoint_costs.py CheckpointCosts) are kept by objects
of their own; the poison batches by record/quarantine.py.

`report()` is what the driver's summary is built from; `progress()` is what its progress line shows.
The flight window is the RunCoordinator's (runtime/coordinator.py).
"""
from __future__ import annotations

import json
import time

from dflash_ray.run_layout import RunLayout
from dflash_ray.runtime.record.checkpoint_costs import CheckpointCosts
from dflash_ray.runtime.record.heldout import HeldoutEvaluations
from dflash_ray.runtime.record.ledger import read_jsonl, rollback
from dflash_ray.runtime.record.quarantine import Quarantine
from dflash_ray.runtime.record.targets import TargetActors


class RunRecord:
    def __init__(self, run_dir: str, run_name: str, trackers=None,
                 tracker_options: dict | None = None, params: dict | None = None):
        from dflash_ray.runtime.record.gauges import Gauges

        self.files = RunLayout(run_dir)
        self.files.root.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name
        self.gauges = Gauges(run_name)
        self.started = time.time()
        self.timeline: dict[str, float] = {}   # first time each milestone happened (seconds since `started`)
        self.segments = 0             # fits of the run (stream segments: runtime/fit.py stream_segments)
        self.segment_attempts = 0     # train-function starts within the current segment
        self.attempt = 0              # train-function starts over the whole run: the current one's number
        self.trainer_restarts = 0
        self.streams = 0              # streams started: the last one's generation
        self.gen = 0                  # the current stream's generation (-1: ended): commits of another are dropped
        self.rolled_back_steps = 0
        self.targets = TargetActors(self.gauges)
        self.costs = CheckpointCosts()
        self.rank_nodes: list = []    # node of each trainer rank (the current stream's worker group)
        self.placement: list = []     # per node group: ranks and target actors (stream/pipeline.py)
        self.workers: dict[int, dict] = {}
        self.last: dict = {}
        self.stream_total_steps = 0   # the current stream's last step
        self.run_total_steps = 0      # the run's last step (a stream segment ends earlier)
        self.step_times: list[tuple[float, int, int]] = []   # (end, context tokens, block tokens) of recent steps
        self.pending_metrics: dict = {}   # a checkpoint's seconds, for the next metrics line
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

    # ------------------------------------------------------------ segments, streams, attempts
    def begin_segment(self, run_total_steps: int) -> None:
        """A fit of the run's next stream segment starts (runtime/fit.py stream_segments): its first worker
        group is no restart. `run_total_steps`: the run's last step (a segment ends earlier)."""
        self.segments += 1
        self.segment_attempts = 0
        self.run_total_steps = int(run_total_steps)

    def end_stream(self, quarantine_after: int = 0) -> list:
        """A new stream is about to replace the current one (its worker group is gone, or its segment ended):
        commits of the old stream that still arrive are dropped, with the old timeline rolled back. Returns
        the run's quarantined plan batches, (epoch, position), with those the ended stream's failure adds
        (quarantine.py)."""
        for entry in self.quarantine.end(self.gen, quarantine_after):
            self.event("batch_quarantined", **entry)
        self.gen = -1
        return self.quarantine.batches()

    def new_stream(self, total_steps: int, rank_nodes: list | None = None, placement: list | None = None) -> int:
        """A stream starts for a worker group (stream/pipeline.py): its last step, its ranks' nodes and
        where its target actors are. Returns its generation (its rows carry it; the coordinator keeps its
        window by it)."""
        self.streams += 1
        self.gen, self.stream_total_steps = self.streams, int(total_steps)
        self.rank_nodes = list(rank_nodes or [])
        if placement is not None:
            self.placement = list(placement)
            self.event("streams", gen=self.gen, placement=self.placement)
        self._mark(f"feed_{self.gen}")
        return self.gen

    def begin_attempt(self, step: int, world_size: int) -> dict:
        """Rank 0 of a (re)started worker group, resuming after `step` committed steps: the attempt's
        number, whether it is a restart (a start after the first of its segment), and the steps rolled
        back (the ledger goes back to the checkpoint's timeline)."""
        self.attempt += 1
        self.segment_attempts += 1
        restarted = self.segment_attempts > 1
        self.stopped = None   # a stop that a later failure overtook no longer holds
        dropped = rollback(self.files.ledger, step)
        self.rolled_back_steps += dropped
        if restarted:
            self.trainer_restarts += 1
            self.event("trainer_group_restarted", resume_step=step, rolled_back=dropped, world_size=world_size)
        self._failures_gauge()
        self.step_times = []
        return {"attempt": self.attempt, "restarted": restarted, "rolled_back": dropped}

    def worker_started(self, rank: int, pid: int, node: str) -> None:
        self._mark(f"worker{rank}_started")
        self.workers[int(rank)] = {"pid": pid, "node": node, "time": time.time()}

    # ------------------------------------------------------------ steps
    def in_flight(self, gen: int, rank: int, step: int, batches: list, error: str | None = None) -> None:
        """Rank `rank` trains `batches` [(epoch, position)] in `step` now ([]: no step in flight); `error`:
        the step raised (the error's first line) while training them."""
        if error is None:
            self.quarantine.in_flight(gen, rank, step, batches)
            return
        self.quarantine.failed(gen, rank, step, batches, error)
        self.event("step_failed", gen=gen, rank=rank, step=step, batches=batches, error=error)

    def commit_steps(self, gen: int, commits: list) -> None:
        """Rank 0's steps since its last call (training/record_client.py), in order, as (ledger line, metrics line) pairs."""
        for ledger_line, metrics in commits:
            self._commit_step(gen, ledger_line, metrics)

    def _commit_step(self, gen: int, ledger_line: dict, metrics: dict) -> None:
        """One optimizer step: a ledger line and a metrics line (written before returning). A commit from
        a replaced worker group's stream (gen != current) is dropped: its timeline was rolled back.
        metrics["time"]: when the step ended (rank 0's clock; commits may arrive several at a time)."""
        if gen != self.gen:
            return
        now = float(metrics.get("time") or time.time())
        if ledger_line["step"] <= 100 or ledger_line["step"] % 1000 == 0:   # the start-up's steps; bounded after
            self._mark(f"step{ledger_line['step']}", at=now)
        self.step_times = (self.step_times + [(now, int(metrics["tokens"]), int(metrics.get("block_tokens", 0)))])[-20:]
        tps = bps = 0.0
        if len(self.step_times) >= 2:
            dt = max(self.step_times[-1][0] - self.step_times[0][0], 1e-9)
            tps = sum(t for _, t, _ in self.step_times[1:]) / dt
            bps = sum(b for _, _, b in self.step_times[1:]) / dt
        # both units: context tokens/s (the target's) and trained block tokens/s (the drafter's)
        metrics = {**metrics, **self.pending_metrics, "tokens_per_second": tps, "block_tokens_per_second": bps,
                   "attempt": self.attempt,
                   "time": now, "failures_survived": self._failures_survived()}
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

            self.trackers.log_step(int(metrics["step"]), step_scalars(metrics, ledger_line, self.targets.actors))

    def stop_run(self, why: dict) -> None:
        """Rank 0: the workers stop before the feed's end (e.g. train.max_nonfinite_steps non-finite steps in
        a row); the driver turns `why` (progress()["stopped"]) into its error line once Ray Train returns."""
        self.stopped = dict(why)
        self.event("run_stopped", **why)

    # ------------------------------------------------------------ held-out tau (record/heldout.py runs them)
    async def evaluate_heldout(self, run_spec, step: int, weights: list) -> None:
        """Held-out tau of the drafter weights of `step` (weights = [ObjectRef of a state dict]), beside training."""
        await self.heldout.evaluate(run_spec, step, weights[0])

    def _heldout_result(self, step: int, result: dict) -> None:
        self.gauges.heldout_tau(float(result["tau"]))
        if self.trackers is not None:
            from dflash_ray.runtime.record.trackers import eval_scalars

            self.trackers.log_eval(step, eval_scalars(result))

    # ------------------------------------------------------------ target actors (record/targets.py)
    def target_started(self, key: str, pid: int, node: str) -> None:
        self._mark("target_started")
        if self.targets.started(key, pid, node):
            self.event("target_actor_restarted", actor=key, pid=pid)
        self._failures_gauge()

    def target_batches(self, key: str, report: list, cache: dict | None = None) -> None:
        """A target actor's block: per batch (busy seconds, tokens, bucket, feed index, feature bytes, read
        from the feature cache, slices of its forward), and what its feature cache did (TargetActors.batches)."""
        if self.targets.batches(key, report, cache, self.rank_nodes):
            self._mark("first_target_batch")

    # ------------------------------------------------------------ checkpoints (record/checkpoint_costs.py)
    def checkpoint(self, attempt, step: int, facts: dict) -> None:
        """What the checkpoint of an attempt's `step` cost, as each fact arrives from rank 0: when its
        `ray.train.report` returned, "seconds" training waited for it (the write or, with write="background",
        the host snapshot; the ledger, the barrier, and the upload unless it is async) with "upload",
        "write_seconds", "bytes" and "write"; once its files are in the run's storage, "upload_seconds". The
        step's own metrics line is written before either (it holds the write's cost): these go on the next
        line, with the step they belong to."""
        if "upload_seconds" in facts:
            seconds = float(facts["upload_seconds"])
            self.costs.uploaded(attempt, step, seconds)
            self.pending_metrics.update(checkpoint_upload_seconds=seconds, checkpoint_upload_step=int(step))
            self.gauges.checkpoint(upload_seconds=seconds)
            return
        seconds = float(facts["seconds"])
        self.costs.reported(attempt, step, seconds, upload=facts.get("upload"),
                            write_seconds=facts.get("write_seconds"), nbytes=facts.get("bytes"),
                            write=facts.get("write"))
        self.pending_metrics.update(checkpoint_seconds=seconds, checkpoint_seconds_step=int(step))
        self.gauges.checkpoint(seconds=seconds, nbytes=facts.get("bytes"))

    # ------------------------------------------------------------ reporting
    def _mark(self, what: str, at: float | None = None) -> None:
        """The first time `what` happened (`at`: time.time() when it did; default now)."""
        self.timeline.setdefault(what, round((time.time() if at is None else at) - self.started, 3))

    def _failures_survived(self) -> int:
        return self.trainer_restarts + self.targets.restarts

    def _failures_gauge(self):
        self.gauges.failures(self._failures_survived())

    def event(self, kind: str, **kw) -> None:
        with open(self.files.events, "a") as f:
            f.write(json.dumps({"event": kind, "time": time.time(), **kw}) + "\n")

    def progress(self) -> dict:
        """Where the run is now: its step, loss and rates (the driver's progress line), why its workers
        stopped early ("stopped", None while they have not), and the pids of its trainer workers (by rank)
        and target actors."""
        return {"step": int(self.last.get("step", 0)), "total_steps": max(self.stream_total_steps, self.run_total_steps),
                "heldout_tau": self.heldout.latest_tau,
                "loss": self.last.get("loss"), "tokens_per_second": self.last.get("tokens_per_second", 0.0),
                "block_tokens_per_second": self.last.get("block_tokens_per_second", 0.0),
                "failures_survived": self._failures_survived(), "epoch": self.last.get("epoch"),
                "stopped": self.stopped,
                "pids": {"workers": {r: w["pid"] for r, w in self.workers.items()}, "targets": self.targets.pids()}}

    async def report(self, eval_timeout: float = 600.0) -> dict:
        running = await self.heldout.wait(eval_timeout)   # evaluations still running belong to this run's report
        if running:
            self.event("heldout_eval_unfinished", running=running, waited_s=eval_timeout)
        targets = self.targets.report()
        return {"target_busy_by_bucket": targets["target_busy_by_bucket"],
                "target_busy_max_over_min": targets["target_busy_max_over_min"],
                "trainer_restarts": self.trainer_restarts, "target_restarts": targets["target_restarts"],
                "failures_survived": self._failures_survived(), "rolled_back_steps": self.rolled_back_steps,
                "attempts": self.attempt, "segments": self.segments, "targets": targets["targets"],
                "checkpoints": self.costs.checkpoints, "checkpoint_cost": self.costs.cost(), "last": self.last,
                "placement": self.placement, "feature_traffic": targets["feature_traffic"],
                "feature_cache": targets["feature_cache"], "timeline": self.timeline,
                "evals": self.heldout.done, "stopped": self.stopped, "started": self.started,
                "quarantined": self.quarantine.listing()}

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def last_metrics(run_dir) -> list[dict]:
    """metrics.jsonl with replayed steps collapsed: the last record of each step wins."""
    by_step = {}
    for r in read_jsonl(RunLayout(run_dir).metrics):
        by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]
