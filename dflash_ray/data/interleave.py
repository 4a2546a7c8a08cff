"""The global order of batches: which bucket each position of the epoch draws its next batch from.

All strategies are vectorised numpy (10M batches in seconds) and deterministic for fixed
(batch_counts, strategy, seed, epoch). No torch here.

- `stride`      the seed run's fix: batch j of bucket b (n_b of N) sits at (j + u) * N / n_b, u ~ U[0,1)
                per batch, then sort. Proportional, but neighbours collide: runs of 2-3.
- `default`     stride with a per-bucket phase (a low-discrepancy, Webster-like sequence), then a
                vectorised repair that swaps neighbours until no bucket follows itself. When one bucket
                holds more than half of all batches, runs are unavoidable: it is spread evenly over the
                gaps between the others, so its longest run is the least the counts allow.
- `sequential`  bucket after bucket (the pre-fix order that caused "gradient whiplash").
- `random`      a uniform shuffle.
- `diversity`   weighted random draws, never the previous bucket; over-samples small buckets, which run
                out early, so the tail of the epoch is one bucket.
"""
from __future__ import annotations

import numpy as np

from dflash_ray.config import STRATEGIES, DataConfig  # the strategies by name (the config checks the choice)

_SALT = {name: i for i, name in enumerate(STRATEGIES)}


def interleave_order(batch_counts, *, strategy: str = DataConfig.interleave, seed: int = 0,
                     epoch: int = 0) -> np.ndarray:
    """Bucket id of every position of the epoch: an int32 array of length sum(batch_counts)."""
    raw = np.asarray(batch_counts).reshape(-1)
    counts = raw.astype(np.int64)
    if not np.array_equal(counts, raw):
        raise ValueError(f"batch counts must be whole numbers, got {raw.tolist()}")
    if counts.size and counts.min() < 0:
        raise ValueError(f"batch counts must be non-negative, got {counts.tolist()}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown interleave strategy '{strategy}' (one of {', '.join(STRATEGIES)})")
    if counts.sum() == 0:
        return np.zeros(0, dtype=np.int32)
    rng = np.random.default_rng([int(seed), int(epoch), _SALT[strategy]])
    order = _STRATEGY_FNS[strategy](counts, rng)
    return order.astype(np.int32, copy=False)


# ----------------------------------------------------------------------------- strategies
def _labels(counts: np.ndarray):
    """Bucket id of each batch (bucket-major) and each batch's index j within its bucket."""
    ids = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
    starts = np.cumsum(counts) - counts
    j = np.arange(ids.size, dtype=np.int64) - np.repeat(starts, counts)
    return ids, j


def _sequential(counts, rng):
    return np.repeat(np.arange(counts.size, dtype=np.int32), counts)


def _random(counts, rng):
    return rng.permutation(_sequential(counts, rng))


def _stride(counts, rng):
    ids, j = _labels(counts)
    n = counts.sum()
    pos = (j + rng.random(ids.size)) * (n / counts[ids])
    return ids[np.argsort(pos, kind="stable")]


def _diversity(counts, rng):
    """Static weights n_b/N, a draw equal to the previous one is redrawn (= collapse runs of iid draws);
    a bucket that runs out leaves the draw; the last bucket standing fills the tail."""
    remaining = counts.copy()
    out = []
    prev = -1
    while (remaining > 0).sum() > 1:
        live = np.flatnonzero(remaining > 0)
        p = counts[live] / counts[live].sum()
        draws = live[rng.choice(live.size, size=int(2 * remaining.sum()) + 16, p=p)]
        keep = np.empty(draws.size, dtype=bool)
        keep[0] = draws[0] != prev
        keep[1:] = draws[1:] != draws[:-1]
        seq = draws[keep]
        # cut where the first bucket runs out: position of its remaining[b]-th occurrence
        cut = seq.size
        for b in live:
            hits = np.flatnonzero(seq == b)
            if hits.size >= remaining[b]:
                cut = min(cut, int(hits[remaining[b] - 1]) + 1)
        seq = seq[:cut]
        out.append(seq)
        remaining -= np.bincount(seq, minlength=counts.size)
        prev = int(seq[-1])
    last = np.flatnonzero(remaining > 0)
    if last.size:
        out.append(np.full(int(remaining[last[0]]), last[0]))
    return np.concatenate(out)


