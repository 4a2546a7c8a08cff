"""The Ray Train worker loop: the drafter step, DDP over the drafter workers, accumulation, checkpoints.

Each optimizer step consumes W = workers x grad_accum consecutive feed rows; rank r trains rows
s*W + a*workers + r (feed.rank_rows) and checks every row it receives is the one it expects. The loss of
the step is sum(loss_sum) / sum(weight_sum) over every rank and micro-step: each micro-step backpropagates
its un-normalised loss_sum (times the world size, which DDP's gradient averaging divides away), then the
weight sums are all-reduced and the gradients divided by the global sum before clipping, so batches of
different sizes weigh exactly by their supervised slots.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dflash_ray.runtime.feed import FILLER, Cursor, cursor_after, rank_rows


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warmup over warmup_ratio of the steps, then cosine decay to zero."""
    warm = max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total_steps - warm)
        progress = min(1.0, (step - warm) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """The anchor-sampling seed of one plan batch: the same whichever rank trains it, whenever."""
    return int(np.random.SeedSequence([int(seed), int(epoch), int(position), 7]).generate_state(1)[0])


class LossModule(nn.Module):
    """What DDP wraps: forward = the drafter's training loss (DDP's hooks fire only on forward)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter
        # the frozen target embedding/head are buffers: never broadcast them
        self._ddp_params_and_buffers_to_ignore = ["drafter.embed_weight", "drafter.lm_head_weight"]

    def forward(self, input_ids, loss_mask, context, lengths, generator):
        out = self.drafter.training_loss(input_ids, loss_mask, context, lengths, generator)
        return out.loss_sum, out.weight_sum, out.slot_correct, out.slot_count


def build_model(spec, device):
    from transformers import AutoConfig

    from dflash_ray.model.drafter import build_drafter
    from dflash_ray.model.target import load_embed_and_head

    embed, head = load_embed_and_head(spec.target_path)
    e = embed.to(device)
    h = e if head is embed else head.to(device)
    tcfg = AutoConfig.from_pretrained(spec.target_path)
    drafter = build_drafter(spec.model_cfg, tcfg, e, h, spec.mask_token_id, seed=spec.seed)
    return drafter.to(device)


def make_optimizer(spec, drafter, total_steps: int):
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, spec.warmup_ratio))
    return opt, sched


def _to_tensors(batch, device):
    from dflash_ray.runtime.pipeline import context_tensor

    ids = torch.from_numpy(batch["input_ids"][0].astype(np.int64)).to(device)
    mask = torch.from_numpy(batch["loss_mask"][0].astype(np.int64)).to(device)
    lengths = torch.from_numpy(batch["lengths"][0].astype(np.int64)).to(device)
    ctx = context_tensor(batch).to(device)
    return ids, mask, ctx, lengths


class Prefetcher:
    """Pulls the worker's stream in a background thread from the moment the worker starts, so the Ray
    Data pipeline (and its target actors) spin up while the drafter is being built."""

    _END = object()

    def __init__(self, iterable, size: int):
        import queue
        import threading

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


def train_loop_per_worker(config: dict) -> None:
    import ray
    import ray.train
    import ray.train.torch
    import torch.distributed as dist
    from ray.train import Checkpoint

    from dflash_ray.model.loss import expected_acceptance_length
    from dflash_ray.runtime.checkpoint import cursor_metrics, load_checkpoint, write_checkpoint, write_rank_files

    spec = config["spec"]
    ctx = ray.train.get_context()
    rank, n = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if spec.use_gpu else torch.device("cpu")
    if not spec.use_gpu:
        torch.set_num_threads(int(config.get("threads", 1)))
    shard = ray.train.get_dataset_shard("train")
    it = Prefetcher(shard.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=1),
                    size=spec.grad_accum)
    coord = ray.get_actor(spec.coordinator, namespace=spec.namespace)
    coord.worker_started.remote(rank, os.getpid(), ray.get_runtime_context().get_node_id())
    feed = ray.get(coord.feed_info.remote())
    gen, total_steps = feed["gen"], feed["total_steps"]
    world, accum = n * spec.grad_accum, spec.grad_accum
    if world != feed["world"]:
        raise RuntimeError(f"feed built for W={feed['world']} but this group has W={world}")

    torch.manual_seed(spec.seed + rank)
    np.random.seed((spec.seed + rank) % 2**32)
    drafter = build_model(spec, device)
    wrapper = LossModule(drafter)
    model = wrapper
    if n > 1:
        model = nn.parallel.DistributedDataParallel(
            wrapper, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    opt, sched = make_optimizer(spec, drafter, feed["schedule_steps"])

    cursor = Cursor()
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            cursor = load_checkpoint(Path(d), drafter=drafter, optimizer=opt, scheduler=sched, rank=rank)
    start = Cursor.from_dict(feed["cursor"])
    if cursor != start:
        raise RuntimeError(f"the data stream starts at {start} but the checkpoint resumes at {cursor}: "
                           "the controller's checkpoint record and the checkpoint disagree")
    if rank == 0:
        ray.get(coord.begin_attempt.remote(cursor.step, n))

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    params = drafter.trainable_parameters()
    bsz = drafter.block_size
    steps = total_steps - cursor.step
    dummy = None
    t_step = time.perf_counter()
    pending_commits = []  # rank 0's ledger writes since the last checkpoint
    for s in range(steps):
        t_wait = time.perf_counter()
        micro = []
        for idx in rank_rows(s, world, n, rank):
            b = next(it)
            if int(b["index"][0]) != idx or int(b["gen"][0]) != gen:
                raise RuntimeError(f"rank {rank} expected feed row {idx} (stream {gen}) but got row "
                                   f"{int(b['index'][0])} (stream {int(b['gen'][0])}): the stream lost its order")
            micro.append(b)
        t_compute = time.perf_counter()
        # per-step stats, all-reduced once: [loss_sum, weight_sum, tokens, correct(B-1), count(B-1),
        #                                    then per row j of the step: position+1, bucket+1, tokens, epoch+1]
        head = 3 + 2 * (bsz - 1)
        stats = torch.zeros(head + 4 * world, dtype=torch.float64)
        for a, b in enumerate(micro):
            last = a == accum - 1
            position = int(b["position"][0])
            filler = position == FILLER
            if filler and not last:
                continue  # nothing to train, and no collective happens in a no_sync micro-step
            sync = contextlib.nullcontext() if (last or n == 1) else model.no_sync()
            if filler:
                if dummy is None:
                    dummy = _to_tensors(b, device)
                ids, mask, context, lengths = dummy
            else:
                ids, mask, context, lengths = _to_tensors(b, device)
            g = torch.Generator().manual_seed(batch_seed(spec.seed, int(b["epoch"][0]), max(position, 0)))
            with sync:
                with autocast:
                    loss_sum, weight_sum, correct, count = model(ids, mask, context, lengths, g)
                (loss_sum * (0.0 if filler else float(n))).backward()
            j = a * n + rank
            stats[head + 4 * j + 3] = float(b["epoch"][0]) + 1
            if filler:
                continue
            stats[0] += float(loss_sum.detach())
            stats[1] += float(weight_sum)
            stats[2] += float(b["num_tokens"][0])
            stats[3:3 + bsz - 1] += correct.double().cpu()
            stats[3 + bsz - 1:head] += count.double().cpu()
            stats[head + 4 * j] = position + 1
            stats[head + 4 * j + 1] = float(b["bucket"][0]) + 1
            stats[head + 4 * j + 2] = float(b["num_tokens"][0])
        if n > 1:
            dist.all_reduce(stats)
        total_w = float(stats[1])
        if total_w > 0:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(total_w)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)) if spec.grad_clip > 0 else 0.0
        lr = sched.get_last_lr()[0]
        if total_w > 0:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

        compute_s = time.perf_counter() - t_compute
        rows = stats[head:].view(world, 4).numpy()
        positions = [int(p) - 1 for p in rows[:, 0]]
        epoch = int(max(rows[:, 3])) - 1
        epoch_batches = int(micro[0]["epoch_batches"][0])
        step = cursor.step + 1
        cursor = cursor_after(epoch, positions, epoch_batches, step)
        now = time.perf_counter()
        if rank == 0:
            correct = stats[3:3 + bsz - 1]
            count = stats[3 + bsz - 1:head].clamp(min=1)
            acc = (correct / count).tolist()
            real = [p for p in positions if p >= 0]
            record = {"epoch": epoch, "step": step, "positions": positions,
                      "buckets": [int(x) - 1 for x in rows[:, 1]], "tokens": [int(x) for x in rows[:, 2]]}
            metrics = {"step": step, "epoch": epoch, "loss": float(stats[0]) / max(total_w, 1e-12),
                       "tokens": int(stats[2]), "weight_sum": total_w, "lr": lr, "grad_norm": grad_norm,
                       "step_seconds": now - t_step, "wait_seconds": t_compute - t_wait,
                       "compute_seconds": compute_s, "slot_accuracy": acc,
                       "acceptance_length": float(expected_acceptance_length(acc)),
                       "epoch_progress": (max(real) + 1) / epoch_batches if real else 1.0,
                       "total_steps": total_steps, "schedule_steps": feed["schedule_steps"], "world": world}
            pending_commits.append(coord.commit_step.remote(gen, record, metrics))
            coord.consumed_upto.remote(gen, (s + 1) * world)
        t_step = now
        end_of_epoch = cursor.position == 0
        if step % spec.checkpoint_every == 0 or s == steps - 1 or end_of_epoch:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
                tmp = Path(tmp)
                if rank == 0:
                    write_checkpoint(tmp, drafter=drafter, optimizer=opt, scheduler=sched, cursor=cursor,
                                     world_size=n, extra={"run": spec.run_name})
                    # ledger lines <= this step are on disk before the checkpoint exists (an async
                    # actor does not promise to run calls in order: wait for each one)
                    ray.get(pending_commits)
                    pending_commits.clear()
                else:
                    write_rank_files(tmp, rank)
                ray.train.report({**cursor_metrics(cursor), "step": step, "loss": float(stats[0]) / max(total_w, 1e-12)},
                                 checkpoint=Checkpoint.from_directory(str(tmp)))
            if rank == 0:
                coord.checkpoint_done.remote(step, time.perf_counter() - t0)
