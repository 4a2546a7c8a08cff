"""Length buckets and token-budget batches, vectorised (10M samples in seconds). No torch here.

A bucket holds samples with num_tokens in (boundaries[b-1], boundaries[b]]. Inside a bucket, samples are
dealt at random into chunks of about `chunk_batches` batches; each chunk is sorted by length (longest
first) and cut greedily so that rows x longest row <= max_tokens_per_batch. Neighbours in a sorted chunk
have nearly equal lengths, so little is padded; the random chunks make each epoch's batches different.

The target's forward costs more per token for long rows (causal attention grows with the row): with
`attention_tokens` = La (the row length at which a token's attention work equals its linear work), a row
of L padded tokens costs L * (1 + L / La), and a batch takes the row count whose cost is nearest to a
full batch of the shortest bucket's rows (never more than the token budget allows), so batches of every
bucket keep the target actors about equally busy.

The drafter has a budget too (max_anchors: its trained anchors per batch, i.e. block tokens / block size):
a row trains min(num_anchors, its valid anchors), so a batch of short, dense rows carries many more blocks
per context token than one of long rows. With `row_anchors` and `max_anchors` given, the cut also closes a
batch before its rows' anchors pass max_anchors (a batch keeps at least one row), so every batch costs the
drafter at most the same, at the recipe's full density; short-row batches get fewer rows instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_ray.config import DataConfig


@dataclass
class Bucketing:
    bucket: np.ndarray       # int32 per sample, -1 = dropped
    length: np.ndarray       # int64 per sample, after truncation
    truncated: int
    dropped_overlong: int
    dropped_short: int


def assign_buckets(num_tokens: np.ndarray, boundaries, *, overlong: str = DataConfig.overlong,
                   min_tokens: int = 0) -> Bucketing:
    """Bucket id of every sample. Over the last boundary: truncated to it or dropped; under min_tokens
    (too short to hold 2 blocks): dropped. Both are counted."""
    bounds = np.asarray(boundaries, dtype=np.int64)
    lengths = np.asarray(num_tokens, dtype=np.int64)
    over = lengths > bounds[-1]
    short = lengths < max(min_tokens, 1)
    if overlong == "truncate":
        lengths = np.minimum(lengths, bounds[-1])
        dropped = short
    else:
        dropped = short | over
    bucket = np.searchsorted(bounds, lengths, side="left").astype(np.int32)
    bucket[dropped] = -1
    return Bucketing(
        bucket=bucket,
        length=lengths,
        truncated=int((over & ~short).sum()) if overlong == "truncate" else 0,
        dropped_overlong=int((over & ~short).sum()) if overlong != "truncate" else 0,
        dropped_short=int(short.sum()),
    )


@dataclass
class Batches:
    """Batches in CSR form: batch i holds members[offsets[i]:offsets[i+1]] (indices into the samples),
    longest first. Batches are grouped by bucket; `shuffled` lists them grouped by bucket again, in a
    fresh random order inside each bucket (the order a plan draws them in)."""
    bucket: np.ndarray    # int32 [num_batches]
    offsets: np.ndarray   # int64 [num_batches + 1]
    members: np.ndarray   # int64 [num_samples kept]
    lengths: np.ndarray   # int64 [num_samples kept], members' lengths
    max_len: np.ndarray   # int64 [num_batches], the padded row length
    shuffled: np.ndarray  # int64 [num_batches]

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)


def rows_per_batch(longest: np.ndarray, max_tokens: int, boundaries, attention_tokens: float | None) -> np.ndarray:
    """Rows of a batch whose longest row has `longest` tokens: max_tokens // longest, or, with the
    attention term, the count whose cost is nearest the budget's cost at the first boundary."""
    longest = np.asarray(longest, dtype=np.int64)
    cap = np.maximum(1, max_tokens // longest)
    if not attention_tokens:
        return cap
    la = float(attention_tokens)
    budget = max_tokens * (1.0 + boundaries[0] / la)
    balanced = np.floor(budget / (longest * (1.0 + longest / la)) + 0.5).astype(np.int64)
    return np.clip(balanced, 1, cap)


def form_batches(length: np.ndarray, bucket: np.ndarray, boundaries, max_tokens: int,
                 chunk_batches: int, rng: np.random.Generator, attention_tokens: float | None = None,
                 row_anchors: np.ndarray | None = None, max_anchors: int | None = None) -> Batches:
    bounds = np.asarray(boundaries, dtype=np.int64)
    k = bounds.size
    dropped = bucket < 0
    keep = np.flatnonzero(~dropped) if dropped.any() else None
    b = (bucket if keep is None else bucket[keep]).astype(np.int64)
    ln = length if keep is None else length[keep]
    n = b.size
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Batches(bucket=empty.astype(np.int32), offsets=np.zeros(1, dtype=np.int64), members=empty,
                       lengths=empty, max_len=empty, shuffled=empty)
    # chunk count per bucket: about chunk_batches batches of a typical length
    lower = np.concatenate([[0], bounds[:-1]])
    typical = np.maximum(1, max_tokens // np.maximum(1, (lower + bounds) // 2))
    nchunks = np.maximum(1, -(-np.bincount(b, minlength=k) // (chunk_batches * typical)))
    chunk = (rng.random(n) * nchunks[b]).astype(np.int64)
    # one sort of packed keys (bucket, chunk, longest first, sample index): sorting values is about
    # twice as fast as argsort, and the index rides along in the low bits
    ib, lb, cb = max(1, (n - 1).bit_length()), int(bounds[-1]).bit_length(), int(nchunks.max()).bit_length()
    if ib + lb + cb + int(k).bit_length() <= 63:
        key = (b << (cb + lb + ib)) | (chunk << (lb + ib)) | ((bounds[-1] - ln) << ib) | np.arange(n)
        key.sort()
        order = key & ((1 << ib) - 1)
        sorted_len = bounds[-1] - ((key >> ib) & ((1 << lb) - 1))
        seg_key = key >> (lb + ib)
        del key
    else:  # too many bits for one int64: a slower multi-key sort
        order = np.lexsort((-ln, chunk, b))
        sorted_len = ln[order]
        seg_key = b[order] * (int(nchunks.max()) + 1) + chunk[order]
    seg_start = np.flatnonzero(np.concatenate([[True], seg_key[1:] != seg_key[:-1]]))
    seg_end = np.append(seg_start[1:], n)
    if max_anchors is not None:
        # anchors before each sorted position: a batch from i may run to the last j with csum[j] - csum[i]
        # <= max_anchors (searchsorted on the non-decreasing prefix sums)
        a = np.asarray(row_anchors, dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum((a if keep is None else a[keep])[order])])
    # greedy cut, all segments at once: a batch starting at i takes rows_per_batch(len[i]) rows (its longest),
    # fewer when their anchors would pass the drafter's budget
    starts = []
    cur, end = seg_start, seg_end
    while cur.size:
        starts.append(cur)
        take = rows_per_batch(sorted_len[cur], max_tokens, bounds, attention_tokens)
        if max_anchors is not None:
            fit = np.searchsorted(csum, csum[cur] + max_anchors, side="right") - 1 - cur
            take = np.minimum(take, np.maximum(fit, 1))
        nxt = np.minimum(cur + take, end)
        live = nxt < end
        cur, end = nxt[live], end[live]
    start = np.sort(np.concatenate(starts)) if starts else np.zeros(0, dtype=np.int64)
    batch_bucket = b[order[start]].astype(np.int32)
    return Batches(
        bucket=batch_bucket,
        offsets=np.append(start, n).astype(np.int64),
        members=order if keep is None else keep[order],
        lengths=sorted_len,
        max_len=sorted_len[start],
        shuffled=np.lexsort((rng.random(start.size), batch_bucket)),
    )
