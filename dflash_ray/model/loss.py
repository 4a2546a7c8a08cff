"""The DFlash training loss: decayed-weight cross-entropy over block slots, through the frozen LM head in chunks.

Slot k (1..B-1) of the block at anchor a predicts x[a+k], with weight w_k = exp(-(k-1)/gamma): early slots
matter more because acceptance stops at the first miss. The [positions x vocab] logits never exist at once:
512 anchors x 15 slots x 151,936 vocab in fp32 would be 4.7 GB per sample. `ChunkedHeadCE` computes logits
chunk by chunk and, because the head is frozen, the gradient w.r.t. the hidden states in the same pass,
keeping only that gradient ([M, H]) for backward: two head matmuls per chunk, no logits stored.

Distillation (`train.loss=distill`): the label of a slot is a distribution instead of one token, the target's
own next-token distribution at that position carried as its top-k (ids, probabilities renormalised over the
k), optionally mixed with the hard label. The loss is linear in the label's distribution, so a mix is one
label of k + 1 entries (`soft_labels`): CE against a soft label p is sum_j p_j (logsumexp - logit_j), its
gradient softmax * sum(p) - p, in the same pass and memory as the hard CE.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """7 for B=16, 5 for B=10, 4 for B=8 (the DFlash recipe); otherwise interpolate linearly in B
    through those points (clamped at 1), which keeps the weight of the last slot in the same range."""
    if block_size in DEFAULT_GAMMA:
        return DEFAULT_GAMMA[block_size]
    if block_size < 10:
        gamma = 4.0 + (block_size - 8) * 0.5
    else:
        gamma = 5.0 + (block_size - 10) / 3.0
    return max(1.0, gamma)


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1, shape [B-1]."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def expected_acceptance_length(slot_accuracy) -> float:
    """tau implied by per-slot accuracies p_1..p_{B-1}: 1 + sum_k prod_{j<=k} p_j.

    Exact if slot errors were independent; with `LossOutput.prefix_correct` use `measured_acceptance_length`."""
    acc = torch.as_tensor(slot_accuracy, dtype=torch.float64).clamp(0, 1)
    return float(1.0 + torch.cumprod(acc, 0).sum())


@dataclass
class LossOutput:
    loss_sum: torch.Tensor       # scalar, sum over supervised slots of w_k * CE (with grad), not normalised
    weight_sum: torch.Tensor     # scalar, sum of the weights that entered loss_sum
    slot_correct: torch.Tensor   # [B-1] argmax-correct counts per slot 1..B-1
    slot_count: torch.Tensor     # [B-1] supervised counts per slot
    prefix_correct: torch.Tensor | None = None  # [B-1] blocks whose slots 1..k were all supervised and correct
    num_blocks: torch.Tensor | None = None       # scalar, blocks with slot 1 supervised (valid anchors)

    @property
    def loss(self) -> torch.Tensor:
        """Local normalised loss (the runtime all-reduces weight_sum and divides instead)."""
        return self.loss_sum / self.weight_sum.clamp_min(1e-12)

    def slot_accuracy(self) -> torch.Tensor:
        return self.slot_correct.float() / self.slot_count.float().clamp_min(1)

    def expected_acceptance_length(self) -> float:
        return expected_acceptance_length(self.slot_accuracy())

    def measured_acceptance_length(self) -> float:
        """1 + mean over blocks of the number of leading correct slots: what greedy verification against
        these labels would accept (on target-regenerated data the labels are the target's greedy tokens)."""
        if self.prefix_correct is None or self.num_blocks is None:
            return self.expected_acceptance_length()
        return float(1.0 + self.prefix_correct.sum().double() / self.num_blocks.double().clamp_min(1))


class ChunkedHeadCE(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ head^T, label_i) over rows, in row chunks; the head gets no gradient.
    With `soft_ids`/`soft_probs` [M, K] the label of row i is the distribution putting soft_probs[i, j] on
    token soft_ids[i, j] (CE against it: sum_j p_ij (logsumexp_i - logit_i[id_ij])); `labels` then only
    decide `correct`.

    Returns (loss_sum, correct[M]). Backward returns the gradient computed in forward, scaled."""

    @staticmethod
    def forward(ctx, hidden, head, labels, weights, chunk_rows, soft_ids=None, soft_probs=None):
        needs_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if needs_grad else None
        if torch.is_autocast_enabled(hidden.device.type):
            # autocast would cast the [V, H] head again for each of the two matmuls of every chunk
            head = head.to(torch.get_autocast_dtype(hidden.device.type))
        for lo in range(0, hidden.shape[0], chunk_rows):
            hi = min(lo + chunk_rows, hidden.shape[0])
            h = hidden[lo:hi].to(head.dtype)
            logits = (h @ head.t()).float()  # [chunk, V], the only vocab-sized tensor alive
            lbl, w = labels[lo:hi], weights[lo:hi].float()
            # few passes over the [chunk, V] logits (memory-bound on CPUs): one max with its index (the
            # argmax, first index on ties), one exp in place, one sum; the log-sum-exp from those
            top, top_idx = logits.max(dim=-1)
            correct[lo:hi] = top_idx == lbl
            if soft_ids is None:
                ids, p = lbl[:, None], torch.ones(hi - lo, 1, device=logits.device)
            else:
                ids, p = soft_ids[lo:hi], soft_probs[lo:hi].float()
            mass = p.sum(dim=-1)
            picked = (p * logits.gather(1, ids)).sum(dim=-1)
            exps = logits.sub_(top[:, None]).exp_()
            total = exps.sum(dim=-1)
            loss += (w * (mass * (top + total.log()) - picked)).sum()
            if needs_grad:
                # d CE / d logits = softmax * mass - label, scaled by the row weight; in place to save memory.
                probs = exps.mul_((w * mass / total)[:, None])
                probs.scatter_add_(1, ids, -(w[:, None] * p))
                grad[lo:hi] = (probs.to(head.dtype) @ head).to(hidden.dtype)
        if needs_grad:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None


def chunked_head_ce(hidden, head, labels, weights, chunk_rows: int = 1024, soft_ids=None, soft_probs=None):
    """hidden [M, H], head [V, H] (frozen), labels [M], weights [M] -> (loss_sum, correct [M]); with
    soft_ids/soft_probs [M, K] the rows' labels are those distributions (ChunkedHeadCE)."""
    if hidden.shape[0] == 0:
        zero = hidden.sum() * 0.0  # keeps the graph connected so DDP sees every parameter used
        return zero.float(), torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return ChunkedHeadCE.apply(hidden, head.detach(), labels, weights, max(1, int(chunk_rows)), soft_ids, soft_probs)


def mix_soft_labels(top_ids, top_probs, labels, hard_weight: float):
    """The label distribution of `train.loss=distill`: the target's top-k probabilities renormalised over the
    k (the tail's mass is dropped), times 1 - hard_weight, and the hard label with hard_weight, as one label
    of k + 1 entries (ids [M, k+1], probs [M, k+1]). A token in both simply gets both masses (the loss is
    linear in the label)."""
    p = top_probs.float()
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    ids = torch.cat([top_ids.long(), labels.long()[:, None]], dim=1)
    probs = torch.cat([p * (1.0 - hard_weight), torch.full_like(p[:, :1], float(hard_weight))], dim=1)
    return ids, probs


def reference_head_ce(hidden, head, labels, weights, soft_ids=None, soft_probs=None):
    """The plain, fully materialised version, for tests: CE with hard labels, or against the soft labels'
    dense distribution (built by scattering them into a [M, V] zero matrix)."""
    logits = (hidden.to(head.dtype) @ head.t()).float()
    if soft_ids is None:
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    else:
        dense = torch.zeros_like(logits).scatter_add_(1, soft_ids.long(), soft_probs.float())
        ce = -(dense * torch.log_softmax(logits, dim=-1)).sum(-1)
    return (weights.float() * ce).sum(), logits.argmax(-1) == labels

