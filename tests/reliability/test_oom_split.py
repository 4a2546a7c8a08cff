"""A drafter batch that runs out of device memory (runtime/training/step.py, no Ray): trained again in slices of
its rows at the anchors drawn for the whole batch, its update equals the whole batch's (up to float summation
order); a batch that does not fit even as single rows makes the step skip, on every rank. A CPU cannot run
out of device memory: the allocator's own exception type (torch.OutOfMemoryError) is raised by the tests'
fault (faults.OomFault) after the forward or inside the backward. The Ray run that counts a split is in
test_faults_on_ray.py."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from helpers_model import step_optimizer, tiny_step_drafter, train_row, trainable_weights
from helpers_ranks import init_ranks

from dflash_ray.runtime.stream.rows import TrainRow
from dflash_ray.runtime.training.faults import OomFault
from dflash_ray.runtime.training.model import LossModule
from dflash_ray.runtime.training.step import row_slices, train_step

VOCAB, MASK, BLOCK = 300, 299, 4
ROWS, WIDTH = 5, 24
# the batch's anchor budget is below what its rows could take (5 x 8): each row's quota depends on the
# whole batch, so slices that drew their own anchors would train other blocks (and fail these tests)
PER_BATCH = 14


@pytest.fixture(scope="module")
def drafter_and_width(tmp_path_factory):
    drafter, features = tiny_step_drafter(tmp_path_factory.mktemp("oom"), VOCAB, MASK, BLOCK)
    drafter.anchors_per_batch = PER_BATCH
    return drafter, features


def batch(position, features, seed) -> TrainRow:
    """A plan batch of ROWS samples of different lengths, right-padded to WIDTH."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (ROWS, WIDTH), generator=g).numpy().astype(np.int32)
    lengths = np.array([WIDTH, WIDTH - 5, WIDTH - 2, WIDTH - 9, WIDTH - 1])
    mask = np.zeros((ROWS, WIDTH), np.int8)
    for r, n in enumerate(lengths):
        mask[r, 3:n] = 1
    return train_row(position, ids, mask, lengths, torch.randn(ROWS, WIDTH, features, generator=g), bucket=1)


adamw = step_optimizer
weights = trainable_weights


def one_step(base, rows, fault=None, split=True):
    drafter = copy.deepcopy(base)
    opt, sched = adamw(drafter)
    r = train_step(LossModule(drafter), drafter, opt, sched, rows, rank=0, workers=1, batches_per_step=len(rows),
                   seed=0, grad_clip=1.0, device="cpu", split_on_oom=split, fault=fault)
    return r, weights(drafter), opt


