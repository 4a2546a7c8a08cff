"""The run's record (runtime/record/): the ledger (verified, rolled back, torn lines), RunRecord's commits
of steps into the ledger, metrics.jsonl and TensorBoard, and held-out evaluations (a failed one, the final
tau's wait for the target's resources)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from dflash_ray.runtime.record.ledger import read_jsonl, rewrite_jsonl, rollback, verify_ledger


def test_ledger_verify_rollback_and_torn_lines(tmp_path):
    sizes = {0: 5, 1: 5}
    recs = [{"epoch": 0, "step": 1, "positions": [0, 1]}, {"epoch": 0, "step": 2, "positions": [2, 3]},
            {"epoch": 0, "step": 3, "positions": [4, -1]}, {"epoch": 1, "step": 4, "positions": [0, 1]}]
    ok = verify_ledger(recs, sizes, finished_epochs=[0])
    assert ok["ok"] and ok["batches"] == 7
    dup = verify_ledger(recs + [{"epoch": 1, "step": 5, "positions": [1, 2]}], sizes, finished_epochs=[0])
    assert not dup["ok"] and dup["duplicates"] == [(1, 1)]
    miss = verify_ledger(recs[:2] + recs[3:], sizes, finished_epochs=[0])
    assert not miss["ok"] and miss["missing"] == {0: [4]}
    swapped = verify_ledger([recs[1], recs[0]] + recs[2:], sizes, finished_epochs=[0])
    assert not swapped["ok"] and not swapped["steps_in_order"] and not swapped["missing"]
    gap = verify_ledger(recs[:1] + recs[2:], sizes, finished_epochs=[])   # step 2 lost, epoch 0 unfinished
    assert not gap["ok"] and not gap["steps_in_order"]
    unfinished = verify_ledger(recs[:2], sizes, finished_epochs=[])      # a run stopped mid-epoch
    assert unfinished["ok"] and unfinished["missing"] == {}

    path = tmp_path / "ledger.jsonl"
    rewrite_jsonl(path, recs)
    with open(path, "a") as f:
        f.write('{"epoch": 1, "step": 5, "posi')                  # a writer killed mid-line
    assert len(read_jsonl(path)) == 4
    assert rollback(path, 2) == 2
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert path.read_text().endswith("\n")


def test_the_record_writes_several_steps_in_one_call(ray_session, tmp_path):
    from dflash_ray.runtime.record.record import RunRecord

    c = RunRecord(str(tmp_path), "blocks")
    c.begin_attempt(0, 2)
    commits = [({"epoch": 0, "step": k, "positions": [2 * k - 2, 2 * k - 1], "buckets": [0, 0], "tokens": [5, 5]},
                {"step": k, "epoch": 0, "loss": 1.0, "tokens": 10, "block_tokens": 48, "time": 1000.0 + k})
               for k in (1, 2)]
    c.commit_steps(c.gen, commits)
    assert [r["step"] for r in read_jsonl(tmp_path / "ledger.jsonl")] == [1, 2]
    assert [m["time"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1001.0, 1002.0]   # when they ended
    assert [m["tokens_per_second"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [0.0, 10.0]   # 10 tokens in 1 s
    assert [m["block_tokens_per_second"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [0.0, 48.0]


def test_the_record_writes_ledger_metrics_and_tensorboard(ray_session, tmp_path):
    from dflash_ray.runtime.record.record import RunRecord, last_metrics

    c = RunRecord(str(tmp_path), "tb", trackers=["tensorboard"])
    assert c.new_stream(10) == 1                  # the record numbers the streams
    assert c.begin_attempt(0, 2) == {"attempt": 1, "restarted": False, "rolled_back": 0}

    def commit(gen, step, loss):
        c.commit_steps(gen, [({"epoch": 0, "step": step, "positions": [2 * step - 2, 2 * step - 1],
                               "buckets": [0, 2], "tokens": [10, 20]},
                              {"step": step, "epoch": 0, "loss": loss, "tokens": 30, "lr": 1e-3, "grad_norm": 1.0})])

    commit(1, 1, 3.0)
    commit(1, 2, 1.5)
    # a restart from the step-1 checkpoint: the old stream ends before the coordinator hands out the new
    # generation, so the replaced group's late commits are dropped from that moment on, not appended
    c.end_stream()
    commit(1, 3, 9.9)
    assert c.new_stream(10) == 2
    assert c.begin_attempt(1, 2) == {"attempt": 2, "restarted": True, "rolled_back": 1}
    commit(2, 2, 1.4)
    commit(1, 3, 9.8)
    c.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "ledger.jsonl")] == [1, 2]
    assert [m["loss"] for m in last_metrics(tmp_path)] == [3.0, 1.4]     # the replayed step's last record
    report = asyncio.run(c.report())
    assert report["trainer_restarts"] == 1 and report["rolled_back_steps"] == 1
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])["event"] == "trainer_group_restarted"


def test_a_failed_heldout_evaluation_is_an_event_not_a_failed_run(ray_session, tmp_path):
    import ray

    from dflash_ray.runtime.record.record import RunRecord

    coord = ray.remote(RunRecord).options(num_cpus=0, max_concurrency=100).remote(str(tmp_path), "ev")
    broken = SimpleNamespace(target_path=str(tmp_path / "no-target"))         # the task raises
    ray.get(coord.evaluate_heldout.remote(broken, 10, [ray.put({})]), timeout=120)
    report = ray.get(coord.report.remote(), timeout=60)
    assert report["evals"] == []
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "heldout_eval_failed" and events[-1]["step"] == 10
    assert not (tmp_path / "best").exists()
    ray.kill(coord)


def test_the_final_tau_waits_for_the_target_resources_a_bounded_time(ray_session):
    """final_tau runs on the target actors' resources once they are free; a resource that never frees (or
    that the cluster lacks) ends the wait after its bound, and the tau is measured in the driver instead."""
    import time

    from dflash_ray.runtime.record.heldout import resource_free_within

    assert resource_free_within("CPU", 0.5, wait_s=5)
    t0 = time.monotonic()
    assert not resource_free_within("no_such_resource", 1, wait_s=1.5, poll_s=0.2)
    assert 1.5 <= time.monotonic() - t0 < 10
