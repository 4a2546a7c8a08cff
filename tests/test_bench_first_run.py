"""benchmarks/bench_first_run.py's table and goals, on results made here by hand (the benchmark itself runs
the default job three times: 25 minutes, not a test)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_first_run", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_first_run.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def result(wall, first, tau, phases):
    return {"wall_s": wall, "first_step_s": first, "tau": tau, "steps": 568,
            "phases": [{"phase": p, "seconds": s} for p, s in phases]}


def test_phases_line_up_across_runs_and_goals_say_pass_or_fail():
    results = {"quiet": result(230.0, 120.0, 4.28, [("inputs", 100.0), ("inputs/target", 80.0), ("training", 120.0)]),
               "busy": result(500.0, 300.0, 3.9, [("inputs", 200.0), ("inputs/target", 150.0), ("training", 290.0)]),
               "second": result(140.0, 61.0, 4.28, [("inputs", 1.0), ("training", 120.0)])}
    lines = bench.table(results).splitlines()
    assert lines[0].split() == ["phase", "(s)", "quiet", "busy", "second"]
    assert lines[2].split() == ["target", "80.0", "150.0", "-"]          # nested under inputs; absent: "-"
    assert "command wall time" in lines[4] and lines[4].split()[-3:] == ["230.00", "500.00", "140.00"]
    goals = bench.goals(results)
    assert goals[0].startswith("PASS") and "230 s <= 240 s" in goals[0]
    assert goals[1].startswith("FAIL") and "2.17" in goals[1]           # 500 / 230
    assert goals[2].startswith("FAIL") and "61 s <= 60 s" in goals[2]
    assert [g[:4] for g in goals[3:]] == ["PASS", "FAIL", "PASS"]       # tau 4.28, 3.9, 4.28 against 4.0
