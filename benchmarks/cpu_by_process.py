"""Where a command's CPU goes, by process role: runs the command, samples /proc once a second, and prints the
CPU seconds of every process it started (Ray's included: raylet, GCS, dashboard, its workers by task title).

    .venv/bin/python benchmarks/cpu_by_process.py [--after RUN_DIR/metrics.jsonl] -- .venv/bin/dflash-ray train ...

Ray names a worker process after what it runs (`ray::RayTrainWorker.train_fn`, `ray::TargetForward`,
`ray::MapBatches(join_tokens)`, `ray::IDLE`), and a worker changes title between tasks: the CPU a process used
between two samples goes to the title it had at the later one. `--after` counts only the CPU used once a file
has content (the run's metrics.jsonl gets its first line at the first step: start-up left out).
Linux only. Processes that start and exit between two samples are missed (counted in the `lost` line as the
gap between the machine's busy time and the sum).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int):
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, cmd   # ppid, utime+stime, cmdline


def _machine_busy() -> float:
    parts = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    vals = [int(x) for x in parts]
    return (sum(vals) - vals[3] - vals[4]) / TICK   # all but idle and iowait


def role(cmd: str) -> str:
    """A process's role from its title: Ray's task/actor title, or the program's name."""
    if cmd.startswith("ray::"):
        return re.sub(r"\s.*", "", cmd)
    for name in ("raylet", "gcs_server", "dashboard/agent.py", "dashboard.py", "log_monitor", "monitor.py",
                 "runtime_env/agent", "default_worker.py", "dflash-ray"):
        if name in cmd:
            return name
    return (cmd.split(" ")[0].rsplit("/", 1)[-1] or "?")[:40]


def started(after: Path | None) -> bool:
    return after is None or (after.exists() and after.stat().st_size > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", type=Path, help="count only once this file has content (e.g. the run's "
                    "metrics.jsonl, written at the first step: start-up left out)")
    ap.add_argument("--json", type=Path, help="also write the table here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    proc = subprocess.Popen(cmd)
    seen: dict[int, float] = {}            # pid -> CPU seconds at its last sample
    by_role: dict[str, float] = defaultdict(float)
    counting, t_start, busy_start = False, None, None
    ours = {proc.pid}
    while True:
        done = proc.poll() is not None
        if not counting and started(args.after):
            counting, t_start, busy_start = True, time.monotonic(), _machine_busy()   # CPU so far: `seen`
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _stat(int(entry))):
                stats[int(entry)] = st
        # every process below the command, and Ray's daemons (started detached: parent 1)
        for pid, (ppid, _, c) in stats.items():
            if ppid in ours or ("ray" in c and pid not in ours and ppid == 1 and ("raylet" in c or "gcs_server" in c)):
                ours.add(pid)
        changed = True
        while changed:
            changed = False
            for pid, (ppid, _, _) in stats.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    changed = True
        for pid in ours & stats.keys():
            _, cpu, c = stats[pid]
            if counting:
                by_role[role(c)] += cpu - seen.get(pid, 0.0)   # a new process: all its CPU is in the window
            seen[pid] = cpu
        if done:
            break
        time.sleep(1.0)
    wall = time.monotonic() - (t_start or time.monotonic())
    busy = _machine_busy() - (busy_start or _machine_busy())
    total = sum(by_role.values())
    rows = sorted(by_role.items(), key=lambda kv: -kv[1])
    print(f"\nCPU seconds by process role over {wall:.0f} s of wall ({os.cpu_count()} cores: "
          f"{wall * os.cpu_count():.0f} core-s); machine busy {busy:.0f} core-s")
    print("| role | CPU s | share of counted |\n|---|---|---|")
    for name, s in rows:
        if s >= 0.5:
            print(f"| {name} | {s:.1f} | {s / max(total, 1e-9):.1%} |")
    print(f"| (counted) | {total:.1f} | |\n| (machine busy, not counted: other processes, missed short ones) | "
          f"{busy - total:.1f} | |")
    if args.json:
        args.json.write_text(json.dumps({"wall_s": wall, "machine_busy_s": busy, "cpu_s": dict(rows)}, indent=1))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
