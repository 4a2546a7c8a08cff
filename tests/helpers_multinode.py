"""A real multi-node Ray cluster on this machine: a head and worker nodes, each its own raylet (`ray start
--head` + `ray start --address`, distinct ports and resources, on 127.0.0.1), and jobs submitted to it with
the project's `jobs/` scripts, as a user submits them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers_cluster import NODE_ENV, RAY, REPO, free_ports, head_args, http_get, stop_nodes, worker_ports


class Cluster:
    """`with Cluster(tmp, head={...}, workers=[{...}]) as c:` — c.address (the dashboard), c.kill_worker(i)."""

    def __init__(self, tmp: Path, head: dict, workers: list[dict], object_store: int = 200_000_000,
                 env: dict | None = None):
        self.tmp, self.head_spec, self.worker_specs, self.object_store = Path(tmp), head, workers, object_store
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "2000",
                    **NODE_ENV, **(env or {})}   # every process of the cluster (the job's driver too) sees `env`
        self.env.pop("RAY_ADDRESS", None)
        # the cluster's `python` (what jobs/*.sh run) is the project's environment, as on a user's nodes
        self.env["PATH"] = f"{Path(sys.executable).parent}:{self.env.get('PATH', '')}"
        self.temp = tempfile.mkdtemp(prefix="dfrmn", dir="/tmp")   # short: Ray puts unix sockets under it
        self.procs: list[subprocess.Popen] = []
        self.logs = []

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        self.logs.append(log)
        p = subprocess.Popen([RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                              f"--object-store-memory={self.object_store}", *args],
                             env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    @staticmethod
    def _resources(spec: dict) -> list[str]:
        return [f"--num-cpus={spec.get('cpus', 2)}", f"--resources={json.dumps(spec.get('resources', {}))}"]

    def __enter__(self):
        head = head_args(self.temp)
        self.metrics = head.metrics
        self._start("head", [*head.args, *self._resources(self.head_spec)])
        self.address = f"http://127.0.0.1:{head.dashboard}"
        self.gcs = f"127.0.0.1:{head.gcs}"
        self._wait(lambda: http_get(f"{self.address}/api/version") is not None, 120, "the head's dashboard")
        for i, spec in enumerate(self.worker_specs):
            metrics, agent, agent_grpc, rtenv, nm, om = free_ports(6)
            self._start(f"worker{i}", [f"--address={self.gcs}", f"--metrics-export-port={metrics}",
                                       f"--dashboard-agent-listen-port={agent}",
                                       f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={rtenv}",
                                       f"--node-manager-port={nm}", f"--object-manager-port={om}",
                                       # a temp dir of its own, as on its own machine: two nodes unpacking
                                       # the job's working_dir into one directory race (files vanish)
                                       f"--temp-dir={self.temp}w{i}", *worker_ports(1 + i), *self._resources(spec)])
        self._wait(lambda: len(self.alive_nodes()) == 1 + len(self.worker_specs), 120, "the worker nodes")
        return self

    def _wait(self, pred, timeout, what):
        deadline = time.time() + timeout
        while not pred():
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"{what}: node process {i} exited: " + \
                    (self.tmp / ("head.log" if i == 0 else f"worker{i - 1}.log")).read_text()[-3000:]
            assert time.time() < deadline, f"{what} did not come up in {timeout}s"
            time.sleep(1)

    def alive_nodes(self) -> list[dict]:
        """The GCS's view (Ray's state API, what `ray list nodes` reads): rows with node_id and state."""
        text = http_get(f"{self.address}/api/v0/nodes")
        if not text:
            return []
        rows = ((json.loads(text).get("data") or {}).get("result") or {}).get("result") or []
        return [n for n in rows if n.get("state") == "ALIVE"]

    def kill_worker(self, i: int) -> None:
        """The worker node dies as a machine does: its raylet and every process it started, SIGKILLed."""
        p = self.procs[1 + i]
        os.killpg(p.pid, signal.SIGKILL)
        for child in _descendants(p.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass

    def submit(self, script: str, args: list[str], *, wait: bool = True, log: Path | None = None):
        """`script args...` (a jobs/*.sh, which runs `ray job submit`) against this cluster."""
        env = {**self.env, "RAY_ADDRESS": self.address}
        out = open(log or self.tmp / "submit.log", "w")
        proc = subprocess.Popen(["bash", script, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        if wait:
            proc.wait(timeout=900)
            out.close()
        return proc

    def job_statuses(self) -> list[str]:
        text = http_get(f"{self.address}/api/jobs/")
        return [j.get("status") for j in json.loads(text)] if text else []

    def __exit__(self, *exc):
        stop_nodes(self.procs, self.temp)
        for log in self.logs:
            log.close()
        return False


def _descendants(pid: int) -> list[int]:
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out

