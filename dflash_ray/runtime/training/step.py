"""One optimizer step of the drafter, without Ray: the math every trainer (and the plain benchmark loop)
runs, so it can be read and tested in one process.

A step trains W = workers x grad_accum consecutive plan batches; rank r trains micro-batches
a = 0..grad_accum-1 (feed.rank_rows). The loss of the step is

    sum(loss_sum) / sum(weight_sum)   over every rank and micro-batch,

so batches weigh exactly by their supervised slots whatever their size: each micro-batch backpropagates
its un-normalised loss_sum (times the number of workers, which DDP's gradient averaging divides away),
then the step's stats are all-reduced once and the gradients divided by the global weight sum before
clipping. `StepStats` is the one vector that all-reduce carries.

A step whose loss or gradient is not finite (NaN or Inf) makes no update: the optimizer does not step
(its moments stay as they were), the LR schedule still advances one step, and the result says
`skipped_nonfinite`. Every rank takes the same decision without another collective: the loss comes from
the all-reduced stats vector (a NaN or Inf on any rank makes the sum non-finite), the gradient norm from
the gradients DDP has just all-reduced (the same values on every rank).

A micro-batch that runs out of device memory (`split_on_oom`, train.oom_split) is trained again as 2, 4, ...
slices of its rows, down to single rows, at the anchors drawn for the whole batch (one generator a batch, the
quotas over the whole batch: model/drafter.py `loss_at_anchors`), so the step's sums, and its update, are
the whole batch's up to float summation order. A failed backward may have added part of its gradient: the
rank's gradients are zeroed and its micro-batches of the step trained again (those that fitted, whole).
Under DDP every rank must take the same path, and DDP's all-reduce runs inside the last backward, where an
OOM on one rank would leave the others waiting in a collective: with the split on, every micro-batch runs
under no_sync and the gradients are all-reduced once after the stats (`all_reduce` of each gradient), when
every rank has finished its backward. A batch that does not fit even as single rows makes the step make no
update, on every rank (the all-reduced stats say so): `skipped_oom`, counted like a non-finite step. FSDP
gathers weights inside the forward (a collective per layer): the split is refused there (config.py).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from dflash_ray.model.loss import expected_acceptance_length
from dflash_ray.runtime.stream.rows import FILLER, TrainRow, row_slices
from dflash_ray.runtime.training.sharding import full_value, is_sharded, micro_step


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """The anchor-sampling seed of one plan batch: the same whichever rank trains it, whenever."""
    return int(np.random.SeedSequence([int(seed), int(epoch), int(position), 7]).generate_state(1)[0])


@dataclass
class StepStats:
    """What one step adds up over ranks and micro-batches, packed into one float64 vector for one
    all-reduce. Batch j of the step (j = micro_step x workers + rank) is written by exactly one rank,
    so summing the per-batch rows over ranks assembles them."""
    loss_sum: float
    weight_sum: float
    tokens: float
    slot_correct: np.ndarray   # [block_size - 1]
    slot_count: np.ndarray     # [block_size - 1]
    prefix_correct: np.ndarray  # [block_size - 1] blocks whose slots 1..k were all supervised and right
    num_blocks: float          # blocks with slot 1 supervised
    batch_position: np.ndarray  # [W] plan position of batch j (FILLER for a filler)
    batch_bucket: np.ndarray   # [W] (FILLER for a filler)
    batch_tokens: np.ndarray   # [W] real tokens (0 for a filler)
    batch_epoch: np.ndarray    # [W]
    oom_splits: float = 0.0    # micro-batches trained in slices after running out of memory
    oom_unfit: float = 0.0     # micro-batches that did not fit even as single rows (the step makes no update)

    @classmethod
    def zeros(cls, block_size: int, batches_per_step: int) -> "StepStats":
        slots, w = block_size - 1, batches_per_step
        return cls(0.0, 0.0, 0.0, np.zeros(slots), np.zeros(slots), np.zeros(slots), 0.0,
                   np.full(w, FILLER, np.int64), np.full(w, FILLER, np.int64), np.zeros(w, np.int64),
                   np.full(w, FILLER, np.int64))

    def pack(self) -> torch.Tensor:
        # per-batch columns are stored +1: another rank's batch (all FILLER here) packs to zeros and
        # adds nothing to the sum over ranks
        per_batch = np.stack([self.batch_position + 1, self.batch_bucket + 1, self.batch_tokens,
                              self.batch_epoch + 1], axis=1)
        return torch.from_numpy(np.concatenate([[self.loss_sum, self.weight_sum, self.tokens, self.num_blocks,
                                                 self.oom_splits, self.oom_unfit],
                                                self.slot_correct, self.slot_count, self.prefix_correct,
                                                per_batch.reshape(-1)]).astype(np.float64))

    @classmethod
    def unpack(cls, vector: torch.Tensor, block_size: int, batches_per_step: int) -> "StepStats":
        v = vector.detach().cpu().numpy().astype(np.float64)
        slots, h = block_size - 1, 6
        head = h + 3 * slots
        per_batch = v[head:].reshape(batches_per_step, 4).round().astype(np.int64)
        return cls(float(v[0]), float(v[1]), float(v[2]), v[h:h + slots], v[h + slots:h + 2 * slots],
                   v[h + 2 * slots:head], float(v[3]),
                   per_batch[:, 0] - 1, per_batch[:, 1] - 1, per_batch[:, 2], per_batch[:, 3] - 1,
                   float(v[4]), float(v[5]))


@dataclass
class StepResult:
    """One optimizer step, as every rank sees it after the all-reduce."""
    loss: float                 # sum(loss_sum) / sum(weight_sum)
    weight_sum: float
    tokens: int                 # real tokens of the step's batches (context tokens: the target's work)
    block_tokens: int           # anchor blocks trained x block size (the drafter's work)
    slot_accuracy: list         # per block slot 1..B-1
    train_tau: float            # measured on the step's blocks: 1 + mean leading correct slots (what greedy
                                # verification against these labels would accept)
    train_tau_if_slots_independent: float  # 1 + sum_k prod_{j<=k} slot_accuracy_j: a proxy, kept for comparison
    grad_norm: float            # of the step's gradient, before clipping
    lr: float                   # the learning rate this step used
    epoch: int
    positions: list             # plan position of each batch j (FILLER for fillers)
    buckets: list
    batch_tokens: list
    skipped_nonfinite: bool = False  # loss or gradient NaN/Inf: no update (same decision on every rank)
    oom_splits: int = 0         # micro-batches of the step trained in slices after running out of memory
    skipped_oom: bool = False   # a micro-batch did not fit even as single rows: no update (every rank)


def _zero_backward(model) -> None:
    """A backward that gives every trainable parameter of `model` a gradient of exactly 0: DDP's hooks fire
    for each (its all-reduce of the step happens, matching the other ranks), and nothing is added. Masked,
    not multiplied: `loss x 0` would add NaN whenever the filler's loss, or any derivative on its path, is
    NaN or inf (0 x inf = NaN), and make the whole step non-finite. An empty slice of each parameter reaches
    it without passing through the filler's activations."""
    params = [p for p in model.parameters() if p.requires_grad]
    torch.stack([p.reshape(-1)[:0].sum() for p in params]).sum().backward()


