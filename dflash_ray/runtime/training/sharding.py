"""The drafter across ranks: DDP (every rank holds the whole drafter, its gradients and AdamW state) or FSDP
(PyTorch's `fully_shard`: each rank holds 1/N of them and gathers one layer's weights at a time), chosen by
`train.parallelism` (auto: DDP when the memory model says the step fits a drafter's share of a GPU, else
FSDP; runtime/spec.py `choose_parallelism`). No Ray.

FSDP's checkpoints are gathered on save: rank 0 writes the same files as under DDP (one safetensors file of
full weights, the optimizer state keyed by parameter name), so a checkpoint resumes on any world size and
either parallelism, and the export is unchanged. Gathering costs rank 0 host memory of the full state (16 B
a parameter: ~74 GB for a Llama-3.3-70B drafter's ~4.6B parameters, against the 1-2 TB of an 8-GPU node),
and every rank one all-gather of it; a sharded format (torch.distributed.checkpoint) would save that, but
needs every rank's storage and a reshard on another world size: not needed at these sizes.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

PARALLELISMS = ("auto", "ddp", "fsdp")


def is_sharded(model) -> bool:
    """An FSDP-wrapped model (fully_shard gives it set_requires_gradient_sync)."""
    return hasattr(model, "set_requires_gradient_sync")


def shard(drafter, loss_module, device):
    """fully_shard each decoder layer, then the rest of the drafter (its fc, norms; the frozen embedding and
    head are buffers and stay whole on every rank); the loss module runs the sharded drafter. Returns the
    module the forward runs through (the loss module, whose drafter is now sharded)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # fp32 weights and gradients as under DDP (autocast makes the matmuls bf16 on GPUs)
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for layer in drafter.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(drafter, mp_policy=policy)
    return loss_module


def micro_step(model, last: bool):
    """The context of one micro-step: gradients synchronised on the step's last micro-step only (DDP's
    no_sync before it; FSDP's reduce-scatter switched off before it)."""
    if is_sharded(getattr(model, "drafter", model)):
        getattr(model, "drafter", model).set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if (not last and no_sync is not None) else contextlib.nullcontext()


def full_value(t) -> torch.Tensor:
    """A DTensor (FSDP's gradient norm, its parameters) as a whole tensor; a tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trainable_names(drafter: nn.Module) -> list[str]:
    """The names of the trainable parameters, in the optimizer's order (drafter.trainable_parameters)."""
    return [n for n, p in drafter.named_parameters() if p.requires_grad]


def optimizer_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state_dict keyed by parameter index (torch's own) -> keyed by parameter name (the
    form torch.distributed.checkpoint sets on a sharded model)."""
    return {"state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_by_index(state: dict, names: list[str]) -> dict:
    """The inverse of `optimizer_by_name`."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def gather_full_state(drafter, optimizer) -> tuple[dict, dict]:
    """Every rank calls it (collectives): the full weights and the optimizer state by parameter name, on the
    host of rank 0 ({} on the others)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(drafter, options=opts), get_optimizer_state_dict(drafter, optimizer, options=opts)


def load_full_state(drafter, optimizer, weights: dict, optim_by_name: dict) -> None:
    """Every rank: full weights and a by-name optimizer state into the sharded drafter and its optimizer
    (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(drafter, weights, options=opts)
    set_optimizer_state_dict(drafter, optimizer, optim_by_name, options=StateDictOptions(full_state_dict=True))
