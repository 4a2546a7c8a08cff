"""The Ray Train worker loop: rows -> step -> commit -> maybe checkpoint.

Each optimizer step consumes W = batches_per_step consecutive feed rows; rank r trains rows
s*W + a*workers + r (feed.rank_rows) and checks every row it receives is the one it expects. The step's
math is `step.train_step` (no Ray); this file is the glue: the worker's data shard, the coordinator
(ledger, metrics, flight window), DDP and Ray Train checkpoints.

A step whose loss or gradient is NaN/Inf trains nothing (`step.train_step` skips the update on every rank)
but its batches count as consumed: its ledger line says `"skipped": "nonfinite"` and the plan's
exactly-once accounting goes on (retrying the batch would give the same NaN: same features, same anchors).
After `train.max_nonfinite_steps` such steps in a row the workers stop together, without a checkpoint (the
last one holds the weights of the last good step), and the driver raises one line (trainer.fit).
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dflash_ray.runtime.stream.feed import Cursor, cursor_after, rank_rows
from dflash_ray.runtime.stream.rows import TrainRow, train_rows
from dflash_ray.runtime.training.step import LossModule, StepResult, build_run_drafter, make_optimizer, train_step


class Prefetcher:
    """Pulls the worker's stream in a background thread from the moment the worker starts, so the Ray
    Data pipeline (and its target actors) spin up while the drafter is being built; a block is split into
    its rows there too, off the training thread."""

    _END = object()

    def __init__(self, iterable, size: int):
        self.q = queue.Queue(maxsize=max(1, size))
        self.thread = threading.Thread(target=self._pull, args=(iterable,), daemon=True)
        self.thread.start()

    def _pull(self, iterable):
        try:
            for item in iterable:
                self.q.put(item)
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


# Rank 0 sends its steps' ledger and metrics lines to the coordinator at least this often (and at every
# checkpoint, and whenever the flight window needs the rows it has trained): one actor call a step costs the
# coordinator ~1 ms of CPU, which matters only for tiny steps (benchmarks/bench_load.py), not at GPU scale.
COMMIT_INTERVAL_S = 0.5


def commit_due(s: int, since_sent: float, unreported_rows: int, report_slack_rows: int) -> bool:
    """Rank 0 sends its unsent commits after step s (0-based, of this attempt): the first step at once
    (start-up and progress show it), then every COMMIT_INTERVAL_S, and whenever the rows trained but not
    reported exceed the flight window's slack for them (coordinator.reset_feed: 0, every step, unless a
    stream block holds several rows), so the window the stream sees is never short of what it needs."""
    return s == 0 or since_sent >= COMMIT_INTERVAL_S or unreported_rows > report_slack_rows


def step_record(result: StepResult, step: int) -> dict:
    """The ledger line of a committed step (a skipped one is marked: its batches trained nothing)."""
    record = {"epoch": result.epoch, "step": step, "positions": result.positions, "buckets": result.buckets,
              "tokens": result.batch_tokens}
    if result.skipped_nonfinite:
        record["skipped"] = "nonfinite"
    return record


# ---------------------------------------------------------------- test-only fault injection
TEST_FAULTS_ENV = "DFLASH_TEST_FAULTS"


def faults_for_tests() -> dict:
    """Faults the reliability tests inject (tests/reliability/), as JSON in $DFLASH_TEST_FAULTS; read on
    the driver (trainer.fit) and handed to the workers in the loop's config, since a Ray worker does not
    see the driver's later environment. Empty in any real run. Keys:

      nonfinite         {"steps": [s, ...], "rank": r}: rank r's batches of those steps get a NaN context
                        feature (as a broken target forward would deliver)
      checkpoint_pause  {"step": s, "seconds": t, "where": "write" | "upload", "attempts": [a, ...]}: rank 0
                        stops for t seconds inside the checkpoint of step s, after drafter.safetensors is
                        written ("write") or after its files are in storage, before the checkpoint is
                        registered ("upload"), having logged a `test_fault` event (with its pid) first
    """
    raw = os.environ.get(TEST_FAULTS_ENV)
    return json.loads(raw) if raw else {}


def _poison(row: TrainRow) -> TrainRow:
    """The row with a NaN in its first context feature (any encoding)."""
    import dataclasses

    from dflash_ray.runtime.stream.rows import decode_features, encode_features

    context = decode_features(row.context, row.context_dtype).clone()
    context.view(-1)[0] = float("nan")
    encoded, dtype = encode_features(context)
    return dataclasses.replace(row, context=encoded, context_dtype=dtype)


def rank0_value(value: float, device: torch.device, world_size: int) -> float:
    """Rank 0's `value` on every rank (one float broadcast; on the model's device, as NCCL needs): a
    decision taken from it is the same on every rank."""
    if world_size <= 1:
        return float(value)
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


def train_loop_per_worker(config: dict) -> None:
    import ray
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from dflash_ray.runtime.training.checkpoint import (checkpoint_due, load_checkpoint, read_state,
                                               remove_orphaned_local_checkpoints, save_checkpoint)

    run_spec = config["spec"]
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    use_gpu = run_spec.cluster.use_gpu
    device = ray.train.torch.get_device() if use_gpu else torch.device("cpu")
    if use_gpu:
        from dflash_ray.runtime.cluster import cap_gpu_memory

        torch.cuda.set_device(device)
        cap_gpu_memory(run_spec.cluster.drafter_gpus)
    else:
        torch.set_num_threads(int(config.get("threads", 1)))
    grad_accum, per_step = run_spec.train.grad_accum, run_spec.batches_per_step
    remove_orphaned_local_checkpoints()  # left by a worker of this node killed while checkpointing
    shard = ray.train.get_dataset_shard("train")
    stream = Prefetcher(train_rows(shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)),
                        size=grad_accum)
    coord = ray.get_actor(run_spec.coordinator, namespace=run_spec.namespace)
    coord.worker_started.remote(rank, os.getpid(), ray.get_runtime_context().get_node_id())
    feed = ray.get(coord.feed_info.remote())
    gen, total_steps = feed["gen"], feed["total_steps"]
    if world_size * grad_accum != feed["batches_per_step"]:
        raise RuntimeError(f"feed built for {feed['batches_per_step']} batches per step but this group of "
                           f"{world_size} workers x grad_accum {grad_accum} trains {world_size * grad_accum}")

    torch.manual_seed(run_spec.seed + rank)
    np.random.seed((run_spec.seed + rank) % 2**32)
    drafter = build_run_drafter(run_spec, device)
    if device.type == "cuda" and run_spec.train.compile:
        drafter.compile_layers()  # GPU only (not run here yet: benchmarks/gpu_check.sh times the same call)
    model = LossModule(drafter)
    if world_size > 1:
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets (no second copy of them)
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
            gradient_as_bucket_view=True)
    opt, sched = make_optimizer(run_spec.train, drafter, feed["schedule_steps"])

    cursor = Cursor()
    nonfinite_streak = 0   # non-finite steps in a row up to the cursor (kept in the checkpoint)
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            cursor = load_checkpoint(Path(d), drafter=drafter, optimizer=opt, scheduler=sched, rank=rank)
            nonfinite_streak = int(read_state(Path(d)).get("nonfinite_streak", 0))
    start = Cursor.from_dict(feed["cursor"])
    if cursor != start:
        raise RuntimeError(f"the data stream starts at {start} but the checkpoint resumes at {cursor}: "
                           "the controller's checkpoint record and the checkpoint disagree")
    attempt = ray.get(coord.begin_attempt.remote(cursor.step, world_size))["attempt"] if rank == 0 else 0

    if device.type == "cuda":
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731  (fp32 weights)
    else:
        autocast = contextlib.nullcontext
    all_reduce = dist.all_reduce if world_size > 1 else None
    steps = total_steps - cursor.step
    pending_commits = []  # rank 0's ledger writes since the last checkpoint
    unsent = []           # rank 0's commits (ledger line, metrics line) not sent yet (commit_due)
    reported, t_sent = 0, time.perf_counter()   # feed rows of this stream reported consumed, and when
    slack = int(feed.get("report_slack_rows", 0))

    def send_commits(consumed: int, extra: dict | None = None):
        # rank 0: the unsent ledger and metrics lines (`extra` joins the last one's metrics), and the
        # feed rows trained so far
        nonlocal reported, t_sent
        if extra:
            unsent[-1] = (unsent[-1][0], {**unsent[-1][1], **extra})
        pending_commits.append(coord.commit_steps.remote(gen, list(unsent), consumed))
        unsent.clear()
        reported, t_sent = consumed, time.perf_counter()

    train = run_spec.train
    upload = train.checkpoint_upload
    max_nonfinite = int(getattr(train, "max_nonfinite_steps", 10) or 0)  # 0: skip and count, never stop
    faults = config.get("test_faults") or {}
    poison = faults.get("nonfinite") or {}
    pause = faults.get("checkpoint_pause") or {}
    t_step = t_checkpoint = time.perf_counter()  # rank 0's clock decides the time-based interval
    for s in range(steps):
        t_wait = time.perf_counter()
        rows = [next_row(stream, idx, gen, rank) for idx in rank_rows(s, per_step, world_size, rank)]
        if cursor.step + 1 in poison.get("steps", ()) and rank == poison.get("rank", 0):
            rows = [_poison(r) for r in rows]   # test-only (DFLASH_TEST_FAULTS)
        t_compute, cpu_compute = time.perf_counter(), time.thread_time()
        result = train_step(model, drafter, opt, sched, rows, rank=rank, workers=world_size,
                            batches_per_step=per_step, seed=run_spec.seed, grad_clip=run_spec.train.grad_clip,
                            device=device, autocast=autocast, all_reduce=all_reduce)
        now, cpu_now = time.perf_counter(), time.thread_time()
        step = cursor.step + 1
        epoch_batches = rows[0].epoch_batches
        cursor = cursor_after(result.epoch, result.positions, epoch_batches, step)
        # the same on every rank (train_step decides from all-reduced values): they stop together
        nonfinite_streak = nonfinite_streak + 1 if result.skipped_nonfinite else 0
        stop = bool(max_nonfinite) and nonfinite_streak >= max_nonfinite
        if rank == 0:
            real = [p for p in result.positions if p >= 0]
            metrics = {"step": step, "epoch": result.epoch, "loss": result.loss, "tokens": result.tokens,
                       "weight_sum": result.weight_sum, "lr": result.lr, "grad_norm": result.grad_norm,
                       "step_seconds": now - t_step, "wait_seconds": t_compute - t_wait,
                       "compute_seconds": now - t_compute,
                       # this thread's CPU in the step (torch runs one intra-op thread on a CPU worker):
                       # what the model costs here, under DDP and the machine's load (bench_load.py)
                       "compute_cpu_seconds": cpu_now - cpu_compute, "slot_accuracy": result.slot_accuracy,
                       "train_tau": result.train_tau,
                       "train_tau_if_slots_independent": result.train_tau_if_slots_independent,
                       "epoch_progress": (max(real) + 1) / epoch_batches if real else 1.0,
                       "total_steps": total_steps, "schedule_steps": feed["schedule_steps"],
                       "batches_per_step": per_step, "skipped_nonfinite": int(result.skipped_nonfinite),
                       "nonfinite_streak": nonfinite_streak, "time": time.time()}
            unsent.append((step_record(result, step), metrics))
            every = run_spec.train.heldout_every
            if run_spec.heldout and every and step % every == 0:
                # the coordinator evaluates it in a task of its own: training goes on meanwhile
                weights = ray.put({k: v.detach().cpu() for k, v in drafter.state_dict().items()})
                coord.evaluate_heldout.remote(run_spec, step, [weights])
        t_step = now
        consumed = (s + 1) * per_step
        if stop:
            # no checkpoint: the last one holds the weights of the last good step (skipped steps change
            # none), and a rerun retries these batches from there
            if rank == 0:
                send_commits(consumed)
                ray.get(pending_commits)
                ray.get(coord.stop_run.remote({
                    "reason": "nonfinite", "step": step, "streak": nonfinite_streak,
                    "first_step": step - nonfinite_streak + 1, "limit": max_nonfinite,
                    "loss": result.loss, "grad_norm": result.grad_norm}))
            return
        # every rank decides from rank 0's clock (a broadcast; only when the time-based interval is on)
        since = time.perf_counter() - t_checkpoint
        if train.checkpoint_every_minutes:
            since = rank0_value(since, device, world_size)
        due = checkpoint_due(step, train.checkpoint_every, train.checkpoint_every_minutes, since,
                             last_step=s == steps - 1, end_of_epoch=cursor.position == 0)
        if not due:
            if rank == 0 and commit_due(s, time.perf_counter() - t_sent, consumed - reported, slack):
                send_commits(consumed)
                if len(pending_commits) > 64:   # forget the finished ones (a long checkpoint interval)
                    pending_commits[:] = ray.wait(pending_commits, num_returns=len(pending_commits), timeout=0)[1]
            continue
        if rank == 0:   # the target actors go on with the next rows while the checkpoint is written
            coord.consumed_upto.remote(gen, consumed)
        t0 = time.perf_counter()

        def ledger_on_disk(cost: dict):
            # the step's metrics line says what its checkpoint cost to write; ledger lines <= this step
            # are on disk before the checkpoint exists (an async actor does not promise to run calls in
            # order: wait for each one)
            send_commits(consumed, {**cost, "checkpoint_upload": upload})
            ray.get(pending_commits)
            pending_commits.clear()

        def uploaded(seconds: float, step=step):
            # rank 0's files are in storage; waited for, so the coordinator has it before the checkpoint
            # is registered (and before the run ends: the last async upload is flushed before that)
            ray.get(coord.checkpoint_uploaded.remote(attempt, step, seconds))

        fault_pause = None
        if rank == 0 and pause.get("step") == step and attempt in pause.get("attempts", [attempt]):
            def fault_pause(step=step):  # test-only (DFLASH_TEST_FAULTS): a window to kill a process in
                ray.get(coord.fault_injected.remote("checkpoint_pause", step=step, where=pause.get("where", "write"),
                                                pid=os.getpid(), attempt=attempt))
                time.sleep(float(pause.get("seconds", 60)))

        cost = save_checkpoint(rank=rank, world_size=world_size, drafter=drafter, optimizer=opt, scheduler=sched,
                               cursor=cursor, metrics={"step": step, "loss": result.loss},
                               before_register=ledger_on_disk, on_uploaded=uploaded, upload=upload,
                               extra={"run": run_spec.name, "nonfinite_streak": nonfinite_streak},
                               fault_pause=fault_pause, fault_pause_where=pause.get("where", "write"))
        t_checkpoint = time.perf_counter()
        if rank == 0:
            # seconds: what training waited (write, ledger, barrier, and the upload unless it is async)
            coord.checkpoint_done.remote(step, t_checkpoint - t0, attempt=attempt, upload=upload,
                                         write_seconds=cost.get("checkpoint_write_seconds"),
                                         nbytes=cost.get("checkpoint_bytes"))