def split_oom_batches(setting, device, drafter) -> bool:
    """train.oom_split resolved for a worker: null -> on for a GPU worker (a CPU's allocator does not raise:
    the system kills the process); never under FSDP (config.py refuses an explicit true there)."""
    if is_sharded(drafter):
        return False
    return bool(setting) if setting is not None else device.type == "cuda"


def _slice_inputs(ids, mask, context, lengths, soft, anchors, valid, ix: np.ndarray):
    """Rows `ix` of a batch's inputs and of its anchors, cut to the slice's own longest row and most anchors
    (the rows are right-padded and valid anchors come first: nothing the slice's rows use is cut)."""
    idx = torch.as_tensor(ix, device=ids.device)
    width = max(int(lengths[idx].max()), 2)
    n = max(int(valid[idx].sum(1).max()), 1)
    sl = (lambda t: t.index_select(0, idx)[:, :width])
    soft = None if soft is None else tuple(sl(t) for t in soft)
    return (sl(ids), sl(mask), sl(context), lengths.index_select(0, idx), soft,
            (anchors.index_select(0, idx)[:, :n], valid.index_select(0, idx)[:, :n]))


def _train_micro_batch(model, drafter, row: TrainRow, *, pieces: int, a: int, last: bool, deferred: bool,
                       workers: int, seed: int, device, autocast, stats: StepStats, fault) -> None:
    """Forward and backward of one micro-batch, whole (pieces=1) or in `pieces` slices of its rows at the
    whole batch's anchors; its sums added to `stats`. May raise torch.OutOfMemoryError (caller retries)."""
    ids, mask, context, lengths = row.tensors(device)
    soft = row.soft_label_tensors(device)   # train.loss=distill; None otherwise
    generator = torch.Generator().manual_seed(batch_seed(seed, row.epoch, max(row.position, 0)))
    if pieces == 1:
        parts = [(ids, mask, context, lengths, soft, None, row.num_rows)]
    else:   # the anchors as the whole batch draws them (its first use of the generator, as in training_loss)
        anchors, valid = drafter.sample_anchors(mask, lengths, generator)
        parts = [(*_slice_inputs(ids, mask, context, lengths, soft, anchors, valid, ix), ix.size)
                 for ix in row_slices(row.num_rows, pieces)]
    scale = 1.0 if deferred else float(workers)   # DDP's averaging divides the factor away; ours sums
    for k, (p_ids, p_mask, p_ctx, p_len, p_soft, p_anchors, n_rows) in enumerate(parts):
        # DDP's all-reduce in the step's last backward only; deferred: in none (train_step all-reduces)
        with micro_step(model, last=last and k == len(parts) - 1 and not deferred):
            with autocast():
                loss_sum, weight_sum, correct, count, prefix, blocks = model(p_ids, p_mask, p_ctx, p_len, generator,
                                                                            p_soft, p_anchors)
            if row.trains_nothing:   # a filler or a batch set aside, here only to let DDP's collective fire
                if is_sharded(drafter):   # FSDP's reduce-scatter fires from the forward's graph: through it
                    (loss_sum * 0.0).backward()
                else:
                    _zero_backward(model)
                return
            hook = None
            if fault is not None:   # tests only: the allocator's error at a chosen point
                fault.after_forward(a, n_rows)
                hook = fault.in_backward(a, n_rows, drafter)
            try:
                (loss_sum * scale).backward()
            finally:
                if hook is not None:
                    hook.remove()
        stats.loss_sum += float(loss_sum.detach())
        stats.weight_sum += float(weight_sum)
        stats.slot_correct += correct.double().cpu().numpy()
        stats.slot_count += count.double().cpu().numpy()
        stats.prefix_correct += prefix.double().cpu().numpy()
        stats.num_blocks += float(blocks)
    stats.tokens += row.num_tokens


