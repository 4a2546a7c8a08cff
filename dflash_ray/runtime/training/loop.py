"""The Ray Train worker loop: rows -> step -> record -> maybe checkpoint.

Each optimizer step consumes W = batches_per_step consecutive feed rows; rank r trains rows
s*W + a*workers + r (feed.rank_rows) and checks every row it receives is the one it expects. The step's
math is `step.train_step` (no Ray); the run record's client (training/record_client.py) tells the driver's side
what happened; the checkpoint manager (checkpoint.py) restores, and after every step saves when a
checkpoint is due.

A step whose loss or gradient is NaN/Inf trains nothing (`step.train_step` skips the update on every rank)
but its batches count as consumed: its ledger line says `"skipped": "nonfinite"` and the plan's
exactly-once accounting goes on (retrying the batch would give the same NaN: same features, same anchors).
After `train.max_nonfinite_steps` such steps in a row the workers stop together, without a checkpoint (the
last one holds the weights of the last good step), and the driver raises one line (trainer.fit).
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np
import torch

from dflash_ray.runtime.stream.feed import Cursor, cursor_after, rank_rows
from dflash_ray.runtime.stream.rows import TrainRow, train_rows
from dflash_ray.model.drafter import compiled_graphs
from dflash_ray.runtime.training.model import build_model
from dflash_ray.runtime.training.step import split_oom_batches, train_step


class Prefetcher:
    """Pulls the worker's stream in a background thread from the moment the worker starts, so the Ray
    Data pipeline (and its target actors) spin up while the drafter is being built; a block is split into
    its rows there too, off the training thread."""

    _END = object()

    def __init__(self, iterable, size: int, stage=None):
        self.q = queue.Queue(maxsize=max(1, size))
        self.stage = stage   # item -> item, in this thread (GPU runs: the rows' copy to the device)
        self.thread = threading.Thread(target=self._pull, args=(iterable,), daemon=True)
        self.thread.start()

    def _pull(self, iterable):
        try:
            for item in iterable:
                self.q.put(self.stage(item) if self.stage is not None else item)
            self.q.put(self._END)
        except BaseException as e:  # re-raised in the training thread
            self.q.put(e)

    def __next__(self):
        item = self.q.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item


def next_row(stream, expected_index: int, gen: int, rank: int) -> TrainRow:
    """The next row of this worker's shard, which must be feed row `expected_index` of stream `gen`."""
    row = next(stream)
    if row.index != expected_index or row.gen != gen:
        raise RuntimeError(f"rank {rank} expected feed row {expected_index} (stream {gen}) but got row "
                           f"{row.index} (stream {row.gen}): the stream lost its order")
    return row


def worker_device(cluster, threads: int) -> torch.device:
    """This worker's device: its GPU (capped at its share of the GPU's memory), or the CPU with `threads`
    intra-op threads (one per worker: measured best on CPUs)."""
    import ray.train.torch

    if not cluster.use_gpu:
        torch.set_num_threads(threads)
        return torch.device("cpu")
    from dflash_ray.runtime.cluster import cap_gpu_memory

    device = ray.train.torch.get_device()
    torch.cuda.set_device(device)
    cap_gpu_memory(cluster.drafter_gpus)
    return device


