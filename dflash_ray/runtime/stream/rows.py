"""The stream's row schema, defined once: what a feed row carries, what the token join adds, what the
target actor adds, and what a trainer reads back. One Ray Data row = one plan batch; a block holds G of
them (pipeline.rows_per_block), so the tensor columns are ragged across a block's rows (Ray Data's
variable-shaped tensors) and a trainer reads a block at a time (batch_size=None) and splits it into its
rows (`train_rows`).

    feed row (feed.py)    index, epoch, position, epoch_batches, bucket, num_tokens, sample_ids, lengths
    after join_tokens     FEED_SCALARS + gen, input_ids [1,rows,width], loss_mask, lengths [1,rows], sample_ids
    after TargetForward   + context [1,rows,width,features] and context_dtype (see encode_features);
                          with train.loss=distill also soft_labels [1,rows,width,2k] (encode_soft_labels)

Pure numpy on the encoding side; torch only where a trainer decodes a row (imported lazily), so the
feed and the Ray Data stages need no torch import of their own.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

# per-row scalars that travel from the feed table to the trainer unchanged
FEED_SCALARS = ("index", "epoch", "position", "epoch_batches", "bucket", "num_tokens")
# the feed table's list columns: the plan batch's samples and their (possibly truncated) lengths
FEED_LISTS = ("sample_ids", "lengths")
FEED_COLUMNS = FEED_SCALARS + FEED_LISTS
FILLER = -1   # `position` of a filler row: pads an epoch's last step to a full step, trains nothing
QUARANTINED = -2   # `bucket` of a plan batch set aside (record/quarantine.py): kept in its step, trains nothing


def row_slices(num_rows: int, pieces: int) -> list[np.ndarray]:
    """The row indices of a batch cut into `pieces` nearly equal slices (in order; none empty)."""
    return [ix for ix in np.array_split(np.arange(num_rows), min(pieces, num_rows)) if ix.size]


def token_row(scalars: dict, gen: int, input_ids: np.ndarray, loss_mask: np.ndarray,
              lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> dict:
    """The join stage's output for one feed row: its scalars, the stream generation and the padded
    tokens (input_ids int32, loss_mask int8, lengths int32; one row per sample), and the samples' ids
    (int64, -1 for a filler or where unknown: the feature cache's keys)."""
    out = {k: np.array([scalars[k]], np.int64) for k in FEED_SCALARS}
    out["gen"] = np.array([gen], np.int64)
    out["input_ids"] = input_ids[None]
    out["loss_mask"] = loss_mask[None]
    out["lengths"] = np.asarray(lengths).astype(np.int32)[None]
    ids = np.full(len(lengths), -1) if sample_ids is None else sample_ids
    out["sample_ids"] = np.asarray(ids).astype(np.int64)[None]
    return out


def stack_rows(rows: list[dict]) -> dict:
    """One block's batch from its rows (`token_row` outputs, each one row long): scalar columns
    concatenated, tensor columns as a list of each row's array (their shapes differ from row to row)."""
    out = {}
    for k, first in rows[0].items():
        if first.ndim == 1:
            out[k] = np.concatenate([r[k] for r in rows])
        else:
            out[k] = [r[k][0] for r in rows]
    return out


def encode_features(features) -> tuple[np.ndarray, str]:
    """A torch tensor of context features -> (numpy array, dtype name). numpy has no bfloat16: bf16
    features ship as their bits in int16 (half the bytes of fp32), decoded by `decode_features`."""
    import torch

    if features.dtype == torch.bfloat16:
        return features.view(torch.int16).cpu().numpy(), "bfloat16"
    return features.float().cpu().numpy(), "float32"


def decode_features(array: np.ndarray, dtype: str):
    """The inverse of `encode_features`: a torch tensor (bf16 restored from its int16 bits)."""
    import torch

    with warnings.catch_warnings():  # a read-only view of the object store: we never write to it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(array))
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(f"unknown feature encoding {dtype!r}")
    return t


def encode_soft_labels(ids, probs) -> np.ndarray:
    """The target's next-token top-k (torch ids [rows, width, k], probabilities [rows, width, k] float32)
    as one int32 array [rows, width, 2k]: the ids, then the probabilities' float32 bits (one column, one
    dtype in the stream and the cache: 8 bytes a token per k, against the features' 2-4 x taps x hidden)."""
    import torch

    return torch.cat([ids.to(torch.int32), probs.float().contiguous().view(torch.int32)], dim=-1).cpu().numpy()


def decode_soft_labels(array: np.ndarray):
    """The inverse of `encode_soft_labels`: (ids int64, probabilities float32) torch tensors."""
    import torch

    with warnings.catch_warnings():  # a read-only view of the object store: we never write to it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    k = t.shape[-1] // 2
    return t[..., :k].long(), t[..., k:].contiguous().view(torch.float32)


def train_rows(batches):
    """The TrainRows of numpy batches (whole blocks: `iter_batches(batch_size=None)`), in order. Slicing
    a block into one-row batches is Ray Data's per-batch work for every row; a block is sliced here."""
    for batch in batches:
        for i in range(len(batch["index"])):
            yield TrainRow.from_batch(batch, i)


@dataclass
class TrainRow:
    """One plan batch as a trainer receives it (decoded from a Ray Data row)."""
    index: int            # feed row index: the trainer checks it is the row `rank_rows` assigns
    gen: int              # stream generation: a restarted stream gets a new one
    epoch: int
    position: int         # plan position in the epoch (FILLER for a filler row)
    epoch_batches: int
    bucket: int
    num_tokens: int       # real (unpadded) tokens
    input_ids: np.ndarray     # [rows, width] int32, right-padded
    loss_mask: np.ndarray     # [rows, width] int8
    lengths: np.ndarray       # [rows] int32
    context: np.ndarray       # [rows, width, features], encoded (see context_dtype)
    context_dtype: str
    soft_labels: np.ndarray | None = None   # [rows, width, 2k] int32 (encode_soft_labels): train.loss=distill
    staged: tuple | None = None   # (tensors on the GPU, the copy's CUDA event): set by `stage`

    @property
    def is_filler(self) -> bool:
        return self.position == FILLER

    @property
    def is_quarantined(self) -> bool:
        return self.bucket == QUARANTINED

    @property
    def trains_nothing(self) -> bool:
        """A filler, or a batch set aside: no forward of its own (a filler-like stand-in where DDP needs one)."""
        return self.is_filler or self.is_quarantined

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @classmethod
    def from_batch(cls, batch: dict, i: int = 0) -> "TrainRow":
        """Row i of a numpy batch from `iter_batches(batch_format="numpy")` (a ragged tensor column is an
        object array of each row's array, a uniform one an array with a leading row axis: [i] is row i's
        either way)."""
        return cls(**{k: int(batch[k][i]) for k in FEED_SCALARS}, gen=int(batch["gen"][i]),
                   input_ids=batch["input_ids"][i], loss_mask=batch["loss_mask"][i],
                   lengths=batch["lengths"][i], context=batch["context"][i],
                   context_dtype=str(batch["context_dtype"][i]),
                   soft_labels=batch["soft_labels"][i] if "soft_labels" in batch else None)

    def tensors(self, device):
        """(input_ids, loss_mask, context, lengths) as torch tensors on `device` (a staged row's: once its
        copy has landed, in the order of the current CUDA stream)."""
        import torch

        if self.staged is not None:
            tensors, copied = self.staged
            stream = torch.cuda.current_stream(device)
            stream.wait_event(copied)
            for t in tensors:   # used on this stream: the allocator must not reuse them before it is done
                t.record_stream(stream)
            return tensors
        ids = torch.from_numpy(self.input_ids.astype(np.int64)).to(device)
        mask = torch.from_numpy(self.loss_mask.astype(np.int64)).to(device)
        lengths = torch.from_numpy(self.lengths.astype(np.int64)).to(device)
        return ids, mask, decode_features(self.context, self.context_dtype).to(device), lengths

    def soft_label_tensors(self, device):
        """(top-k ids, probabilities) on `device`, or None without soft labels. Not staged: 64 bytes a token
        at k = 8, against the features' 2 x taps x hidden (SmolLM2: 2,304), copied when the step needs them."""
        if self.soft_labels is None:
            return None
        ids, probs = decode_soft_labels(self.soft_labels)
        return ids.to(device), probs.to(device)

    def stage(self, device, stream) -> "TrainRow":
        """Copy the row's tensors to the GPU on `stream` (a side stream, from the prefetch thread): the
        host-to-device copy of a Qwen3-8B batch's features (~0.67 GB: ~80 ms from pageable memory at the
        H200's 8.2 GB/s) overlaps the training thread's step instead of starting it. The source is the object
        store's buffer itself (no pinned copy first: that would be another host copy of the same size).
        Not yet run on a GPU; the CPU path never stages."""
        import torch

        with torch.cuda.stream(stream):
            tensors = self.tensors(device)
            copied = torch.cuda.Event()
            copied.record(stream)
        self.staged = (tensors, copied)
        return self
