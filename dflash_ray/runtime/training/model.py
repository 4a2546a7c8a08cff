"""The run's drafter as training holds it: built from the run spec (the target's frozen embedding and head,
a warm start from an export), the loss module DDP wraps, and the optimizer with its LR schedule. No Ray."""
from __future__ import annotations

import math

import torch
from torch import nn


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warmup over warmup_ratio of the steps, then cosine decay to zero.

    Not transformers' get_cosine_schedule_with_warmup, which differs in two places: its warmup starts at 0
    (the first step would train at LR 0; here it is lr/warm), and past the last step its cosine rises again
    (here the LR stays at 0, e.g. for the steps a resumed or extended run takes beyond `total_steps`)."""
    warm = max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total_steps - warm)
        progress = min(1.0, (step - warm) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


class LossModule(nn.Module):
    """What DDP wraps: forward = the drafter's training loss (DDP's hooks fire only on forward)."""

    def __init__(self, drafter, hard_weight: float = 0.0):
        super().__init__()
        self.drafter = drafter
        self.hard_weight = float(hard_weight)   # train.distill_hard_weight (used with soft labels only)
        # the frozen target embedding/head are buffers: never broadcast them
        self._ddp_params_and_buffers_to_ignore = ["drafter.embed_weight", "drafter.lm_head_weight"]

    def forward(self, input_ids, loss_mask, context, lengths, generator, soft_labels=None, anchors=None):
        """anchors: (anchors, valid) drawn for a whole batch of which these rows are a slice; None: drawn
        here from `generator`."""
        if anchors is None:
            out = self.drafter.training_loss(input_ids, loss_mask, context, lengths, generator, soft_labels,
                                             self.hard_weight)
        else:
            out = self.drafter.loss_at_anchors(input_ids, loss_mask, context, lengths, *anchors, soft_labels,
                                               self.hard_weight)
        return out.loss_sum, out.weight_sum, out.slot_correct, out.slot_count, out.prefix_correct, out.num_blocks


def build_run_drafter(run_spec, device):
    """The run's drafter on `device`: the target's frozen embedding/head, the run's drafter config,
    initialised under the run's seed, on `device` itself (so every rank starts from the same weights; a
    drafter built on another device type, e.g. the CPU's for a CUDA run, has other initial weights), then
    overwritten by the export `run_spec.init_from` when set (a warm start)."""
    from transformers import AutoConfig

    from dflash_ray.model.drafter import build_drafter
    from dflash_ray.model.target import load_embed_and_head

    embed, head = load_embed_and_head(run_spec.target_path)
    target_config = AutoConfig.from_pretrained(run_spec.target_path)
    drafter = build_drafter(run_spec.drafter, target_config, embed, head, seed=run_spec.seed, device=device)
    drafter.recompute_layers = run_spec.train.recompute_layers
    init_from = run_spec.init_from
    if init_from:  # warm start: step 0's weights; a resume then loads its checkpoint over them as before
        from dflash_ray.errors import UserError
        from dflash_ray.model.export import init_from_export

        try:
            init_from_export(drafter, init_from)
        except ValueError as e:
            raise UserError(f"config key 'model.init_from': {e}") from e
    return drafter


def make_optimizer(train, drafter, schedule_steps: int):
    """AdamW over the drafter's trainable parameters with warmup + cosine over `schedule_steps`.
    `train` is the typed train config (lr, weight_decay, warmup_ratio)."""
    params = list(drafter.trainable_parameters())
    opt = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay,
                            fused=adamw_fused(params[0].device.type))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule_steps, train.warmup_ratio))
    return opt, sched


def adamw_fused(device_type: str) -> bool | None:
    """The fused AdamW kernel on CUDA (one kernel for all parameters: the benchmark's path, which the H200
    figures were measured with); torch's default (foreach) elsewhere, so CPU runs stay as they were."""
    return True if device_type == "cuda" else None


def build_model(run_spec, device, world_size: int, schedule_steps: int):
    """The drafter, its loss module (DDP-wrapped across workers, or over an FSDP-sharded drafter:
    train.parallelism, sharding.py), the optimizer and the LR schedule."""
    from dflash_ray.runtime.training.sharding import shard

    drafter = build_run_drafter(run_spec, device)
    model = LossModule(drafter, run_spec.train.distill_hard_weight)
    fsdp = world_size > 1 and run_spec.train.parallelism == "fsdp"
    if fsdp:
        model = shard(drafter, model, device)
    if device.type == "cuda" and run_spec.train.compile:
        drafter.compile_layers()  # GPU only (after sharding: FSDP's hooks stay outside the compiled layers)
    if world_size > 1 and not fsdp:
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets (no second copy of them)
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
            gradient_as_bucket_view=True)
    opt, sched = make_optimizer(run_spec.train, drafter, schedule_steps)
    return drafter, model, opt, sched
