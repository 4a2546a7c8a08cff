"""Two raylets on this machine (a head and a worker node), `jobs/multinode.sh` submitted to them: trainer
workers and target actors spread over both nodes, features trained on the node that computed them, the
ledger exact and the weights those of the single-node run of the same plan (conftest.job_run); then the
worker node dies mid-run and the run finishes on the head, exactly once."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from helpers_cluster import RUNTIME_RUN
from helpers_multinode import Cluster

from dflash_ray.runtime.training.checkpoint import latest_checkpoint, load_weights
from dflash_ray.runtime.record.ledger import read_jsonl
from dflash_ray.runtime.training.faults import TEST_FAULTS_ENV

# CPU stand-ins for the multinode preset: 2 drafter workers (one per node) and 2 target actors (one per
# node, on the custom resource), a storage path both nodes reach (a local directory here).
JOB = ["model=tiny", "data=synthetic", "cluster.use_gpu=false", "cluster.num_cpus=null",
       "cluster.drafter_workers=2", "cluster.target_workers=2", "cluster.max_batches_in_flight=8"]


def _run_args(root: Path, name: str, tiny_data) -> list[str]:
    return [f"run.root={root}", f"run.name={name}", f"train.storage_path={root}/shared_storage",
            *JOB, *tiny_data, *RUNTIME_RUN]


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _summary(root: Path, name: str, log: Path) -> dict:
    path = root / name / "summary.json"
    assert path.exists(), log.read_text()[-4000:]
    return json.loads(path.read_text())


@pytest.mark.slow
def test_two_nodes_keep_features_on_their_node_and_match_one_node(tiny_data, job_run, tmp_path):
    with Cluster(tmp_path, head={"cpus": 3, "resources": {"target_slot": 1}},
                 workers=[{"cpus": 3, "resources": {"target_slot": 1}}]) as cluster:
        nodes = {n["node_id"] for n in cluster.alive_nodes()}
        assert len(nodes) == 2
        log = tmp_path / "job.log"
        cluster.submit("jobs/multinode.sh", _run_args(tmp_path, "two", tiny_data), log=log)
        assert cluster.job_statuses() == ["SUCCEEDED"], log.read_text()[-4000:]
    s = _summary(tmp_path, "two", log)
    # one stream per node: its trainer rank and its target actor on that node
    assert sorted(len(g["ranks"]) for g in s["placement"]) == [1, 1]
    assert {g["node"] for g in s["placement"]} == nodes
    assert all(g["target_actors"] == 1 for g in s["placement"])
    assert {t["node"] for t in s["target_actors"].values()} == nodes
    # every batch's features were trained where they were computed
    traffic = s["feature_traffic"]
    assert traffic["rows"] >= s["ledger"]["batches"] > 0 and traffic["bytes"] > 0
    assert traffic["cross_node_rows"] == 0 and traffic["cross_node_bytes"] == 0
    assert s["ledger"]["ok"] is True
    ref = job_run["summary"]
    assert s["steps"] == ref["steps"] and s["tokens"] == ref["tokens"]
    _same_weights(Path(s["checkpoint"]), Path(ref["checkpoint"]))


@pytest.mark.slow
def test_losing_a_node_mid_run_finishes_on_the_rest_exactly_once(tiny_data, job_run, tmp_path):
    """Rank 0 pauses inside the step-8 checkpoint (the test-only fault hook: a window to kill in, on the
    first attempt only); the worker node dies there. The group restarts from the latest complete checkpoint
    (step 4 or 5) on the head, which can host the whole run (2 trainers, 2 target actors)."""
    pause = {"checkpoint_pause": {"step": 8, "seconds": 300, "where": "write", "attempts": [1]}}
    with Cluster(tmp_path, head={"cpus": 4, "resources": {"target_slot": 2}},
                 workers=[{"cpus": 2, "resources": {"target_slot": 1}}],
                 env={TEST_FAULTS_ENV: json.dumps(pause)}) as cluster:
        log = tmp_path / "job.log"
        job = cluster.submit("jobs/multinode.sh", _run_args(tmp_path, "loss", tiny_data), wait=False, log=log)
        events = tmp_path / "loss" / "events.jsonl"
        deadline = time.time() + 400
        while not [e for e in read_jsonl(events) if e.get("event") == "test_fault"]:
            assert job.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        # Ray Train registers a checkpoint when its controller next polls the workers' reports: steps 4-8
        # can pass in a second (several batches a stream block), so wait until step 4 or 5 is registered
        while latest_checkpoint(str(tmp_path / "shared_storage" / "loss"))[0].step < 4:
            assert job.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        cluster.kill_worker(0)
        job.wait(timeout=600)
        assert cluster.job_statuses() == ["SUCCEEDED"], log.read_text()[-4000:]
        assert len(cluster.alive_nodes()) == 1           # the GCS saw the worker node die
    s = _summary(tmp_path, "loss", log)
    restarts = [e for e in read_jsonl(events) if e.get("event") == "trainer_group_restarted"]
    # back to the latest checkpoint registered before the kill: step 4 (every 4 steps) or step 5 (the end of
    # epoch 0), whichever Ray Train had registered; never the unfinished step-8 one
    assert len(restarts) == 1 and restarts[0]["resume_step"] in (4, 5)
    assert s["ledger"]["ok"] is True                     # every batch exactly once, steps in order
    ref = job_run["summary"]
    assert s["steps"] == ref["steps"] and s["tokens"] == ref["tokens"]
    _same_weights(Path(s["checkpoint"]), Path(ref["checkpoint"]))
    streams = [e["placement"] for e in read_jsonl(events) if e.get("event") == "streams"]
    assert [len(p) for p in streams] == [2, 1]           # a stream per node; after the loss one, on the head