def device_stager(device):
    """On a GPU: a function that starts a row's copy to the device on a side stream (TrainRow.stage), so the
    prefetch thread moves the next rows while the step runs; None on the CPU (nothing to copy)."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    return lambda row: row.stage(device, side)


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    from dflash_ray.runtime.training.record_client import RecordClient
    from dflash_ray.runtime.training.checkpoint import CheckpointManager
    from dflash_ray.runtime.training.faults import crash_on_poison, oom_fault, poisoned

    spec, faults = config["spec"], config.get("test_faults") or {}
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = worker_device(spec.cluster, config.get("threads", 1))
    per_step = spec.batches_per_step
    shard = ray.train.get_dataset_shard("train")   # pulled from now on: the pipeline starts while we build
    stream = Prefetcher(train_rows(shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)),
                        size=spec.train.grad_accum, stage=device_stager(device))
    record = RecordClient(spec, rank)
    feed = record.begin()
    if world * spec.train.grad_accum != feed["batches_per_step"]:
        raise RuntimeError(f"feed built for {feed['batches_per_step']} batches per step but this group of "
                           f"{world} workers x grad_accum {spec.train.grad_accum} trains {world * spec.train.grad_accum}")

    torch.manual_seed(spec.seed + rank)
    np.random.seed((spec.seed + rank) % 2**32)
    drafter, model, opt, sched = build_model(spec, device, world, feed["schedule_steps"])
    checkpoints = CheckpointManager(spec.train, drafter=drafter, optimizer=opt, scheduler=sched, record=record,
                                    rank=rank, world_size=world, device=device, run_name=spec.name, faults=faults)
    cursor, nonfinite_streak = checkpoints.restore()
    start = Cursor.from_dict(feed["cursor"])
    if cursor != start:
        raise RuntimeError(f"the data stream starts at {start} but the checkpoint resumes at {cursor}: "
                           "the controller's checkpoint record and the checkpoint disagree")
    record.begin_attempt(cursor.step, world)

    # bf16 autocast over fp32 weights (GPUs; CPUs when model.compute_dtype says so)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if spec.compute_dtype == "bfloat16" \
        else contextlib.nullcontext
    all_reduce = dist.all_reduce if world > 1 else None
    max_nonfinite = spec.train.max_nonfinite_steps   # 0: skip and count, never stop
    max_skipped = spec.train.max_skipped_batches     # batches that do not fit as single rows, in a row
    split_on_oom = split_oom_batches(spec.train.oom_split, device, drafter)
    oom_streak = 0
    compiled = device.type == "cuda" and spec.train.compile   # as build_model decides
    steps = feed["total_steps"] - cursor.step
    t_step = time.perf_counter()
    for s in range(steps):
        t_wait = time.perf_counter()
        rows = [next_row(stream, idx, feed["gen"], rank) for idx in rank_rows(s, per_step, world, rank)]
        rows = poisoned(rows, cursor.step + 1, rank, faults)   # test-only (DFLASH_TEST_FAULTS)
        t_compute, cpu_compute = time.perf_counter(), time.thread_time()
        record.in_flight(cursor.step + 1, rows)   # what a worker group that dies had in flight (quarantine)
        try:
            crash_on_poison(rows, faults)   # test-only: a batch that ends its worker every time
            result = train_step(model, drafter, opt, sched, rows, rank=rank, workers=world, batches_per_step=per_step,
                                seed=spec.seed, grad_clip=spec.train.grad_clip, device=device, autocast=autocast,
                                all_reduce=all_reduce, split_on_oom=split_on_oom,
                                fault=oom_fault(faults, cursor.step + 1, rank))   # test-only fault, else None
        except Exception as e:
            record.step_failed(cursor.step + 1, rows, e)
            raise
        record.in_flight(cursor.step + 1, [])   # done: a failure from here on (a checkpoint, the next batch's
                                                # wait) is not these batches'
        now, cpu_now = time.perf_counter(), time.thread_time()
        step, consumed = cursor.step + 1, (s + 1) * per_step
        cursor = cursor_after(result.epoch, result.positions, rows[0].epoch_batches, step)
        # the same on every rank (train_step decides from all-reduced values): they stop together
        nonfinite_streak = nonfinite_streak + 1 if result.skipped_nonfinite else 0
        oom_streak = oom_streak + 1 if result.skipped_oom else 0
        stop_nonfinite = bool(max_nonfinite) and nonfinite_streak >= max_nonfinite
        stop_oom = bool(max_skipped) and oom_streak >= max_skipped
        stop = stop_nonfinite or stop_oom
        if rank == 0 and (result.oom_splits or result.skipped_oom):
            print(f"step {step}: " + (f"a batch did not fit even as single rows: skipped, no update ({oom_streak} "
                                      f"in a row; train.max_skipped_batches={max_skipped})" if result.skipped_oom
                                      else f"{result.oom_splits} batch(es) ran out of device memory and were "
                                           "trained in slices of their rows (train.oom_split)"), flush=True)
        # compute_cpu_seconds: this thread's CPU in the step (one intra-op thread on a CPU worker): what the
        # model costs here, under DDP and the machine's load (benchmarks/bench_load.py)
        timings = {"step_seconds": now - t_step, "wait_seconds": t_compute - t_wait,
                   "compute_seconds": now - t_compute, "compute_cpu_seconds": cpu_now - cpu_compute}
        if compiled:   # a recompile costs a step seconds to minutes: the metrics line shows when one happened
            timings["compiled_graphs"] = compiled_graphs()
        if device.type == "cuda":   # against the memory model (sizing/memory.py)
            timings["device_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        record.step(s, step, result, timings=timings, epoch_batches=rows[0].epoch_batches,
                    nonfinite_streak=nonfinite_streak, oom_streak=oom_streak, drafter=drafter)
        t_step = now
        if stop:
            # no checkpoint: the last one holds the weights of the last good step (skipped steps change
            # none), and a rerun retries these batches from there
            if stop_oom:
                record.stop(consumed, {"reason": "oom", "step": step, "streak": oom_streak,
                                       "first_step": step - oom_streak + 1, "limit": max_skipped,
                                       "buckets": [b for b in result.buckets if b >= 0]})
            else:
                record.stop(consumed, {"reason": "nonfinite", "step": step, "streak": nonfinite_streak,
                                       "first_step": step - nonfinite_streak + 1, "limit": max_nonfinite,
                                       "loss": result.loss, "grad_norm": result.grad_norm})
            return
        # an epoch's end and the feed's last step always; a checkpoint sends the step's lines itself
        if not checkpoints.save(step, cursor, force=s == steps - 1 or cursor.position == 0, loss=result.loss,
                                consumed=consumed, nonfinite_streak=nonfinite_streak):
            record.send_due(s, consumed)