def _free_device_memory(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def train_step(model, drafter, optimizer, scheduler, rows: list[TrainRow], *, rank: int, workers: int,
               batches_per_step: int, seed: int, grad_clip: float, device,
               autocast=contextlib.nullcontext, all_reduce=None, split_on_oom: bool = False,
               fault=None) -> StepResult:
    """Forward/backward of this rank's micro-batches `rows`, one all-reduce of the step's stats
    (`all_reduce(tensor)`, in place, sum; None in a single process), then one optimizer update.

    `model` is what the forward runs through (DDP over a LossModule, or the LossModule itself);
    `drafter` owns the trainable parameters. A filler row trains nothing: it is skipped, except as the
    last micro-batch, where it runs forward (which arms DDP's reducer) and a backward of an exact zero
    (`_zero_backward`), so DDP's collective happens and the filler adds nothing, NaN included.
    `split_on_oom`: a micro-batch that runs out of memory is trained again in slices (module docstring);
    `fault`: tests' injected out-of-memory errors (faults.OomFault)."""
    block_size = drafter.block_size
    deferred = split_on_oom and all_reduce is not None and not is_sharded(drafter)
    last = len(rows) - 1
    pieces = [1] * len(rows)
    while True:
        stats = StepStats.zeros(block_size, batches_per_step)
        failed = None
        for a, row in enumerate(rows):
            j = a * workers + rank
            stats.batch_epoch[j] = row.epoch
            if row.trains_nothing and not row.is_filler:   # set aside (quarantine): in the ledger, not trained
                stats.batch_position[j], stats.batch_bucket[j] = row.position, row.bucket
            if row.trains_nothing and (a != last or deferred):
                continue  # nothing to train, and no collective happens in a no_sync micro-step
            try:
                _train_micro_batch(model, drafter, row, pieces=pieces[a], a=a, last=a == last, deferred=deferred,
                                   workers=workers, seed=seed, device=device, autocast=autocast, stats=stats,
                                   fault=fault)
            except torch.OutOfMemoryError:
                if not split_on_oom:
                    raise
                failed = a
                break
            if not row.trains_nothing:
                stats.batch_position[j], stats.batch_bucket[j], stats.batch_tokens[j] = \
                    row.position, row.bucket, row.num_tokens
        if failed is None:
            break
        # out of the except block: the failed graph and its activations are unreferenced now
        optimizer.zero_grad(set_to_none=True)   # a failed backward may have added part of a gradient
        _free_device_memory(device)
        if pieces[failed] >= rows[failed].num_rows:   # single rows do not fit: this rank trains nothing more
            stats = StepStats.zeros(block_size, batches_per_step)
            for a, row in enumerate(rows):
                j = a * workers + rank
                stats.batch_epoch[j] = row.epoch
                if not row.is_filler:
                    stats.batch_position[j], stats.batch_bucket[j], stats.batch_tokens[j] = \
                        row.position, row.bucket, 0 if row.trains_nothing else row.num_tokens
            stats.oom_unfit = 1.0
            break
        pieces[failed] = min(2 * pieces[failed], rows[failed].num_rows)
    # batches trained in slices (one that fitted no slice is counted as skipped, not split)
    stats.oom_splits = float(sum(p > 1 for a, p in enumerate(pieces) if not (stats.oom_unfit and a == failed)))

    vector = stats.pack().to(device)  # on the model's device: NCCL reduces CUDA tensors only
    if all_reduce is not None:
        all_reduce(vector)
    total = StepStats.unpack(vector, block_size, batches_per_step)

    params = drafter.trainable_parameters()
    skipped_oom = total.oom_unfit > 0
    if skipped_oom:   # every rank sees the same sum: none all-reduces its gradients, none updates
        optimizer.zero_grad(set_to_none=True)
    elif deferred:   # every rank's backward is done: the one gradient all-reduce of the step (sum)
        for p in params:
            if p.grad is None:   # a rank that trained only fillers still takes part
                p.grad = torch.zeros_like(p)
            all_reduce(p.grad)
    if total.weight_sum > 0 and not skipped_oom:
        for p in params:
            if p.grad is not None:
                p.grad.div_(total.weight_sum)
    if grad_clip > 0:   # (FSDP: a DTensor over the shards, whole on every rank once full)
        grad_norm = float(full_value(torch.nn.utils.clip_grad_norm_(params, grad_clip)))
    else:  # still measured: a non-finite gradient must be seen to be skipped
        grad_norm = float(full_value(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])))
    # identical on every rank: the all-reduced stats and the norm of the all-reduced gradients
    finite = math.isfinite(total.loss_sum) and math.isfinite(total.weight_sum) and math.isfinite(grad_norm)
    lr = scheduler.get_last_lr()[0]
    if finite and total.weight_sum > 0 and not skipped_oom:  # a step of fillers only moves nothing
        optimizer.step()
    with warnings.catch_warnings():  # torch warns when a schedule steps before its optimizer ever did
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()  # a skipped step still uses its place in the schedule: it stays aligned with steps
    optimizer.zero_grad(set_to_none=True)
    slot_accuracy = (total.slot_correct / np.maximum(total.slot_count, 1)).tolist()
    return StepResult(
        loss=total.loss_sum / max(total.weight_sum, 1e-12), weight_sum=total.weight_sum, tokens=int(total.tokens),
        block_tokens=int(round(total.num_blocks)) * block_size,
        slot_accuracy=slot_accuracy, train_tau=1.0 + float(total.prefix_correct.sum()) / max(total.num_blocks, 1.0),
        train_tau_if_slots_independent=expected_acceptance_length(slot_accuracy), grad_norm=grad_norm, lr=lr,
        epoch=int(total.batch_epoch.max()), positions=total.batch_position.tolist(),
        buckets=total.batch_bucket.tolist(), batch_tokens=total.batch_tokens.tolist(),
        skipped_nonfinite=not finite, oom_splits=int(round(total.oom_splits)), skipped_oom=skipped_oom)
