"""Thread counts per process kind (dflash_ray/threads.py): the configured counts reach torch, and the driver's
count follows the cores other processes leave free (its own threads never count against it)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

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


def ticks(monkeypatch, machine, own):
    """Feed FreeCoreThreads (busy, total) machine ticks and its own ticks, one reading per call."""
    machine, own = iter(machine), iter(own)
    monkeypatch.setattr(threads, "_machine_ticks", lambda: next(machine))
    monkeypatch.setattr(threads, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)


def test_free_cores_are_the_machine_less_other_processes(monkeypatch):
    before = torch.get_num_threads()
    try:
        # window of 200 ticks on 2 cores: busy 110, 100 of them this process's -> others 0.1 core -> 2 threads
        ticks(monkeypatch, [(0, 0), (110, 200)], [0, 100])
        t = threads.FreeCoreThreads(cap=2, first_sample_s=0)
        assert t.counts == [2] and torch.get_num_threads() == 2
        # busy 190, 90 of them this process's -> others 1.0 core -> 1 thread
        ticks(monkeypatch, [(0, 0), (190, 200)], [0, 90])
        t = threads.FreeCoreThreads(cap=2, first_sample_s=0)
        assert t.counts == [1] and torch.get_num_threads() == 1
        # the cap wins over free cores; the next look happens only after every_s
        ticks(monkeypatch, [(0, 0), (0, 200), (200, 400)], [0, 0, 0])
        t = threads.FreeCoreThreads(cap=1, every_s=3600, first_sample_s=0)
        t()
        assert t.counts == [1]
    finally:
        torch.set_num_threads(before)


def test_beside_processes_that_take_every_core_the_driver_takes_one_thread():
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(threads.usable_cores())]
    before = torch.get_num_threads()
    try:
        time.sleep(0.5)
        t = threads.FreeCoreThreads(cap=threads.usable_cores(), first_sample_s=1.0)
        assert t.counts == [1] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        for p in busy:
            p.kill()
            p.wait()


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
