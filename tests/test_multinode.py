"""Two raylets on this machine (a head and a worker node), `jobs/multinode.sh` submitted to them: trainer
workers and target actors spread over both nodes, features trained on the node that computed them, the
ledger exact and the weights those of the single-node run of the same plan (conftest.job_run); then the
worker node dies mid-run and the run finishes on the head, exactly once.

Both jobs run on one cluster (`two_nodes`, started once for the module: a cluster's start-up saved), the
node-loss job last since it kills the worker node. The head can host the whole run (2 trainers, 2 target
actors) after the loss; before it, the runtime spreads a stream per node by itself."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from helpers_cluster import RUNTIME_RUN
from helpers_multinode import Cluster

from dflash_ray.runtime.training.checkpoint_format import load_weights

from dflash_ray.runtime.checkpoints import RunCheckpoints
from dflash_ray.runtime.record.ledger import read_jsonl
from dflash_ray.runtime.training.faults import TEST_FAULTS_ENV

# The node-loss job's pause (the test-only fault hook, first attempt only): inside the step-9 checkpoint,
# at train.checkpoint_every=3 (checkpoints 3, 5 = epoch 0's end, 6, 9, 10). The features job runs
# RUNTIME_RUN (checkpoints 4, 5, 8, 10): it never checkpoints step 9, so the hook, in every process of
# the shared cluster, never fires in it.
PAUSE_STEP, LOSS_EVERY = 9, 3
PAUSE = {"checkpoint_pause": {"step": PAUSE_STEP, "seconds": 300, "where": "write", "attempts": [1]}}
# The GCS declares a node dead after RAY_health_check_failure_threshold failed checks, one every
# RAY_health_check_period_ms (Ray's default 3000 ms: ~15 s after the kill); a killed raylet refuses the
# check at once, so 1 s a check finds it in ~5 s. A live but loaded raylet still has Ray's default
# timeout a check (10 s) times 5 to answer.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}

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


def _succeeded_one_more(cluster: Cluster, before: list[str]) -> bool:
    """The cluster's jobs: one more than `before`, and one more of them SUCCEEDED."""
    now = cluster.job_statuses()
    return len(now) == len(before) + 1 and now.count("SUCCEEDED") == before.count("SUCCEEDED") + 1


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head (4 CPUs, 2 target slots: room for the whole run) and a worker node (2 CPUs, 1 target slot)."""
    with Cluster(tmp_path_factory.mktemp("two_nodes"), head={"cpus": 4, "resources": {"target_slot": 2}},
                 workers=[{"cpus": 2, "resources": {"target_slot": 1}}],
                 env={TEST_FAULTS_ENV: json.dumps(PAUSE), **FAST_NODE_DEATH}) as cluster:
        yield cluster


@pytest.mark.slow
def test_two_nodes_keep_features_on_their_node_and_match_one_node(tiny_data, job_run, tmp_path, two_nodes):
    cluster = two_nodes
    nodes = {n["node_id"] for n in cluster.alive_nodes()}
    assert len(nodes) == 2, "the module's cluster lost its worker node (the node-loss test runs last)"
    log = tmp_path / "job.log"
    before = cluster.job_statuses()
    cluster.submit("jobs/multinode.sh", _run_args(tmp_path, "two", tiny_data), log=log)
    assert _succeeded_one_more(cluster, before), log.read_text()[-4000:]
    s = _summary(tmp_path, "two", log)
    events = read_jsonl(tmp_path / "two" / "events.jsonl")
    assert not [e for e in events if e.get("event") in ("test_fault", "trainer_group_restarted")]   # no fault
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
def test_losing_a_node_mid_run_finishes_on_the_rest_exactly_once(tiny_data, job_run, tmp_path, two_nodes):
    """Rank 0 pauses inside the step-9 checkpoint (the test-only fault hook: a window to kill in, on the
    first attempt only); the worker node dies there. The group restarts from the latest complete checkpoint
    (step 5 or 6) on the head, which can host the whole run (2 trainers, 2 target actors)."""
    cluster = two_nodes
    assert len(cluster.alive_nodes()) == 2
    log = tmp_path / "job.log"
    before = cluster.job_statuses()
    job = cluster.submit("jobs/multinode.sh", [*_run_args(tmp_path, "loss", tiny_data),
                                               f"train.checkpoint_every={LOSS_EVERY}"], wait=False, log=log)
    events = tmp_path / "loss" / "events.jsonl"
    deadline = time.time() + 400
    while not [e for e in read_jsonl(events) if e.get("event") == "test_fault"]:
        assert job.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    # Ray Train registers a checkpoint when its controller next polls the workers' reports: steps 5-9
    # can pass in a second (several batches a stream block), so wait until step 5 or 6 is registered
    while RunCheckpoints(str(tmp_path / "shared_storage" / "loss")).latest()[0].step < 5:
        assert job.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    cluster.kill_worker(0)
    job.wait(timeout=600)
    assert _succeeded_one_more(cluster, before), log.read_text()[-4000:]
    assert len(cluster.alive_nodes()) == 1           # the GCS saw the worker node die
    s = _summary(tmp_path, "loss", log)
    restarts = [e for e in read_jsonl(events) if e.get("event") == "trainer_group_restarted"]
    # back to the latest checkpoint registered before the kill: step 5 (the end of epoch 0) or step 6 (every
    # 3 steps), whichever Ray Train had registered; never the unfinished step-9 one
    assert len(restarts) == 1 and restarts[0]["resume_step"] in (5, 6)
    assert s["ledger"]["ok"] is True                     # every batch exactly once, steps in order
    ref = job_run["summary"]
    assert s["steps"] == ref["steps"] and s["tokens"] == ref["tokens"]
    _same_weights(Path(s["checkpoint"]), Path(ref["checkpoint"]))
    streams = [e["placement"] for e in read_jsonl(events) if e.get("event") == "streams"]
    assert [len(p) for p in streams] == [2, 1]           # a stream per node; after the loss one, on the head
