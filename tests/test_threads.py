"""Thread counts per process kind and how idle threads wait (dflash_ray/threads.py), and the priority of a
local Ray's workers (runtime/cluster.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from dflash_ray import threads
from dflash_ray.config import compose_config


def test_each_kind_reads_its_key_and_null_means_every_core():
    cfg = compose_config(["cluster.cpu_threads.trainer=3"]).cluster.cpu_threads
    assert threads.threads_for(cfg, "trainer") == 3
    assert [threads.threads_for(cfg, k) for k in ("regenerate", "target", "evaluate")] == [1, 1, 1]
    assert threads.threads_for(cfg, "driver") == threads.usable_cores()
    assert threads.threads_for(None, "target") == 1 and threads.threads_for({"target": 0}, "target") == 1
    with pytest.raises(ValueError, match="unknown process kind 'gpu'"):
        threads.threads_for(cfg, "gpu")


def waits_in_a_command(env_policy):
    """OMP_WAIT_POLICY as a command's torch would read it: set by the CLI's main before any import of torch."""
    import os

    code = ("import os, sys\n"
            "from dflash_ray.cli import main\n"
            "assert 'torch' not in sys.modules, 'the CLI imported torch before choosing how its threads wait'\n"
            "main(['--version'])\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_command_makes_idle_threads_sleep_unless_the_user_chose():
    assert waits_in_a_command(None) == "PASSIVE"
    assert waits_in_a_command("ACTIVE") == "ACTIVE"


@pytest.mark.slow     # a Ray of its own, started and stopped (~12 s)
def test_a_local_ray_runs_its_workers_at_the_drivers_priority(tmp_path):
    """Ray's default niceness 15 handed a shared machine's CPU to any other process (the drafter trained 4.4x
    slower beside one busy loop): a local Ray started by the job gives its workers niceness 0."""
    script = tmp_path / "nice.py"
    script.write_text(
        "import os, ray\n"
        "from omegaconf import OmegaConf\n"
        "from dflash_ray.config import compose_config\n"
        "from dflash_ray.runtime.cluster import ray_cluster\n"
        "with ray_cluster(OmegaConf.to_object(compose_config(['cluster.object_store_memory=100000000']).cluster),\n"
        "                 log=lambda *a: None):\n"
        "    task = ray.remote(num_cpus=1)(lambda: os.nice(0))\n"
        "    print(ray.get(task.remote()))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RAY_worker_niceness", "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0"