def _default(counts, rng):
    n = int(counts.sum())
    top = int(np.argmax(counts))
    m = int(counts[top])
    rest = n - m
    if m > rest + 1:  # one bucket over half: runs are forced; spread it over the gaps between the others
        return _spread_top(counts, top, rng)
    ids, j = _labels(counts)
    # one phase per bucket keeps each bucket evenly spaced; near 1 puts every bucket's last batch in the
    # last few positions (buckets run out together) at the cost of < 1 batch of lateness at the start
    phase = 0.8 + 0.2 * rng.random(counts.size)
    pos = (j + phase[ids]) * (n / counts[ids])
    order = _break_runs(ids[np.argsort(pos, kind="stable")])
    if rest and _longest_run(order) > 1:
        # the top bucket is near half and locally too dense to fix by small moves: place it in the
        # gaps between the others instead, which can always be done without repeats
        spread = _spread_top(counts, top, rng)
        if _longest_run(spread) < _longest_run(order):
            return spread
    return order


def _longest_run(s: np.ndarray) -> int:
    if s.size == 0:
        return 0
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1], [True]]))
    return int(np.diff(starts).max())


def _spread_top(counts: np.ndarray, top: int, rng) -> np.ndarray:
    """The other buckets in their own default order, the top bucket's batches spread evenly over the
    rest+1 gaps between them (so no gap holds more than ceil(m / (rest + 1)))."""
    n = int(counts.sum())
    m = int(counts[top])
    rest = n - m
    others = counts.copy()
    others[top] = 0
    inner = _default(others, rng) if rest else np.zeros(0, dtype=np.int32)
    g = np.arange(1, rest + 1, dtype=np.float64)
    before = np.floor(g * m / (rest + 1) + rng.random()).astype(np.int64)  # top batches before other i
    out = np.full(n, top, dtype=np.int32)
    out[np.arange(rest) + before] = inner
    return out


def _break_runs(s: np.ndarray, vector_rounds: int = 12, reach: int = 64) -> np.ndarray:
    """Move batches a few positions until no bucket follows itself.

    First a few vectorised rounds of neighbour swaps (a repeat at i, s[i] == s[i-1] == a, becomes
    ...a b a c... when s[i+1] and s[i+2] differ from a), then the few repeats left (where a is locally
    dense) are fixed one by one by moving s[i] to the nearest later place between two non-a batches.
    Batches move by a handful of positions, so the proportions stay as the stride laid them out.
    """
    s = s.copy()
    n = s.size
    def at(k):  # s[k], or -1 outside the epoch
        return np.where((k >= 0) & (k < n), s[np.clip(k, 0, n - 1)], -1)

    for _ in range(vector_rounds):
        dup = np.flatnonzero(s[1:] == s[:-1]) + 1
        if dup.size == 0:
            return s
        a = s[dup]
        # later: swap (i, i+1) -> ..a b a c..; else earlier: swap (i-2, i-1) -> ..c a b a..
        fwd = (at(dup + 1) != a) & (at(dup + 1) >= 0) & (at(dup + 2) != a)
        bwd = ~fwd & (at(dup - 2) != a) & (at(dup - 2) >= 0) & (at(dup - 3) != a)
        left = np.sort(np.concatenate([dup[fwd], dup[bwd] - 2]))  # left index of each swapped pair
        keep = np.ones(left.size, dtype=bool)
        keep[1:] = np.diff(left) > 3  # swaps must not touch each other's neighbours
        i = left[keep]
        t = s[i].copy()
        s[i] = s[i + 1]
        s[i + 1] = t
    for i in (np.flatnonzero(s[1:] == s[:-1]) + 1).tolist():
        if s[i] != s[i - 1]:
            continue
        a = s[i]
        if i + 1 < n and s[i + 1] != a:
            win = s[i + 1:min(n, i + reach + 2)]
            after = np.append(win[1:], -1 if i + reach + 2 >= n else s[min(n - 1, i + reach + 2)])
            spots = np.flatnonzero((win != a) & (after != a))
            if spots.size:
                j = i + 1 + int(spots[0])  # a goes right after s[j]
                s[i:j] = s[i + 1:j + 1]
                s[j] = a
                continue
        # move the earlier a (at i-1) back instead, between two non-a batches
        if i >= 2 and s[i - 2] != a:
            lo = max(0, i - 2 - reach)
            win = s[lo:i - 1]  # candidates: insert before win[t]
            before = np.concatenate([[-1] if lo == 0 else [s[lo - 1]], win[:-1]])
            spots = np.flatnonzero((win != a) & (before != a))
            if spots.size:
                j = lo + int(spots[-1])  # a goes right before s[j]
                s[j + 1:i] = s[j:i - 1]
                s[j] = a
    return s


