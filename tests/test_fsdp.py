"""train.parallelism=fsdp on the CPU (gloo) at tiny shapes: a 2-rank FSDP step is the 2-rank DDP step (loss
and updated weights), a filler micro-step included; a checkpoint gathered from FSDP restores whole on 1 rank
(plain) and on 3 ranks (FSDP, DDP) and the runs go on alike. Real torch.distributed process groups in
spawned processes, the runtime's own train_step, build pieces and checkpoint functions."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers_model import tiny_step_drafter
from helpers_ranks import init_ranks

MASK, WIDTH = 299, 16


def _row(index, position, seed, width, filler=False):
    from test_runtime_step import make_row

    return make_row(index, position, 2, WIDTH, width, seed, filler=filler)


def _build(root: Path, mode: str, world: int, init):
    """The drafter, built before the process group exists (transformers' save_pretrained writes on rank 0
    only once one does), then wrapped for `mode`."""
    from torch import nn

    from dflash_ray.runtime.training.model import LossModule, lr_lambda
    from dflash_ray.runtime.training.sharding import shard

    drafter, width = tiny_step_drafter(root)
    init()
    model = LossModule(drafter)
    if world > 1 and mode == "fsdp":
        model = shard(drafter, model, torch.device("cpu"))
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.0))
    return drafter, model, opt, sched, width


def _steps(drafter, model, opt, sched, width, rank, world, steps, first_step=0, filler_at=None):
    """`steps` optimizer steps of W = world x 2 batches, rank r training feed rows rank_rows(s, W, world, r);
    the step `filler_at`'s last feed row is a filler (an epoch's end)."""
    import torch.distributed as dist

    from dflash_ray.runtime.stream.feed import rank_rows
    from dflash_ray.runtime.training.step import train_step

    per_step, losses = world * 2, []
    for s in range(first_step, first_step + steps):
        rows = [_row(i, i, 100 + i, width, filler=(s == filler_at and i == (s + 1) * per_step - 1))
                for i in rank_rows(s, per_step, world, rank)]
        r = train_step(model, drafter, opt, sched, rows, rank=rank, workers=world, batches_per_step=per_step,
                       seed=0, grad_clip=1.0, device=torch.device("cpu"),
                       all_reduce=dist.all_reduce if world > 1 else None)
        losses.append(r.loss)
    return losses


def _full(drafter, opt):
    """(weights, optimizer state by parameter name) whole, on rank 0 ({} elsewhere under FSDP): copies,
    as later steps change the live tensors."""
    import copy

    from dflash_ray.runtime.training.sharding import (gather_full_state, is_sharded, optimizer_by_name,
                                                      trainable_names)

    if is_sharded(drafter):
        return copy.deepcopy(gather_full_state(drafter, opt))
    return ({k: v.detach().clone() for k, v in drafter.state_dict().items()},
            copy.deepcopy(optimizer_by_name(opt.state_dict(), trainable_names(drafter))))


def _train(rank, world, store, modes, root, out, ckpt):
    """Two steps in each of `modes`, one after the other in the same processes (a process group each): a
    spawn's start-up (torch, transformers, the package imported again) is paid once for all of them."""
    import torch.distributed as dist

    from dflash_ray.runtime.stream.feed import Cursor
    from dflash_ray.runtime.training.checkpoint_format import gather_state, write_checkpoint, write_rank_files

    torch.set_num_threads(1)
    results = {}
    for mode in modes:
        drafter, model, opt, sched, width = _build(Path(root) / mode / f"r{rank}", mode, world,
                                                   lambda: init_ranks(rank, world, store, mode))
        try:
            losses = _steps(drafter, model, opt, sched, width, rank, world, 2, filler_at=1)
            weights, optim = _full(drafter, opt)
            snap = gather_state(drafter, opt, sched, rank) if mode == "fsdp" else None
            if snap is not None or (mode == "fsdp" and rank != 0):   # every rank's RNG file, as save_checkpoint does
                Path(ckpt).mkdir(parents=True, exist_ok=True)
                write_rank_files(Path(ckpt), rank)
            if rank == 0:
                results[mode] = {"losses": losses, "weights": weights, "optim": optim}
                if snap is not None:
                    write_checkpoint(Path(ckpt), cursor=Cursor(0, 2 * world * 2, 2), world_size=world,
                                     snapshot=snap)
            dist.barrier()
        finally:
            del model   # DDP's reducer goes while its process group lives (a later teardown hung under load)
            dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def _resume(rank, world, store, modes, root, out, ckpt):
    """Load the checkpoint into a drafter wrapped for each of `modes` (in turn, in the same processes), then
    one more step. World 1 runs in the calling process, without a process group."""
    import torch.distributed as dist

    from dflash_ray.runtime.training.checkpoint_format import load_checkpoint

    torch.set_num_threads(1)
    results = {}
    for mode in modes:
        init = (lambda: init_ranks(rank, world, store, mode)) if world > 1 else (lambda: None)
        drafter, model, opt, sched, width = _build(Path(root) / mode / f"r{rank}", mode, world, init)
        try:
            load_checkpoint(Path(ckpt), drafter=drafter, optimizer=opt, scheduler=sched, rank=rank)
            restored = _full(drafter, opt)
            losses = _steps(drafter, model, opt, sched, width, rank, world, 1, first_step=5)
            after = _full(drafter, opt)
            if rank == 0:
                results[mode] = {"restored": restored, "losses": losses, "after": after[0]}
        finally:
            del model
            if world > 1:
                dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def _spawn(run_ranks, fn, world, modes, tmp_path, name, ckpt):
    """`fn` on `world` ranks for every mode in `modes`; rank 0's results by mode."""
    out = tmp_path / f"{name}.pt"
    args = (list(modes), str(tmp_path / name), str(out), str(ckpt))
    if world == 1:
        fn(0, 1, None, *args)
    else:
        run_ranks(__name__, fn.__name__, world, tmp_path / f"{name}-store", *args)
    return torch.load(out, weights_only=False)


