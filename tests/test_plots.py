"""`dflash-ray plot`'s figures from a run directory's files (written here by hand, as the run record writes
them): the held-out tau curve joins the fresh drafter's tau at step 0, the evaluations during training and
the trained drafter's at the last step; a run that measured no tau draws no such figure."""
import json

from dflash_ray.runtime.record.plots import heldout_curve, plot_run

PNG = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, evals, tau):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_second": 100.0})
                                               + "\n" for s in range(1, 31)))
    (run / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    (run / "summary.json").write_text(json.dumps({"heldout_tau": tau}))
    return run


def test_the_heldout_curve_runs_from_the_fresh_drafter_to_the_trained_one(tmp_path):
    run = _run(tmp_path, [{"step": 10, "tau": 1.5}, {"step": 20, "tau": 2.25}],
               {"initial": {"tau": 1.0, "prompts": 4}, "trained": {"tau": 2.5, "prompts": 4}})
    assert heldout_curve(run, 30) == [(0, 1.0), (10, 1.5), (20, 2.25), (30, 2.5)]
    paths = plot_run(run)
    assert run / "plots" / "heldout_tau.png" in paths
    assert (run / "plots" / "heldout_tau.png").read_bytes()[:8] == PNG


def test_no_tau_measured_no_tau_figure(tmp_path):
    run = _run(tmp_path, [], None)
    assert heldout_curve(run, 30) == []
    assert [p.name for p in plot_run(run)] == ["loss.png", "tokens_per_second.png"]
