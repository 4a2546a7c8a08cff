"""`dflash-ray tune`'s parts that need no cluster: the search space as the command line gives it, the reports a
trial owes Tune (from its run's record rows, by hand), the cache groups, what one run asks of a cluster, and
a bad space string as one line with exit 2."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from dflash_ray.errors import UserError
from dflash_ray.search_space import Dimension, format_value, parse_space, trial_count
from dflash_ray.sweep import best_row, cache_groups, error_line, final_row, report_rows


def test_the_space_is_parsed_from_the_overrides():
    dims, rest = parse_space(["train.lr=loguniform(1e-4,3e-3)", "model.anchors_per_batch=16,32", "train.epochs=2",
                              "model.num_draft_layers=choice(1,2,3)", "train.warmup_ratio=uniform(0,0.1)",
                              "model.block_size=randint(4,9)", "data.bucket_boundaries=[64,128],[256]"])
    assert rest == ["train.epochs=2"]
    by_key = {d.key: d for d in dims}
    assert by_key["train.lr"] == Dimension("train.lr", "loguniform", (), 1e-4, 3e-3)
    assert by_key["model.anchors_per_batch"] == Dimension("model.anchors_per_batch", "grid", ("16", "32"))
    assert by_key["model.num_draft_layers"].values == ("1", "2", "3")
    assert by_key["data.bucket_boundaries"].values == ("[64,128]", "[256]")   # a list value is one value
    # what is checked before a trial starts: every listed value, a range's two ends (randint's high excluded)
    assert by_key["model.block_size"].candidates() == ["4", "8"]
    assert by_key["train.lr"].candidates() == ["0.0001", "0.003"]
    # grids cross, each combination --samples times
    assert trial_count(dims, 3) == 2 * 2 * 3
    assert str(by_key["train.lr"]) == "train.lr=loguniform(0.0001,0.003)"


def test_sampled_values_read_back_the_same():
    import numpy as np

    assert format_value(np.int64(7)) == "7" and format_value(3) == "3"
    x = 0.00018900373177964031
    assert float(format_value(x)) == x and format_value(np.float64(x)) == format_value(x)
    assert format_value("null") == "null" and format_value(True) == "True"


@pytest.mark.parametrize("arg, says", [
    ("train.lr=loguniform(0,1e-3)", "bounds above 0"),
    ("train.lr=uniform(1e-3,1e-4)", "low bound must be below"),
    ("train.lr=uniform(1e-3)", "takes two bounds"),
    ("train.lr=uniform(a,b)", "'a' is not a number"),
    ("model.block_size=randint(4,8.5)", "integer bounds"),
    ("train.lr=choice(1e-3)", "two values at least"),
    ("train.lr=1e-3,1e-3", "given twice"),
    ("train.lr=choice(1e-3,)", "an empty value"),
    ("run.name=a,b", "cannot be searched"),
    ("cluster.drafter_workers=1,2", "cannot be searched"),
])
def test_a_bad_space_is_one_line_naming_it(arg, says):
    with pytest.raises(UserError, match=says):
        parse_space([arg])


def test_a_key_searched_twice_or_no_space_is_refused():
    with pytest.raises(UserError, match="searched twice"):
        parse_space(["train.lr=1e-3,2e-3", "train.lr=uniform(1e-4,1e-3)"])
    with pytest.raises(UserError, match="no search space"):
        parse_space(["train.lr=1e-3"])


def test_the_cli_says_a_bad_space_in_one_line_and_exits_2(tmp_path, capsys):
    from dflash_ray.cli import main

    for args, says in ((["train.lr=loguniform(0,1)"], "loguniform needs bounds above 0"),
                       (["train.lr=1e-3"], "no search space"),
                       (["train.lr=1e-3,2e-3", "--samples", "0"], "--samples 0: must be 1 or more")):
        assert main(["tune", *args, f"run.root={tmp_path}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not any(tmp_path.iterdir())   # nothing made, no Ray started


def _metrics(losses, tokens=100, seconds=2.0):
    return [{"step": i + 1, "loss": x, "tokens": tokens, "step_seconds": seconds} for i, x in enumerate(losses)]


def test_reports_every_n_steps_by_hand():
    metrics = _metrics([6.0, 5.0, 4.0, 3.0, 2.0])
    rows = report_rows(metrics, [], every=2, evaluations=False)
    # steps 2 and 4: the mean loss of the steps since the last report, tokens and seconds up to the step
    assert rows == [{"step": 2, "loss": 5.5, "tokens": 200, "train_seconds": 4.0},
                    {"step": 4, "loss": 3.5, "tokens": 400, "train_seconds": 8.0}]
    # after step 2 was sent: only step 4; a step logged again after a restart counts once (its last line)
    again = metrics[:4] + [{"step": 4, "loss": 1.0, "tokens": 100, "step_seconds": 2.0}]
    assert report_rows(again, [], every=2, evaluations=False, after=2) == [
        {"step": 4, "loss": 2.5, "tokens": 400, "train_seconds": 8.0}]


def test_reports_per_evaluation_by_hand():
    metrics = _metrics([6.0, 5.0, 4.0, 3.0])
    evals = [{"step": 3, "tau": 1.5}, {"step": 1, "tau": 1.1}, {"step": 6, "tau": 2.0}]   # step 6: not trained yet
    rows = report_rows(metrics, evals, every=99, evaluations=True)
    assert rows == [{"step": 1, "loss": 6.0, "tokens": 100, "train_seconds": 2.0, "tau": 1.1},
                    {"step": 3, "loss": 4.5, "tokens": 300, "train_seconds": 6.0, "tau": 1.5}]
    assert report_rows([], evals, every=1, evaluations=True) == []
    # the last report: the last step, the mean of its last `every` steps, the tau after training
    last = final_row(metrics, {"heldout_tau": {"trained": {"tau": 2.25}}}, every=3)
    assert last == {"step": 4, "loss": 4.0, "tokens": 400, "train_seconds": 8.0, "tau": 2.25, "final": 1}
    assert "tau" not in final_row(metrics, {"heldout_tau": None}, every=3)


def test_cache_groups_by_hand():
    lr = Dimension("train.lr", "loguniform", (), 1e-4, 1e-3)
    layers = Dimension("model.num_draft_layers", "choice", ("1", "2", "3"))
    width = Dimension("model.anchors_per_batch", "grid", ("16", "32"))
    seen = []

    def identity_of(extra):   # only the layer count changes the features (the taps follow it)
        seen.append(tuple(extra))
        return ("taps", next((x for x in extra if x.startswith("model.num_draft_layers=")), "model.num_draft_layers=2"))

    assert cache_groups([lr, width], identity_of) == [[]]
    assert ("train.lr=0.0001",) in seen and ("train.lr=0.001",) in seen   # a range: its two ends resolved
    assert cache_groups([lr, layers, width], identity_of) == [
        ["model.num_draft_layers=1"], ["model.num_draft_layers=2"], ["model.num_draft_layers=3"]]
    with pytest.raises(UserError, match="changes the target's features.*grid or a choice"):
        cache_groups([Dimension("model.num_draft_layers", "randint", (), 1, 4)], identity_of)


def test_the_best_is_the_best_finished_trial():
    rows = [{"trial": "a", "status": "finished", "tau": 1.5, "loss": 3.0},
            {"trial": "b", "status": "stopped", "tau": 9.0, "loss": 0.1},      # stopped early: never the best
            {"trial": "c", "status": "finished", "tau": 2.5, "loss": 4.0},
            {"trial": "d", "status": "failed", "tau": None, "loss": None}]
    assert best_row(rows, "tau")["trial"] == "c" and best_row(rows, "loss")["trial"] == "a"
    assert best_row(rows[1:2], "tau") is None


def test_a_trials_error_is_its_own_line():
    text = ("ray::run_trial() (pid=1)\n  File \"x.py\", line 3, in f\n    raise UserError(...)\n"
            "dflash_ray.errors.UserError: training failed once, more than train.max_failures=0 allows\n")
    assert error_line(text) == "training failed once, more than train.max_failures=0 allows"
    assert error_line("a\nRuntimeError: boom\n") == "RuntimeError: boom"


def test_what_one_run_asks_of_a_cluster_by_hand():
    from dflash_ray.runtime.cluster import run_need

    cpu = SimpleNamespace(use_gpu=False, drafter_workers=2, target_workers=3, target_resource="target_slot",
                          target_gpus_per_replica=1, target_gpus=1.0, drafter_gpus=1.0)
    assert run_need(cpu) == {"CPU": 2 + 3 * 0.5 + 0.25, "target_slot": 3.0}
    gpu = SimpleNamespace(use_gpu=True, drafter_workers=2, target_workers=3, target_resource="target_slot",
                          target_gpus_per_replica=2, target_gpus=1.0, drafter_gpus=0.5)
    assert run_need(gpu) == {"CPU": 2 + 3 * 2 * 1 + 0.25, "GPU": 3 * 1.0 * 2 + 2 * 0.5}
    assert math.isclose(run_need(gpu)["GPU"], 7.0)
