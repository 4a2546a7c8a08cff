"""torch.compile over the stream's mixed shapes: the drafter's compiled layers build a bounded number of
graphs and then none (benchmarks/bench_recompiles.py, CPU, dynamo's eager backend: its guards and
recompiles without code generation). The bound by hand: one code object for all layers, guards split by
whether the input needs a gradient (layer 0's comes from the frozen embedding) and by first shape / any
later shape (dynamic) / one row (torch specialises size 1): 2 x 3 = 6, under dynamo's limit of 8."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_recompiles import CPU_BUCKETS, GRAPH_BOUND, count_graphs  # noqa: E402


@pytest.mark.slow
def test_mixed_buckets_build_at_most_six_graphs_then_none():
    seq = [CPU_BUCKETS[i] for i in (0, 3, 5, 1, 6, 2, 4)]       # every bucket once, one-row ones mid-way
    first = count_graphs(seq, dynamic=None, backend="eager", cuda=False)
    again = count_graphs(seq + seq[::-1] + seq, dynamic=None, backend="eager", cuda=False)
    assert first["graphs"] <= GRAPH_BOUND == 6 and first["recompiles"] == first["graphs"] - 1
    # the same shapes again (and in another order) build nothing new: the count is the first pass's
    assert again["graphs"] == first["graphs"] and again["last_new_graph_at_batch"] <= len(seq)
    assert all("requires_grad" in r or "size" in r or "<=" in r or "==" in r for r in first["reasons"])
