"""Where the suite's time goes: `--durations-json PATH` writes every test's phases (setup, call,
teardown) and every fixture's set-up seconds as JSON, for `benchmarks/bench_suite.py` to summarise by
module and by fixture (docs/testing.md). pytest's own `--durations` prints tests only, and charges a
session fixture's set-up to whichever test happened to ask for it first; this says which fixture it was.
"""
from __future__ import annotations

import glob
import json
import os
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--durations-json", default=None, metavar="PATH",
                     help="write per-test and per-fixture seconds as JSON to PATH")


class DurationsRecorder:
    def __init__(self, path: str):
        self.path = path
        self.tests: dict[str, dict] = {}
        self.fixtures: list[dict] = []
        self.started = time.time()
        self._current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._current = item.nodeid
        yield
        self._current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        t0 = time.perf_counter()
        yield
        self.fixtures.append({"fixture": fixturedef.argname, "scope": fixturedef.scope,
                              "seconds": round(time.perf_counter() - t0, 4), "test": self._current})

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed"})
        entry[report.when] = round(report.duration, 4)
        if report.outcome != "passed" and not (report.when != "call" and report.outcome == "skipped"):
            entry["outcome"] = report.outcome
        elif report.outcome == "skipped":
            entry["outcome"] = "skipped"
        entry["markers"] = sorted({k for k in report.keywords if k in ("slow", "ray")})

    def pytest_sessionfinish(self, session, exitstatus):
        # Under pytest-xdist (-n N) fixtures are set up in the workers, and the controller sees every test's
        # report but no fixture: each worker writes its fixtures beside the report, the controller merges them.
        worker = getattr(session.config, "workerinput", {}).get("workerid")
        if worker is not None:
            self._write(f"{self.path}.{worker}", {"fixtures": [{**f, "worker": worker} for f in self.fixtures]})
            return
        fixtures = list(self.fixtures)
        for part in sorted(glob.glob(f"{glob.escape(self.path)}.gw*")):
            with open(part) as f:
                fixtures += json.load(f)["fixtures"]
            os.remove(part)
        self._write(self.path, {"wall_s": round(time.time() - self.started, 2), "exitstatus": int(exitstatus),
                                "tests": self.tests, "fixtures": fixtures})

    @staticmethod
    def _write(path: str, data: dict) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)


def pytest_configure(config):
    path = config.getoption("--durations-json")
    if path:
        config.pluginmanager.register(DurationsRecorder(path), "durations_json_recorder")