def test_row_slices_cover_every_row_once():
    # by hand: 5 rows in 2 -> [0 1 2] [3 4]; in 4 -> [0 1] [2] [3] [4]; more pieces than rows -> single rows
    assert [s.tolist() for s in row_slices(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [s.tolist() for s in row_slices(5, 4)] == [[0, 1], [2], [3], [4]]
    assert [s.tolist() for s in row_slices(3, 8)] == [[0], [1], [2]]


@pytest.mark.parametrize("where, max_rows", [("forward", 2), ("backward", 1), ("backward", 4)])
def test_a_split_step_makes_the_whole_batch_update(drafter_and_width, where, max_rows):
    """Slices of at most `max_rows` rows fit: the batch is trained as 2, 4, ... slices until they do. The loss,
    the trained blocks and the weights after the step are the whole batch's."""
    base, features = drafter_and_width
    rows = [batch(3, features, 1)]
    whole, w_whole, _ = one_step(base, rows)
    fault = OomFault({"where": where, "max_rows": max_rows})
    split, w_split, _ = one_step(base, rows, fault)
    # tries: whole (5 rows), then 2 slices (3+2), then 4 (2+1+1+1), then 5 single rows; each failing try
    # raises once (at its first slice over max_rows)
    assert fault.raised == {(2, "forward"): 2, (1, "backward"): 3, (4, "backward"): 1}[(max_rows, where)]
    assert split.oom_splits == 1 and not split.skipped_oom and not split.skipped_nonfinite
    assert whole.oom_splits == 0
    assert split.block_tokens == whole.block_tokens and split.tokens == whole.tokens
    assert split.positions == whole.positions == [3]
    assert split.loss == pytest.approx(whole.loss, rel=1e-5)
    assert split.slot_accuracy == pytest.approx(whole.slot_accuracy, abs=1e-12)   # counts: exact
    for a, b in zip(w_whole, w_split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_backward_that_failed_on_the_second_micro_batch_leaves_no_partial_gradient(drafter_and_width):
    """grad_accum 2: micro-batch 0 trains whole, micro-batch 1 runs out of memory inside its backward after
    part of its gradient was added. The rank's gradients are zeroed and both trained again: the update is the
    two whole batches'."""
    base, features = drafter_and_width
    rows = [batch(4, features, 2), batch(5, features, 3)]
    whole, w_whole, _ = one_step(base, rows)
    fault = OomFault({"where": "backward", "micro_batch": 1, "max_rows": 3})
    split, w_split, _ = one_step(base, rows, fault)
    assert fault.raised == 1 and split.oom_splits == 1 and split.positions == [4, 5]
    assert split.loss == pytest.approx(whole.loss, rel=1e-5)
    for a, b in zip(w_whole, w_split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_batch_that_does_not_fit_as_single_rows_skips_the_step(drafter_and_width):
    base, features = drafter_and_width
    rows = [batch(6, features, 4)]
    fault = OomFault({"where": "backward", "max_rows": 0})
    r, w, opt = one_step(base, rows, fault)
    assert r.skipped_oom and not r.skipped_nonfinite and r.positions == [6] and r.oom_splits == 0
    assert fault.raised == 4   # 5 rows, then 2, 4 and 5 slices: each try fails at its first slice
    for a, b in zip(weights(base), w):
        assert torch.equal(a, b)
    assert not opt.state   # AdamW never stepped: its moments were not touched


def test_without_the_split_the_error_ends_the_step(drafter_and_width):
    base, features = drafter_and_width
    with pytest.raises(torch.OutOfMemoryError):
        one_step(base, [batch(7, features, 5)], OomFault({"where": "forward", "max_rows": 2}), split=False)


def _ddp_worker(rank: int, world: int, root: str) -> None:
    """One of two DDP ranks (gloo) training its batch of the step, with the out-of-memory fault the inputs
    give it (or none)."""
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
        spec = inputs["faults"][rank]
        fault = OomFault(spec) if spec else None
        r = train_step(model, drafter, opt, sched, [inputs["rows"][rank]], rank=rank, workers=2, batches_per_step=2,
                       seed=0, grad_clip=1.0, device="cpu", all_reduce=dist.all_reduce,
                       split_on_oom=inputs["split"], fault=fault)
        torch.save({"result": r, "weights": weights(drafter), "raised": fault.raised if fault else 0},
                   f"{root}/rank{rank}.pt")
    finally:
        del model   # before the process group (test_nonfinite_step: a late DDP teardown hung under load)
        dist.destroy_process_group()


def _run_ddp(run_ranks, root, base, rows, faults, split):
    root.mkdir(parents=True, exist_ok=True)
    torch.save({"drafter": copy.deepcopy(base), "rows": rows, "faults": faults, "split": split}, root / "inputs.pt")
    run_ranks(__name__, "_ddp_worker", 2, root)
    return [torch.load(root / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def test_ddp_ranks_stay_in_step_when_one_runs_out_of_memory(drafter_and_width, tmp_path, ranks):
    """Two real DDP processes (gloo). Rank 1 runs out of memory inside its backward (where DDP's own all-reduce
    would run); it trains its batch in slices while rank 0 waits for the step's one gradient all-reduce. Both
    ranks end with the weights of the ordinary DDP step (the overlapped all-reduce, no fault), and count the
    split. Then the batch that fits no slice on rank 1: both ranks skip the step, neither updates."""
    base, features = drafter_and_width
    rows = [batch(0, features, 8), batch(1, features, 9)]
    plain = _run_ddp(ranks, tmp_path / "plain", base, rows, [None, None], split=False)
    split = _run_ddp(ranks, tmp_path / "split", base, rows, [None, {"where": "backward", "max_rows": 2}], split=True)
    assert split[1]["raised"] == 2 and split[0]["raised"] == 0
    for rank in (0, 1):
        p, s = plain[rank]["result"], split[rank]["result"]
        assert s.oom_splits == 1 and p.oom_splits == 0 and not s.skipped_oom, rank
        assert s.positions == p.positions == [0, 1]
        assert s.loss == pytest.approx(p.loss, rel=1e-5)
        for a, b in zip(plain[rank]["weights"], split[rank]["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unfit = _run_ddp(ranks, tmp_path / "unfit", base, rows, [None, {"where": "forward", "max_rows": 0}], split=True)
    for rank in (0, 1):
        r = unfit[rank]["result"]
        assert r.skipped_oom and r.positions == [0, 1], rank
        for a, b in zip(weights(base), unfit[rank]["weights"]):
            assert torch.equal(a, b)


class _Tight:
    """A target feature extractor on a device that holds at most `rows` rows a forward: the real extractor,
    behind the allocator's exception type for anything larger."""

    def __init__(self, extract, rows: int):
        self.extract, self.rows, self.raised = extract, rows, 0

    def _check(self, ids):
        if ids.shape[0] > self.rows:
            self.raised += 1
            raise torch.OutOfMemoryError(f"test fault: {ids.shape[0]} rows")

    def __call__(self, ids, attn):
        self._check(ids)
        return self.extract(ids, attn)

    def features_and_top_k(self, ids, attn):
        self._check(ids)
        return self.extract.features_and_top_k(ids, attn)


def test_a_target_forward_that_runs_out_of_memory_gives_the_whole_batch_features(tmp_path_factory):
    """The target actor's forward (stream/target_forward.py) over a batch that fits only as slices of 2 rows:
    4 slices, the features (and distillation's top-k) those of the whole batch, row for row."""
    from dflash_ray.model.target import load_feature_extractor
    from dflash_ray.runtime.stream.rows import decode_features, decode_soft_labels
    from dflash_ray.runtime.stream.target_forward import target_context, target_context_and_soft_labels

    root = tmp_path_factory.mktemp("oom-target")
    tiny_step_drafter(root, VOCAB, MASK, BLOCK)   # writes the tiny target at root/target
    extract = load_feature_extractor(str(root / "target"), [1, 3], top_k=4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MASK, (7, 20), generator=g).numpy().astype(np.int32)
    lengths = np.array([20, 13, 17, 8, 20, 11, 19])
    whole, dtype, pieces = target_context(extract, ids, lengths, "cpu")
    assert pieces == 1
    tight = _Tight(extract, 2)
    split, dtype2, pieces2 = target_context(tight, ids, lengths, "cpu")
    assert (pieces2, tight.raised, dtype2) == (4, 2, dtype)   # by hand: 7 rows, then 2 slices of 4+3, then 4
    a, b = decode_features(whole, dtype), decode_features(split, dtype)
    assert a.shape == b.shape == (7, 20, 2 * extract.hidden_size)
    for r, n in enumerate(lengths):   # what the drafter reads: each row's positions before its length
        torch.testing.assert_close(a[r, :n], b[r, :n], rtol=1e-5, atol=1e-5)
    f1, _, s1, _ = target_context_and_soft_labels(extract, ids, lengths, "cpu")
    f2, _, s2, p2 = target_context_and_soft_labels(_Tight(extract, 3), ids, lengths, "cpu")
    assert p2 == 4   # 7 rows, then 4+3, then 2+2+2+1
    (i1, q1), (i2, q2) = decode_soft_labels(s1), decode_soft_labels(s2)
    for r, n in enumerate(lengths):
        torch.testing.assert_close(decode_features(f1, dtype)[r, :n], decode_features(f2, dtype)[r, :n],
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(i1[r, :n], i2[r, :n])
        torch.testing.assert_close(q1[r, :n], q2[r, :n], rtol=1e-5, atol=1e-6)
    with pytest.raises(torch.OutOfMemoryError):   # not even one row fits: the actor's error (Ray retries)
        target_context(_Tight(extract, 0), ids, lengths, "cpu")
