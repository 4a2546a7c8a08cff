"""compare and compare-orders: the measures by hand, the sweep's parsing and its one-line errors, then the
commands on the session's Ray with a small budget. The compare's two runs are also the bf16 test's (what
tests/test_cpu_bf16.py trained on its own: model.compute_dtype=bfloat16 across two epoch ends)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers_cluster import RUNTIME_RUN

from dflash_ray.data.interleave import STRATEGIES
from dflash_ray.errors import UserError
from dflash_ray.compare import bucket_usage, equal_time, parse_sweep, roughness, take_sweeps
from dflash_ray.sweep import tau_curve


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


def test_the_sweep_is_parsed_and_bad_ones_are_one_line():
    assert parse_sweep("model.anchors_per_batch=null,32") == ("model.anchors_per_batch", ["null", "32"])
    assert parse_sweep("data.bucket_boundaries=[64,128],[128,256],[512]") == (
        "data.bucket_boundaries", ["[64,128]", "[128,256]", "[512]"])
    for bad, says in (("model.anchors_per_batch=32", "two values at least"), ("model.block_size", "KEY=V1,V2"),
                      ("train.lr=1e-3,", "KEY=V1,V2"), ("run.name=a,b", "cannot be compared")):
        with pytest.raises(UserError, match=says):
            parse_sweep(bad)
    # keys swept together: any other override with as many values; lists and single values stay overrides
    sweeps, rest = take_sweeps("model.anchors_per_batch=32,null", ["model.max_block_tokens_per_batch=null,1024",
                                                                   "data.bucket_boundaries=[64,128]", "train.lr=1e-3"])
    assert sweeps == {"model.anchors_per_batch": ["32", "null"], "model.max_block_tokens_per_batch": ["null", "1024"]}
    assert rest == ["data.bucket_boundaries=[64,128]", "train.lr=1e-3"]
    with pytest.raises(UserError, match="as many values each"):
        take_sweeps("model.anchors_per_batch=32,null", ["train.lr=1e-3,2e-3,3e-3"])
    # a value may repeat in one key when the runs differ in another; a whole run may not
    assert take_sweeps("model.anchors_per_batch=null,32,32", ["train.epochs=8,8,13"])[0]["train.epochs"] == ["8", "8", "13"]
    for sweep, more in (("train.lr=1e-3,1e-3", []), ("model.anchors_per_batch=32,32", ["train.epochs=8,8"])):
        with pytest.raises(UserError, match="given twice"):
            take_sweeps(sweep, more)


def test_a_bad_value_or_key_stops_compare_before_anything_trains(tiny_data, tmp_path, capsys):
    from dflash_ray.cli import main

    # a value below the key's minimum, then a key that does not exist: one line each, exit 2, no run made
    for sweep, says in (("model.anchors_per_batch=null,0", "model.anchors_per_batch"),
                        ("model.anchors_per_bach=1,2", "did you mean 'model.anchors_per_batch'")):
        assert main(["compare", sweep, f"run.root={tmp_path}", *tiny_data]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not any(tmp_path.iterdir())


def test_tau_at_equal_training_time_by_hand():
    # run a: 4 steps of 10 s, evals at steps 2 (tau 1.5) and 4 (tau 1.8), final tau 2.0 after 40 s;
    # run b: 4 steps of 5 s, final tau 1.7 after 20 s -> T = 20 s: b's final, a's eval at step 2 (20 s)
    a_metrics = [{"step": k, "step_seconds": 10.0, "tokens": 100} for k in range(1, 5)]
    b_metrics = [{"step": k, "step_seconds": 5.0, "tokens": 100} for k in range(1, 5)]
    curve = tau_curve(a_metrics, [{"step": 2, "tau": 1.5}, {"step": 4, "tau": 1.8}])
    assert curve == [{"step": 2, "tau": 1.5, "train_seconds": 20.0, "tokens": 200},
                     {"step": 4, "tau": 1.8, "train_seconds": 40.0, "tokens": 400}]
    rows = {"a": {"train_seconds": 40.0, "heldout_tau": 2.0, "tau_curve": curve},
            "b": {"train_seconds": 20.0, "heldout_tau": 1.7, "tau_curve": tau_curve(b_metrics, [])}}
    equal_time(rows)
    assert (rows["a"]["tau_at_equal_time"], rows["b"]["tau_at_equal_time"]) == (1.5, 1.7)
    assert rows["a"]["equal_time_seconds"] == rows["b"]["equal_time_seconds"] == 20.0
    # no evaluation by then: unknown, not a guess
    rows["a"]["tau_curve"] = curve[1:]
    equal_time(rows)
    assert rows["a"]["tau_at_equal_time"] is None


def test_compare_orders_refuses_an_unknown_strategy_in_one_line(tiny_data, tmp_path, capsys):
    from dflash_ray.cli import main

    assert main(["compare-orders", "--strategies", "stride,zigzag", f"run.root={tmp_path}", *tiny_data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--strategies: unknown 'zigzag'" in err[0] and "sequential" in err[0], err


# Two of the five strategies: each is the same main job with another data.interleave (the orders themselves
# are tested in test_data_interleave.py); sequential's order is checked below, stride is the seed run's fix.
CHOSEN = ("sequential", "stride")
# the compare test's runs are also the bf16 run (test_a_bf16_run_crosses_its_epoch_ends): two epochs, fillers at each end
BF16 = ["train.grad_accum=3", "model.compute_dtype=bfloat16"]


def test_compare_orders_trains_the_named_strategies_on_the_same_batches(train_run, tiny_data, capsys):
    from dflash_ray.cli import main

    root = train_run.root
    assert main(["compare-orders", "--strategies", ",".join(CHOSEN), f"run.root={root}", "run.name=cmp", *tiny_data,
                 "train.max_steps=6", "train.checkpoint_every=6"]) == 0
    out = capsys.readouterr().out
    assert all(f"{s:>10}" in out for s in CHOSEN) and not any(f"{s:>10}" in out for s in STRATEGIES if s not in CHOSEN)
    result = json.loads((root / "cmp-orders" / "compare_orders.json").read_text())
    assert result["key"] == "data.interleave"
    result = result["runs"]
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


@pytest.fixture(scope="module")
def compared(train_run, tiny_data):
    """`compare model.anchors_per_batch=null,4` once, on RUNTIME_RUN's two epochs with train.grad_accum=3 and
    model.compute_dtype=bfloat16: the runs of the compare test below and of the bf16 test after it (one
    Ray Train fit's worth of start-up saved; neither setting changes what the other test checks, so a fault
    in either fails both, each of which also checks its own facts). The runs are Ray Tune trials (other
    processes): each one's summary.json is read back. Returns (exit code, stdout, root, {run.name: summary})."""
    import contextlib
    import io

    from dflash_ray.cli import main

    root, out = train_run.root, io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["compare", "model.anchors_per_batch=null,4", f"run.root={root}", "run.name=cmpd", *tiny_data,
                     *RUNTIME_RUN, *BF16, "train.heldout_every=2"])
    runs = {p.parent.name: json.loads(p.read_text()) for p in root.glob("cmpd-anchors_per_batch-*/summary.json")}
    return code, out.getvalue(), root, runs


