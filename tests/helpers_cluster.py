"""Cluster helpers for the runtime tests: the main job run in a thread against the session's Ray
(`TrainRun`), and a fresh `ray start --head` cluster on 127.0.0.1 that a job is submitted to."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

# The run every runtime test compares against: two epochs straight through, submitted as a user would
# (`ray job submit` to a `ray start --head` cluster on 127.0.0.1), W = 2 batches per step.
RUNTIME_RUN = ["train.epochs=2", "train.checkpoint_every=4", "train.max_failures=3"]



class TrainRun:
    """Runs the main job (driver side, in a thread) against the session's Ray; `during(spec)` runs in
    the test's thread meanwhile (e.g. to kill a worker)."""

    def __init__(self, root: Path, data_overrides: list[str]):
        self.root, self.data = root, data_overrides

    def config(self, name: str, overrides=()):
        from dflash_ray.config import compose_config

        return compose_config([f"run.root={self.root}", f"run.name={name}", *self.data, *overrides])

    def __call__(self, name: str, overrides=(), during=None, timeout: float = 400):
        import threading

        from dflash_ray.train import main_job

        cfg = self.config(name, overrides)
        out = {}

        def work():
            try:
                out["spec"], out["summary"] = main_job(cfg, progress=False, log=lambda *a, **k: None,
                                                       plan_log=lambda *a, **k: None)
            except BaseException as e:  # surfaced in the test's thread
                out["error"] = e

        t = threading.Thread(target=work, daemon=True)
        t.start()
        if during is not None:
            during(name)
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"run {name} did not finish in {timeout}s")
        if "error" in out:
            raise out["error"]
        return out["spec"], out["summary"]


# a fresh cluster for `ray job submit`
REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http_get(url, timeout=5.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


def own_processes(marker: str):
    """PIDs of processes whose command line names this test's temp dir (the cluster it started)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def worker_ports(node: int = 0) -> list[str]:
    """Worker ports for node `node` of a cluster a test starts, apart from the session Rays' (Ray's default
    10002-19999, on every xdist worker) and from each other: Ray 2.59's fresh head once handed its dashboard
    agent a port another Ray on the machine held, and the agent's death took the raylet down with it. A block
    of 2000 per xdist worker (its clusters run one at a time), 400 per node, below the kernel's ephemeral
    ports (32768 on)."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    assert 0 <= node < 5, node
    low = 20000 + 2000 * (n % 6) + 400 * node
    return [f"--min-worker-port={low}", f"--max-worker-port={low + 399}"]


class HeadArgs(NamedTuple):
    args: list[str]
    gcs: int
    dashboard: int
    metrics: int


def head_args(temp: str) -> HeadArgs:
    """The flags of every `ray start --head` the tests make: a head on 127.0.0.1 whose every port is its own
    (free ports, worker_ports of node 0), its dashboard on, Ray's files under `temp`; and the GCS, dashboard
    and metrics ports they name. The caller adds what differs (--block, resources, the object store)."""
    gcs, dash, metrics, client, agent, agent_grpc, rtenv, nm, om = free_ports(9)
    args = ["--head", f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}", f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={rtenv}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
            f"--temp-dir={temp}", *worker_ports(0)]
    return HeadArgs(args, gcs, dash, metrics)


