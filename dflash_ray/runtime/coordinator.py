"""RunCoordinator: the flight window of a run, one async actor pinned to the driver's node that outlives
trainer restarts. What the run writes, and the count of its attempts, segments and streams, is the
RunRecord's (record/record.py); this actor only decides when the stream may move on.

* the flight window: a block of batches enters the pipeline (tokens joined, then target forwards) only
  when its last feed row index < consumed + window (cluster.max_batches_in_flight; with blocks of several
  tiny batches, a step and two rounds of blocks: see reset_feed), so the object store never holds more
  than that many batches' features, and the rows a step needs always fit: the window cannot deadlock.
  Each stream (a first start, a restart, the next stream segment) is a new generation of row indices,
  numbered by the record (RunRecord.new_stream) and handed to `reset_feed`.
"""
from __future__ import annotations

import asyncio
import time


class RunCoordinator:
    def __init__(self, run_name: str, max_batches_in_flight: int):
        from ray.util.metrics import Gauge

        self.base_window = max_batches_in_flight   # a stream's blocks may need more (reset_feed)
        self.window = self.base_window
        self.rows_per_block = 1
        self.cond = asyncio.Condition()
        self.gen = 0                  # the stream whose window this is (the record numbers them)
        self.consumed = 0             # feed rows trained, in the current generation
        self.admitted = -1            # highest feed row index admitted, current generation
        self.max_in_flight = 0
        self.feed: dict = {}
        self.first_admit: dict[str, float] = {}   # time.time() of each stream's first admitted block
        self.tags = {"run": run_name}
        self.in_flight = Gauge("dflash_batches_in_flight", description="batches admitted to the pipeline and "
                               "not yet trained", tag_keys=("run",))

    # ------------------------------------------------------------ the flight window
    async def reset_feed(self, gen: int, total_steps: int, cursor: dict, batches_per_step: int,
                         schedule_steps: int = 0, rows_per_block: int = 1, world: int = 1) -> None:
        """A new Ray Data stream starts (first start or a restart): generation `gen` of row indices.
        A block (one rank's next `rows_per_block` rows) is admitted by its last row, and the stream hands
        blocks out a round (one per rank) at a time: with blocks of several rows the window holds a step
        and two rounds (or cluster.max_batches_in_flight, when larger), so the round a step needs always
        fits (no deadlock) and the next one is being computed meanwhile. Less is not enough: with rank 0
        reporting 58 rows late (blocks of 63) the trainers waited for a round that waited for admission,
        for good. On top of that the window holds one block's rows more (`report_slack_rows`): rank 0
        reports what it trained only when its unreported rows would exceed them (training/record_client.py)."""
        async with self.cond:
            g = self.rows_per_block = rows_per_block
            if g <= 1:
                self.window, slack = self.base_window, 0   # one row a block: rank 0 reports every step
            else:
                needed = batches_per_step + 2 * g * world
                self.window = max(self.base_window, needed + g)
                slack = self.window - needed
            self.gen = int(gen)
            self.consumed, self.admitted = 0, -1
            self.feed = {"gen": self.gen, "total_steps": total_steps, "cursor": dict(cursor),
                         "batches_per_step": batches_per_step, "schedule_steps": schedule_steps or total_steps,
                         "report_slack_rows": slack}
            self.cond.notify_all()

    def feed_info(self) -> dict:
        return dict(self.feed)

    async def admit(self, gen: int, index: int) -> bool:
        async with self.cond:
            await self.cond.wait_for(lambda: gen != self.gen or index < self.consumed + self.window)
            if gen != self.gen:
                return False  # a stream that has been replaced: let it drain
            self.first_admit.setdefault(f"first_admit_{gen}", time.time())
            self.admitted = max(self.admitted, index)
            in_flight = self.admitted + 1 - self.consumed
            self.max_in_flight = max(self.max_in_flight, in_flight)
            self.in_flight.set(in_flight, tags=self.tags)
            return True

    async def consumed_upto(self, gen: int, upto: int) -> None:
        async with self.cond:
            if gen == self.gen and upto > self.consumed:
                self.consumed = upto
                self.in_flight.set(max(self.admitted + 1 - self.consumed, 0), tags=self.tags)
                self.cond.notify_all()

    def report(self) -> dict:
        return {"max_batches_in_flight": self.max_in_flight,
                "window": self.window, "rows_per_block": self.rows_per_block, "first_admit": dict(self.first_admit)}


def record_actor_name(coordinator_name: str) -> str:
    """The RunRecord actor's name, from the run's coordinator name (one per run and driver process)."""
    return coordinator_name.replace("dflash-coordinator-", "dflash-record-", 1)
