"""Where the test suite's time goes, by module and by fixture (docs/testing.md states the budget per tier).

    .venv/bin/python benchmarks/bench_suite.py                     # the whole suite, then the tables
    .venv/bin/python benchmarks/bench_suite.py -m "not slow"       # the quick loop
    .venv/bin/python benchmarks/bench_suite.py --from report.json  # the tables of an earlier run
    .venv/bin/python benchmarks/bench_suite.py --from after.json --against before.json   # and by module, both
    .venv/bin/python benchmarks/bench_suite.py -n 2                # on two pytest-xdist workers

Runs pytest with tests/durations_report.py's `--durations-json` (every test's setup/call/teardown and every
fixture's set-up seconds) and prints: the wall time against the tier's budget, seconds by module (tests,
total, the slowest test), the fixtures whose set-up costs most (scope, times built, seconds), and the
slowest tests. The budget is not a test (a timed test is flaky on a shared machine): put the table in the
description of a change that adds a slow test instead.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# seconds of tests, on a quiet two-core machine (docs/testing.md)
BUDGET_S = {"whole suite": 15 * 60, "quick loop (-m \"not slow\")": 90}


def run_suite(pytest_args: list[str], out: Path) -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--durations-json={out}", *pytest_args], cwd=REPO)
    return time.time() - t0


def summarise(report: dict) -> dict:
    tests = report["tests"]
    modules: dict[str, dict] = defaultdict(lambda: {"tests": 0, "seconds": 0.0, "slowest": ("", 0.0)})
    for nodeid, t in tests.items():
        mod = nodeid.split("::")[0]
        s = t.get("setup", 0.0) + t.get("call", 0.0) + t.get("teardown", 0.0)
        m = modules[mod]
        m["tests"] += 1
        m["seconds"] += s
        if s > m["slowest"][1]:
            m["slowest"] = (nodeid.split("::", 1)[1], s)
    fixtures: dict[tuple, dict] = defaultdict(lambda: {"built": 0, "seconds": 0.0})
    for f in report["fixtures"]:
        k = (f["fixture"], f["scope"])
        fixtures[k]["built"] += 1
        fixtures[k]["seconds"] += f["seconds"]
    outcomes: dict[str, int] = defaultdict(int)
    for t in tests.values():
        outcomes[t["outcome"]] += 1
    return {"modules": dict(modules), "fixtures": dict(fixtures), "outcomes": dict(outcomes)}


def print_tables(report: dict, tier: str, wall: float | None, top: int = 25) -> None:
    s = summarise(report)
    wall = wall if wall is not None else report.get("wall_s", 0.0)
    budget = BUDGET_S.get(tier)
    outcomes = ", ".join(f"{v} {k}" for k, v in sorted(s["outcomes"].items()))
    print(f"\n{tier}: {len(report['tests'])} tests ({outcomes}) in {wall:.0f} s ({wall / 60:.1f} min)"
          + (f", budget {budget} s: {'within' if wall <= budget else 'OVER'}" if budget else ""))
    print("\n| module | tests | seconds | share | slowest test (s) |\n|---|---|---|---|---|")
    total = sum(m["seconds"] for m in s["modules"].values()) or 1.0
    for mod, m in sorted(s["modules"].items(), key=lambda kv: -kv[1]["seconds"]):
        name, sec = m["slowest"]
        print(f"| {mod} | {m['tests']} | {m['seconds']:.1f} | {100 * m['seconds'] / total:.1f}% | {name} ({sec:.1f}) |")
    print(f"\n| fixture | scope | built | set-up seconds |\n|---|---|---|---|")
    for (name, scope), f in sorted(s["fixtures"].items(), key=lambda kv: -kv[1]["seconds"])[:top]:
        if f["seconds"] >= 0.5:
            print(f"| {name} | {scope} | {f['built']} | {f['seconds']:.1f} |")
    print(f"\n| slowest tests | setup | call | teardown |\n|---|---|---|---|")
    ranked = sorted(report["tests"].items(), key=lambda kv: -sum(kv[1].get(w, 0.0) for w in ("setup", "call", "teardown")))
    for nodeid, t in ranked[:top]:
        print(f"| {nodeid} | {t.get('setup', 0):.1f} | {t.get('call', 0):.1f} | {t.get('teardown', 0):.1f} |")


def print_against(before: dict, after: dict, top: int) -> None:
    """Seconds by module in an earlier report beside this one (the time each change saved or added)."""
    b, a = summarise(before)["modules"], summarise(after)["modules"]
    print(f"\nagainst the earlier report: {len(before['tests'])} tests in {before.get('wall_s', 0):.0f} s -> "
          f"{len(after['tests'])} tests in {after.get('wall_s', 0):.0f} s")
    print("\n| module | tests before | tests after | seconds before | seconds after | change |\n|---|---|---|---|---|---|")
    rows = sorted(set(b) | set(a), key=lambda m: -max(b.get(m, {}).get("seconds", 0), a.get(m, {}).get("seconds", 0)))
    for mod in rows[:top]:
        sb, sa = b.get(mod, {}).get("seconds", 0.0), a.get(mod, {}).get("seconds", 0.0)
        print(f"| {mod} | {b.get(mod, {}).get('tests', 0)} | {a.get(mod, {}).get('tests', 0)} | {sb:.1f} | {sa:.1f} "
              f"| {sa - sb:+.1f} |")


def _selects(pytest_args: list[str]) -> bool:
    """Whether the arguments choose tests (paths, -k, -m), not only how to run them (-n 2, --dist ...)."""
    how = {"-n", "--numprocesses", "--dist", "--maxprocesses", "-p"}
    rest = list(pytest_args)
    while rest:
        a = rest.pop(0)
        if a in how:
            rest = rest[1:]
        elif not (a.startswith("-n") and a[2:].isdigit()) and not a.startswith(("--dist=", "--numprocesses=")):
            return True
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", help="summarise this --durations-json report instead of running")
    ap.add_argument("--keep", help="also keep the report at this path")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--against", help="an earlier report: seconds by module before and after")
    args, pytest_args = ap.parse_known_args(argv)
    quick = any("not slow" in a for a in pytest_args)
    tier = "quick loop (-m \"not slow\")" if quick else ("whole suite" if not _selects(pytest_args) else "a selection")
    wall = None
    if args.source:
        report = json.loads(Path(args.source).read_text())
    else:
        out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp()) / "durations.json"
        wall = run_suite(pytest_args, out)
        report = json.loads(out.read_text())
    print_tables(report, tier, wall, args.top)
    if args.against:
        print_against(json.loads(Path(args.against).read_text()), report, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
