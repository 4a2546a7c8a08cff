"""A NaN or Inf in a step (runtime/training/step.py, no Ray): the step makes no update, says so, and the next
finite step trains as if the bad one had never been there. The Ray run that skips, counts and stops is
in test_faults_on_ray.py."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from helpers_model import step_optimizer, tiny_step_drafter, train_row, trainable_weights
from helpers_ranks import init_ranks

from dflash_ray.runtime.stream.rows import FILLER, TrainRow
from dflash_ray.runtime.training.model import LossModule
from dflash_ray.runtime.training.step import train_step

VOCAB, MASK, BLOCK = 300, 299, 4


@pytest.fixture(scope="module")
def drafter_and_width(tmp_path_factory):
    return tiny_step_drafter(tmp_path_factory.mktemp("nonfinite"), VOCAB, MASK, BLOCK)


def row(position, width, features, seed, poison=None) -> TrainRow:
    """A trainer row as the stream delivers it; `poison` (nan/inf) fills one context feature."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (2, width), generator=g).numpy().astype(np.int32)
    mask = np.ones((2, width), np.int8)
    mask[:, : width // 4] = 0
    lengths = np.full(2, width)
    ctx = torch.randn(2, width, features, generator=g)
    if poison is not None:
        ctx[0, width - 1, 0] = poison          # one value of the last position: every block sees it
    return train_row(position, ids, mask, lengths, ctx)


adamw = step_optimizer
weights = trainable_weights


def step(drafter, opt, sched, rows, grad_clip=1.0):
    return train_step(LossModule(drafter), drafter, opt, sched, rows, rank=0, workers=1,
                      batches_per_step=len(rows), seed=0, grad_clip=grad_clip, device="cpu")


def weights(drafter):
    return [p.detach().clone() for p in drafter.trainable_parameters()]


@pytest.mark.parametrize("poison, grad_clip", [(float("nan"), 1.0), (float("inf"), 0.0)])
def test_nonfinite_context_skips_the_update(drafter_and_width, poison, grad_clip):
    """NaN/Inf in one batch's context features (with and without clipping): no weight moves, AdamW keeps
    no state for the step, the schedule advances, the step says skipped_nonfinite; a finite step after it
    then trains exactly as the second step of a run that never met the bad batch."""
    base, features = drafter_and_width
    good, bad, nxt = (row(1, 16, features, 1), row(2, 16, features, 2, poison=poison), row(3, 16, features, 3))

    drafter = copy.deepcopy(base)
    opt, sched = adamw(drafter)
    first = step(drafter, opt, sched, [good], grad_clip)
    assert not first.skipped_nonfinite and np.isfinite(first.loss)
    before, moments = weights(drafter), copy.deepcopy(opt.state_dict()["state"])
    lr_before = sched.get_last_lr()[0]

    skipped = step(drafter, opt, sched, [bad, nxt], grad_clip)   # two micro-batches, one poisoned
    assert skipped.skipped_nonfinite
    assert not (np.isfinite(skipped.loss) and np.isfinite(skipped.grad_norm))
    assert skipped.positions == [2, 3] and skipped.tokens == 64   # the batches are still accounted for
    for a, b in zip(before, weights(drafter)):
        assert torch.equal(a, b)                                    # no update
    after = opt.state_dict()["state"]
    for k in moments:                                               # AdamW's moments and count untouched
        for name in moments[k]:
            assert torch.equal(torch.as_tensor(moments[k][name]), torch.as_tensor(after[k][name]))
    assert sched.get_last_lr()[0] != lr_before                      # the schedule moved on
    assert all(p.grad is None for p in drafter.trainable_parameters())  # no NaN left behind in .grad

    # the next finite step: as the third step of a run whose second step trained nothing
    clean = copy.deepcopy(base)
    o2, s2 = adamw(clean)
    step(clean, o2, s2, [good], grad_clip)
    s2.step()                                                       # the skipped step's place in the schedule
    r_clean = step(clean, o2, s2, [nxt], grad_clip)
    r = step(drafter, opt, sched, [nxt], grad_clip)
    assert not r.skipped_nonfinite and r.loss == pytest.approx(r_clean.loss)
    for a, b in zip(weights(clean), weights(drafter)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nonfinite_parameter_skips_the_update(drafter_and_width):
    """A NaN in a trainable parameter (the loss and every gradient go NaN): nothing is written over."""
    base, features = drafter_and_width
    drafter = copy.deepcopy(base)
    opt, sched = adamw(drafter)
    p0 = drafter.trainable_parameters()[0]
    with torch.no_grad():
        p0.view(-1)[0] = float("nan")
    before = weights(drafter)
    r = step(drafter, opt, sched, [row(1, 16, features, 1)])
    assert r.skipped_nonfinite and not opt.state_dict()["state"]    # AdamW never stepped
    for a, b in zip(before, weights(drafter)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# ----------------------------------------------------------------------------- a filler whose loss is NaN
def filler(width, features, seed) -> TrainRow:
    """A filler row (position FILLER: pads an epoch's last step) with a NaN in its context features, so its
    own loss (and every derivative on its path) is NaN."""
    r = row(0, width, features, seed, poison=float("nan"))
    return dataclasses.replace(r, position=FILLER, bucket=FILLER, num_tokens=0)


def test_a_filler_whose_loss_is_nan_adds_nothing(drafter_and_width):
    """The filler as the last micro-batch (its forward runs, for DDP's collective): the step is finite and
    its update is exactly that of the real batch alone. (Its loss times 0 was NaN: the step was skipped.)"""
    base, features = drafter_and_width
    real, pad = row(1, 16, features, 1), filler(16, features, 2)
    ids, mask, context, lengths = pad.tensors("cpu")
    assert not torch.isfinite(LossModule(copy.deepcopy(base))(ids, mask, context, lengths,
                                                              torch.Generator().manual_seed(0))[0])

    alone = copy.deepcopy(base)
    o1, s1 = adamw(alone)
    r1 = step(alone, o1, s1, [real])
    padded = copy.deepcopy(base)
    o2, s2 = adamw(padded)
    r2 = step(padded, o2, s2, [real, pad])
    assert not r2.skipped_nonfinite and r2.positions == [1, FILLER] and r2.loss == r1.loss
    for a, b in zip(weights(alone), weights(padded)):
        assert torch.equal(a, b)


def _ddp_worker(rank: int, world: int, root: str) -> None:
    """One of two DDP ranks (gloo): rank 0 trains the real batch, rank 1 only a NaN filler."""
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    inputs = torch.load(f"{root}/inputs.pt", weights_only=False)
    init_ranks(rank, world, root)
    model = None
    try:
        drafter = inputs["drafter"]
        model = nn.parallel.DistributedDataParallel(LossModule(drafter), broadcast_buffers=False,
                                                    gradient_as_bucket_view=True)
        opt, sched = adamw(drafter)
        r = train_step(model, drafter, opt, sched, [inputs["rows"][rank]], rank=rank, workers=2, batches_per_step=2,
                       seed=0, grad_clip=1.0, device="cpu", all_reduce=dist.all_reduce)
        torch.save({"result": r, "weights": weights(drafter)}, f"{root}/rank{rank}.pt")
    finally:
        # DDP's reducer goes while its process group is alive: a rank whose DDP object was destroyed after
        # the group (at the function's return) hung there for the whole time-out under CPU load, its result
        # already saved (seen in the suite, also at the commit before the runtime's reshape)
        del model
        dist.destroy_process_group()


def test_a_nan_filler_on_one_ddp_rank_adds_nothing(drafter_and_width, tmp_path, ranks):
    """Two real DDP processes (gloo), as in a run whose epoch ends on an odd batch: rank 1's last micro-step
    is a filler whose loss is NaN. Both ranks take the step, and their weights equal the real batch's step
    trained alone (DDP's all-reduce of rank 1's zero gradient happened, and added nothing)."""
    base, features = drafter_and_width
    real, pad = row(1, 16, features, 1), filler(16, features, 2)
    torch.save({"drafter": copy.deepcopy(base), "rows": [real, pad]}, tmp_path / "inputs.pt")
    ranks(__name__, "_ddp_worker", 2, tmp_path)

    alone = copy.deepcopy(base)
    o1, s1 = adamw(alone)
    r1 = step(alone, o1, s1, [real])
    for rank in (0, 1):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        r = out["result"]
        assert not r.skipped_nonfinite and r.positions == [1, FILLER], (rank, r)
        assert r.loss == pytest.approx(r1.loss, rel=1e-12)
        for a, b in zip(weights(alone), out["weights"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