def test_compare_trains_each_value_with_everything_else_equal(compared):
    """The recipe's density against thinning: the same batches (ledger), the thinned run trains fewer
    block tokens (its metrics' sum); the equal-time mark is the shorter run's training time (tau itself is
    not measured in this small world: no held-out prompts; tests/test_runtime_jobs.py covers held-out tau)."""
    code, out, root, _ = compared
    assert code == 0, out[-3000:]
    assert "model.anchors_per_batch" in out and "tau@time" in out
    report = json.loads((root / "cmpd-compare" / "compare.json").read_text())
    assert report["key"] == "model.anchors_per_batch" and list(report["runs"]) == ["null", "4"]
    runs = report["runs"]
    ledgers, blocks = {}, {}
    for value, r in runs.items():
        run = Path(r["run_dir"])
        assert run.name == f"cmpd-anchors_per_batch-{value}"
        ledgers[value] = [(x["positions"], x["buckets"]) for x in map(json.loads, (run / "ledger.jsonl").read_text().splitlines())]
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        blocks[value] = sum(m["block_tokens"] for m in metrics)
        assert r["block_tokens"] == blocks[value] and r["tokens"] == sum(m["tokens"] for m in metrics)
        assert r["train_seconds"] == pytest.approx(sum(m["step_seconds"] for m in metrics))
    assert all(r["equal_time_seconds"] == min(x["train_seconds"] for x in runs.values()) for r in runs.values())
    assert ledgers["null"] == ledgers["4"]                          # the same batches in the same order
    # 4 anchors a batch at most, x block 8, per batch of the step (batches_per_step from the metrics)
    assert blocks["4"] < blocks["null"] and blocks["4"] <= 4 * 8 * sum(len(p) for p, _ in ledgers["4"])
    for png in ("compare_loss.png", "compare_buckets.png"):
        assert (root / "cmpd-compare" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- bf16 on the CPU
def test_a_bf16_run_crosses_its_epoch_ends(compared, tiny_plan_batches):
    """model.compute_dtype=bfloat16 on the CPU (what model=smollm2_135m trains with): the target actors'
    features in bf16, the epoch end's filler rows encoded the same way (one dtype in the stream:
    found fp32 fillers beside bf16 rows), the drafter under bf16 autocast; two epochs, every planned batch
    trained once. The runs are the compare's (`compared`: RUNTIME_RUN, train.grad_accum=3), both checked."""
    per_step = 2 * 3                                 # RUNTIME_RUN's 2 drafter workers x grad_accum 3
    assert all(n % per_step for n in tiny_plan_batches), "an epoch ends without a filler: the test would miss it"
    code, out, _, runs = compared
    assert code == 0, out[-3000:]
    assert sorted(runs) == ["cmpd-anchors_per_batch-4", "cmpd-anchors_per_batch-null"]
    for s in runs.values():
        assert s["compute_dtype"] == "bfloat16"
        assert s["ledger"]["ok"] and s["epochs_finished"] == [0, 1]
        assert s["steps"] == sum(-(-n // per_step) for n in tiny_plan_batches)
        assert math.isfinite(s["final_loss"])
