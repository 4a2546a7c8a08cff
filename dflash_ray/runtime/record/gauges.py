"""The dflash_* Ray metrics (ray.util.metrics), exported by Ray as ray_dflash_* on each node's metrics port
and shown in the dashboard (docs/monitoring.md, dashboards/grafana/). Set by the RunRecord; the flight
window's dflash_batches_in_flight is the RunCoordinator's.

Every metric here is defined the same way by every run: Ray registers a metric name once per node, from the
first process that reports it, so a definition that varied by run (a histogram's bounds from the run's bucket
count, as dflash_batch_bucket had) made the node's agent drop a later run's points (Ray 2.60 skips them; 2.59
dropped the rest of that process's report)."""
from __future__ import annotations


class Gauges:
    def __init__(self, run: str):
        from ray.util.metrics import Counter, Gauge

        tags = ("run",)
        self.run, self.run_name = {"run": run}, run
        g = lambda name, desc, keys=tags: Gauge(name, description=desc, tag_keys=keys)  # noqa: E731
        self.loss = g("dflash_loss", "training loss of the last optimizer step")
        self.tokens_per_s = g("dflash_tokens_per_second", "context tokens trained per second (recent steps)")
        self.block_tokens_per_s = g("dflash_block_tokens_per_second",
                                    "anchor blocks x block size trained per second (recent steps)")
        self.tau = g("dflash_heldout_tau", "acceptance length on held-out prompts (speculative decoding)")
        self.step_no = g("dflash_step", "optimizer steps committed")
        self.train_tau = g("dflash_train_tau", "acceptance length measured on the last step's training blocks")
        self.epoch_progress = g("dflash_epoch_progress", "fraction of the current epoch trained")
        self.ckpt_s = g("dflash_checkpoint_seconds", "seconds training waited for the last checkpoint")
        self.ckpt_upload_s = g("dflash_checkpoint_upload_seconds", "seconds rank 0's last checkpoint upload took")
        self.ckpt_bytes = g("dflash_checkpoint_bytes", "bytes of rank 0's files in the last checkpoint")
        self.failures_survived = g("dflash_failures_survived", "trainer group restarts + target actor restarts")
        # train.oom_split: running counts of this run (a Counter would not exist until a first split)
        self.oom_splits = g("dflash_oom_splits", "drafter batches trained in slices after running out of memory")
        self.skipped_oom = g("dflash_skipped_oom", "steps skipped: a batch did not fit even as single rows")
        self._oom = [0, 0]
        self.idle = g("dflash_target_idle_fraction", "idle share of a target actor's lifetime", ("run", "actor"))
        # a bucket is a category, not a magnitude: a count per bucket id, not a histogram over ids
        self.bucket_batches = Counter("dflash_bucket_batches", description="batches trained, by length bucket",
                                      tag_keys=("run", "bucket"))
        self.target_batches = Counter("dflash_target_batches", description="batches a target actor computed",
                                      tag_keys=("run", "actor"))
        self.target_busy = Counter("dflash_target_busy_seconds", description="seconds a target actor computed",
                                   tag_keys=("run", "actor"))

    def step(self, metrics: dict, ledger_line: dict, tokens_per_second: float, block_tokens_per_second: float) -> None:
        tags = self.run
        self.loss.set(float(metrics["loss"]), tags=tags)
        self.tokens_per_s.set(tokens_per_second, tags=tags)
        self.block_tokens_per_s.set(block_tokens_per_second, tags=tags)
        self.step_no.set(int(metrics["step"]), tags=tags)
        self.epoch_progress.set(float(metrics.get("epoch_progress", 0.0)), tags=tags)
        for b in ledger_line.get("buckets", []):
            if b >= 0:   # -1: a filler batch, nothing trained
                self.bucket_batches.inc(1, tags={"run": self.run_name, "bucket": str(b)})
        self.train_tau.set(float(metrics.get("train_tau") or 0.0), tags=tags)
        self._oom[0] += int(metrics.get("oom_splits", 0))
        self._oom[1] += int(metrics.get("skipped_oom", 0))
        self.oom_splits.set(self._oom[0], tags=tags)
        self.skipped_oom.set(self._oom[1], tags=tags)

    def heldout_tau(self, tau: float) -> None:
        self.tau.set(tau, tags=self.run)

    def checkpoint(self, seconds: float | None = None, nbytes: int | None = None,
                   upload_seconds: float | None = None) -> None:
        if seconds is not None:
            self.ckpt_s.set(seconds, tags=self.run)
        if nbytes is not None:
            self.ckpt_bytes.set(float(nbytes), tags=self.run)
        if upload_seconds is not None:
            self.ckpt_upload_s.set(upload_seconds, tags=self.run)

    def failures(self, n: int) -> None:
        self.failures_survived.set(n, tags=self.run)

    def target_batch(self, actor: str, busy_s: float, idle: float) -> None:
        tags = {"run": self.run_name, "actor": actor}
        self.target_batches.inc(1, tags=tags)
        self.target_busy.inc(max(busy_s, 0.0), tags=tags)
        self.idle.set(idle, tags=tags)
