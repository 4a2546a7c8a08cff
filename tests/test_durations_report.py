"""The suite's durations report (tests/durations_report.py, summarised by benchmarks/bench_suite.py): every
test's phases and every fixture's set-up, in one process and on two pytest-xdist workers (where fixtures are
set up in the workers and only the controller sees the tests). Run on a tiny suite of known sleeps."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MODULE = """import time, pytest

@pytest.fixture(scope="module")
def {name}():
    time.sleep({fixture_s})

def test_one({name}):
    time.sleep({call_s})

def test_two({name}):
    pass
"""


def _bench_suite():
    spec = importlib.util.spec_from_file_location("bench_suite", TESTS.parent / "benchmarks" / "bench_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "two-workers"])
def test_the_report_holds_every_test_and_every_workers_fixtures(tmp_path, workers):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_a.py").write_text(MODULE.format(name="fixture_a", fixture_s=0.3, call_s=0.2))
    (suite / "test_b.py").write_text(MODULE.format(name="fixture_b", fixture_s=0.1, call_s=0.0))
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "--rootdir", str(suite),
                          "-p", "durations_report", "-p", "no:cacheprovider", f"--durations-json={out}", *workers,
                          str(suite)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["tests"]) == {f"test_{m}.py::test_{n}" for m in "ab" for n in ("one", "two")}
    assert report["tests"]["test_a.py::test_one"]["call"] >= 0.2
    fixtures = {f["fixture"]: f for f in report["fixtures"] if f["fixture"].startswith("fixture_")}
    assert set(fixtures) == {"fixture_a", "fixture_b"}           # both modules', whichever worker ran them
    assert fixtures["fixture_a"]["scope"] == "module" and fixtures["fixture_a"]["seconds"] >= 0.3
    assert fixtures["fixture_b"]["seconds"] >= 0.1
    assert not list(tmp_path.glob("report.json.*"))               # the workers' parts merged and removed
    modules = _bench_suite().summarise(report)["modules"]
    assert modules["test_a.py"]["tests"] == 2 and modules["test_a.py"]["seconds"] >= 0.2


def test_how_to_run_is_not_a_selection():
    selects = _bench_suite()._selects
    assert not selects([]) and not selects(["-n", "2"]) and not selects(["-n2", "--dist", "loadfile"])
    assert selects(["tests/test_fsdp.py"]) and selects(["-n", "2", "-k", "fsdp"])
