"""compare-orders: the measures by hand, then the command on the session's Ray with a small budget."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_ray.data.interleave import STRATEGIES
from dflash_ray.runtime.jobs.compare_orders import bucket_usage, roughness


def test_roughness_by_hand():
    flat = roughness([2.0] * 12)
    assert flat["mean_abs_step_change"] == 0.0 and flat["mean_abs_residual"] == pytest.approx(0.0, abs=1e-12)
    zigzag = roughness([1.0, 3.0] * 6, window=2)        # |change| 2 every step; the 2-wide mean is 2 except
    assert zigzag["mean_abs_step_change"] == 2.0         # at the edge-padded start, so residuals 0, 1 x 11
    assert zigzag["mean_abs_residual"] == pytest.approx(11 / 12)
    line = roughness(list(np.arange(12.0)), window=3)   # a straight line: its moving average is itself
    assert line["mean_abs_step_change"] == 1.0 and line["mean_abs_residual"] == pytest.approx(1 / 12 * 2 / 3)


def test_bucket_usage_by_hand():
    # epoch 0 in training order: buckets 0 0 1 1 | 0 1 0 1 (8 batches, fillers -1 ignored), then epoch 1
    ledger = [{"epoch": 0, "buckets": [0, 0]}, {"epoch": 0, "buckets": [1, 1]}, {"epoch": 0, "buckets": [0, 1]},
              {"epoch": 0, "buckets": [0, 1]}, {"epoch": 0, "buckets": [-1, -1]}, {"epoch": 1, "buckets": [2, 2]}]
    u = bucket_usage(ledger, 3)
    assert u["quarter_shares_pct"] == [[100.0, 0.0, 0.0], [0.0, 100.0, 0.0], [50.0, 50.0, 0.0], [50.0, 50.0, 0.0]]
    assert u["bucket_end_fraction"] == [7 / 8, 1.0, None]


def test_compare_orders_refuses_an_unknown_strategy_in_one_line(tiny_data, tmp_path, capsys):
    from dflash_ray.cli import main

    assert main(["compare-orders", "--strategies", "stride,zigzag", f"run.root={tmp_path}", *tiny_data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--strategies: unknown 'zigzag'" in err[0] and "sequential" in err[0], err


# Two of the five strategies: each is the same main job with another data.interleave (the orders themselves
# are tested in test_data_interleave.py); sequential's order is checked below, stride is the seed run's fix.
CHOSEN = ("sequential", "stride")


def test_compare_orders_trains_the_named_strategies_on_the_same_batches(train_run, tiny_data, capsys):
    from dflash_ray.cli import main

    root = train_run.root
    assert main(["compare-orders", "--strategies", ",".join(CHOSEN), f"run.root={root}", "run.name=cmp", *tiny_data,
                 "train.max_steps=6", "train.checkpoint_every=6"]) == 0
    out = capsys.readouterr().out
    assert all(f"{s:>10}" in out for s in CHOSEN) and not any(f"{s:>10}" in out for s in STRATEGIES if s not in CHOSEN)
    result = json.loads((root / "cmp-orders" / "compare_orders.json").read_text())
    assert list(result) == list(CHOSEN)
    for name in CHOSEN:
        run = Path(result[name]["run_dir"])
        ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
        losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(ledger) == 6 and result[name]["final_loss"] == losses[-1]
        assert result[name]["mean_abs_step_change"] == pytest.approx(float(np.abs(np.diff(losses)).mean()))
    # sequential: bucket after bucket, so the buckets of its epoch 0 never go back
    seq = [b for r in map(json.loads, (Path(result["sequential"]["run_dir"]) / "ledger.jsonl").read_text()
                          .splitlines()) if r["epoch"] == 0 for b in r["buckets"] if b >= 0]
    assert seq == sorted(seq) and len(set(seq)) > 1
    for png in ("compare_orders_loss.png", "compare_orders_buckets.png"):
        assert (root / "cmp-orders" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