def _close(a: dict, b: dict, tol: float) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= tol, worst
    return worst


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, ranks):
    tmp = tmp_path_factory.mktemp("fsdp")
    ckpt = tmp / "ckpt"
    return tmp, ckpt, _spawn(ranks, _train, 2, ("ddp", "fsdp"), tmp, "two", ckpt)


def test_a_two_rank_fsdp_step_is_the_ddp_step(two_rank_runs):
    _, _, runs = two_rank_runs
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    # the same loss (the stats all-reduce is the same), the same AdamW update up to the order of float sums
    # (FSDP reduce-scatters the gradients where DDP all-reduces them)
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-6, abs=0)
    _close(fsdp["weights"], ddp["weights"], 1e-6)
    for name, state in ddp["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(fsdp["optim"]["state"][name][k], state[k], rtol=1e-5, atol=1e-9), (name, k)


def test_an_fsdp_checkpoint_restores_whole_on_one_and_three_ranks_and_goes_on_alike(two_rank_runs, ranks):
    from safetensors.torch import load_file

    tmp, ckpt, runs = two_rank_runs
    saved = load_file(str(ckpt / "drafter.safetensors"))
    saved_optim = torch.load(ckpt / "optim.pt", weights_only=False)["optimizer_by_name"]
    _close(saved, runs["fsdp"]["weights"], 0.0)                          # the files are the gathered state
    one = _spawn(ranks, _resume, 1, ("ddp",), tmp, "one", ckpt)["ddp"]          # plain, in this process
    on_three = _spawn(ranks, _resume, 3, ("fsdp", "ddp"), tmp, "three", ckpt)
    three, three_ddp = on_three["fsdp"], on_three["ddp"]                  # sharded three ways; DDP
    for run in (one, three, three_ddp):                                   # restored exactly, whatever the world
        weights, optim = run["restored"]
        _close(weights, saved, 0.0)
        for name, state in saved_optim["state"].items():
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(optim["state"][name][k], state[k]), (name, k)
    # the next step of 6 batches on three ranks: FSDP and DDP alike
    assert three["losses"] == pytest.approx(three_ddp["losses"], rel=1e-6)
    _close(three["after"], three_ddp["after"], 1e-6)


@pytest.mark.slow
def test_the_job_with_a_sharded_drafter_trains_the_ddp_runs_weights(train_run, job_run):
    """train.parallelism=fsdp through the runtime (two Ray Train workers on gloo, gathered async checkpoints
    every 4 steps and at each epoch's end): every planned batch once, the reference (DDP) run's steps, and
    its final weights up to the order of float sums."""
    from dflash_ray.runtime.training.checkpoint_format import load_weights, read_state
    from helpers_cluster import RUNTIME_RUN

    _, s = train_run("fsdp", [*RUNTIME_RUN, "train.parallelism=fsdp"])
    ref = job_run["summary"]
    assert s["steps"] == ref["steps"] and s["tokens"] == ref["tokens"] and s["ledger"]["ok"] is True
    assert [c["step"] for c in s["checkpoints"]] == [c["step"] for c in ref["checkpoints"]]
    assert "optimizer_by_name" in torch.load(Path(s["checkpoint"]) / "optim.pt", weights_only=False)
    assert read_state(Path(s["checkpoint"]))["world_size"] == 2
    _close(load_weights(Path(s["checkpoint"])), load_weights(Path(ref["checkpoint"])), 1e-5)
