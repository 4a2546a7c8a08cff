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


def submit_job_to_fresh_cluster(tmp_path: Path, job_args: list[str]) -> dict:
    """Start a head node on 127.0.0.1, `ray job submit` the main job with `job_args`, wait for it to end,
    watch the metrics port meanwhile, stop the cluster. Returns status, logs, a ray_dflash_ line."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "2000"}
    env.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="dfrjob", dir="/tmp")        # short: Ray puts unix sockets under it
    gcs, dash, metrics, client, agent, agent_grpc, rtenv, nm, om = free_ports(9)
    head_log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={rtenv}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
         "--num-cpus=4", '--resources={"target_slot": 1}', "--object-store-memory=300000000",
         f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    job_env = {**env, "RAY_ADDRESS": address}
    sid = f"dflash-tiny-{os.getpid()}"
    seen_metric, status, metric_names, train_runs = None, None, set(), None
    try:
        deadline = time.time() + 120
        while http_get(f"{address}/api/version") is None:
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            assert time.time() < deadline, "the head node's dashboard did not come up"
            time.sleep(1)
        for attempt in range(10):
            submit = subprocess.run(
                [RAY, "job", "submit", "--address", address, "--no-wait", "--submission-id", sid,
                 "--runtime-env", "jobs/runtime_env.yaml", "--",
                 sys.executable, "-m", "dflash_ray.train", *job_args],
                cwd=REPO, env=job_env, capture_output=True, text=True, timeout=120)
            # the dashboard can answer before its job agent is up (a loaded machine): Ray says to retry
            if submit.returncode == 0 or "No available agent to submit job" not in submit.stderr:
                break
            time.sleep(3)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        deadline, finished_at = time.time() + 420, None
        while time.time() < deadline:
            info = http_get(f"{address}/api/jobs/{sid}")       # what `ray job status` reads
            status = json.loads(info).get("status") if info else None
            if seen_metric is None or status not in ("SUCCEEDED", "FAILED", "STOPPED"):  # every name, while it runs
                text = http_get(f"http://127.0.0.1:{metrics}/metrics") or ""
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
        return {"status": status, "logs": logs, "metric": seen_metric, "metrics_port": metrics,
                "submission_id": sid, "metric_names": metric_names, "train_runs": train_runs}
    finally:
        head.send_signal(signal.SIGINT)                     # `ray start --block` stops its processes
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        time.sleep(1)
        for pid in own_processes(temp):                     # whatever outlived it, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        head_log.close()


def wait_for(pred, timeout, what, every: float = 0.1):
    """pred()'s first truthy value, polled every `every` seconds; TimeoutError naming `what` after `timeout`."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")