# what every `ray start --block` node the tests start runs with: stopped by SIGTERM, a node drains for up to
# 30 s first (room for Ray Serve's proxies; these nodes serve nothing), and SIGINT left `ray start` waiting
# for its processes for a minute (measured: 61 s a stop, 3 s with this)
NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def stop_nodes(procs: list, temp: str) -> None:
    """Stop `ray start --block` processes (the last started first), then whatever of theirs outlived them, by
    the temp dir their command lines name."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)                     # `ray start --block` stops its node's processes
    for p in reversed(procs):
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    time.sleep(1)
    for pid in own_processes(temp):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class FreshHead:
    """`ray start --head --block` on 127.0.0.1 with ports of its own, in a temp dir of its own. `start`: the
    command that runs `ray start` (scripts/ray-start.sh, as users start a head)."""

    def __init__(self, log_path: Path, env: dict, start=(RAY, "start")):
        self.temp = tempfile.mkdtemp(prefix="dfrjob", dir="/tmp")   # short: Ray puts unix sockets under it
        head = head_args(self.temp)
        self.metrics = head.metrics
        self.log_path, self.log = log_path, open(log_path, "w")
        self.address = f"http://127.0.0.1:{head.dashboard}"
        self.proc = subprocess.Popen(
            [*start, "--block", "--node-ip-address=127.0.0.1", *head.args,
             "--num-cpus=4", '--resources={"target_slot": 1}', "--object-store-memory=300000000",
             "--disable-usage-stats"],
            cwd=REPO, env={**env, **NODE_ENV}, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def died(self) -> bool:
        """`ray start --block` exits when one of its processes dies (the raylet goes with a failed agent)."""
        return self.proc.poll() is not None

    def log_tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-3000:]

    def stop(self):
        stop_nodes([self.proc], self.temp)
        self.log.close()


def submit_job_to_fresh_cluster(tmp_path: Path, job_args: list[str]) -> dict:
    """Start a head node on 127.0.0.1, `ray job submit` the main job with `job_args`, wait for it to end,
    watch the metrics port meanwhile, stop the cluster. Returns status, logs, a ray_dflash_ line.

    A head whose own start-up died before it took the job (Ray 2.59 on this loaded machine: the raylet
    stopped waiting for a dashboard agent that took 20 s to start) is stopped and a new one started, at most
    twice, each said on stderr; a job the cluster took is never resubmitted."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "2000"}
    env.pop("RAY_ADDRESS", None)
    sid = f"dflash-tiny-{os.getpid()}"
    for attempt in range(3):
        head = FreshHead(tmp_path / f"head{attempt}.log", env)
        try:
            submit = submit_to(head, env, sid, job_args)
            if submit is None:
                print(f"fresh head {attempt} died at start-up, starting another:\n{head.log_tail()}",
                      file=sys.stderr)
                continue
            assert submit.returncode == 0, submit.stdout + submit.stderr
            return watch_job(head, {**env, "RAY_ADDRESS": head.address}, sid)
        finally:
            head.stop()
    raise AssertionError("three fresh heads died at start-up; the last one's log is above")


def submit_to(head: FreshHead, env: dict, sid: str, job_args: list[str]):
    """`ray job submit` once the head's dashboard answers; None when the head died before it took the job."""
    deadline = time.time() + 120
    while http_get(f"{head.address}/api/version") is None:
        if head.died():
            return None
        assert time.time() < deadline, "the head node's dashboard did not come up"
        time.sleep(1)
    for _ in range(10):
        submit = subprocess.run(
            [RAY, "job", "submit", "--address", head.address, "--no-wait", "--submission-id", sid,
             "--runtime-env", "jobs/runtime_env.yaml", "--",
             sys.executable, "-m", "dflash_ray.train", *job_args],
            cwd=REPO, env={**env, "RAY_ADDRESS": head.address}, capture_output=True, text=True, timeout=120)
        if submit.returncode == 0:
            return submit
        time.sleep(2)      # `ray start --block` takes up to a second to see a dead process
        if head.died():
            return None
        # the dashboard can answer before its job agent is up (a loaded machine): Ray says to retry
        if "No available agent to submit job" not in submit.stderr:
            return submit
        time.sleep(1)
    return submit


def watch_job(head: FreshHead, job_env: dict, sid: str) -> dict:
    """Wait for the submitted job to end, collecting the ray_dflash_ metric names the head's port serves."""
    address, seen_metric, status, metric_names = head.address, None, None, set()
    deadline, finished_at = time.time() + 420, None
    while time.time() < deadline:
        info = http_get(f"{address}/api/jobs/{sid}")       # what `ray job status` reads
        status = json.loads(info).get("status") if info else None
        if seen_metric is None or status not in ("SUCCEEDED", "FAILED", "STOPPED"):  # every name, while it runs
            text = http_get(f"http://127.0.0.1:{head.metrics}/metrics") or ""
            found = [line for line in text.splitlines() if line.startswith("ray_dflash_")]
            metric_names |= {line.split("{")[0].split(" ")[0] for line in found}
            seen_metric = seen_metric or (found[0] if found else None)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            finished_at = finished_at or time.time()
            if seen_metric or status != "SUCCEEDED" or time.time() - finished_at > 20:
                break
        time.sleep(1)
    logs = subprocess.run([RAY, "job", "logs", "--address", address, sid], env=job_env,
                          capture_output=True, text=True, timeout=60).stdout
    train_runs = http_get(f"{address}/api/train/v2/runs/v1", timeout=30)   # what the Train view shows
    return {"status": status, "logs": logs, "metric": seen_metric, "metrics_port": head.metrics,
            "submission_id": sid, "metric_names": metric_names, "train_runs": train_runs}


def wait_for(pred, timeout, what, every: float = 0.1):
    """pred()'s first truthy value, polled every `every` seconds; TimeoutError naming `what` after `timeout`."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")