_STRATEGY_FNS = {
    "default": _default,
    "stride": _stride,
    "sequential": _sequential,
    "random": _random,
    "diversity": _diversity,
}


# ----------------------------------------------------------------------------- measures
def order_measures(order: np.ndarray, num_buckets: int | None = None) -> dict:
    """The measures an order is judged by (see README): quarter shares against global shares, prefix
    discrepancy, run lengths, and where each bucket's last batch falls."""
    order = np.asarray(order)
    n = order.size
    k = int(num_buckets if num_buckets is not None else (order.max() + 1 if n else 0))
    counts = np.bincount(order, minlength=k).astype(np.int64)
    share = counts / max(n, 1)
    # quarters
    edges = np.linspace(0, n, 5).round().astype(np.int64)
    quarter_share = np.zeros((4, k))
    filled = np.zeros(4, dtype=bool)
    for q in range(4):
        part = order[edges[q]:edges[q + 1]]
        if part.size:
            quarter_share[q] = np.bincount(part, minlength=k) / part.size
            filled[q] = True
    quarter_dev_pp = float(np.abs(quarter_share[filled] - share).max() * 100) if n else 0.0  # < 4 batches: skip empty quarters
    # prefix discrepancy: max over k, b of |#b in first k - k * n_b / N|
    prefix = 0.0
    steps = np.arange(1, n + 1, dtype=np.float64)
    for b in range(k):
        if counts[b]:
            dev = np.abs(np.cumsum(order == b, dtype=np.int64) - steps * share[b])
            prefix = max(prefix, float(dev.max()))
    # runs
    if n:
        starts = np.flatnonzero(np.concatenate([[True], order[1:] != order[:-1]]))
        runs = np.diff(np.concatenate([starts, [n]]))
        hist = np.bincount(runs)
        run_hist = {int(length): int(c) for length, c in enumerate(hist) if c}
        in_runs_of_1 = float(hist[1] / n) if hist.size > 1 else 0.0
        longest = int(runs.max())
    else:
        run_hist, in_runs_of_1, longest = {}, 0.0, 0
    # where each bucket's last batch falls, as a fraction of the epoch
    last = np.full(k, np.nan)
    if n:
        reversed_order = order[::-1]
        for b in range(k):
            if counts[b]:
                last[b] = (n - int(np.argmax(reversed_order == b))) / n
    m = int(counts.max()) if n else 0
    least_longest = max(1, -(-m // (n - m + 1))) if n else 0
    return {
        "batches": int(n),
        "counts": counts.tolist(),
        "global_share": share.tolist(),
        "quarter_share": quarter_share.tolist(),
        "quarter_max_dev_pp": quarter_dev_pp,
        "prefix_discrepancy": prefix,
        "longest_run": longest,
        "least_possible_longest_run": least_longest,
        "run_length_hist": run_hist,
        "fraction_in_runs_of_1": in_runs_of_1,
        "last_batch_fraction": [None if np.isnan(x) else float(x) for x in last],
        "earliest_bucket_end": float(np.nanmin(last)) if n else 0.0,
    }
