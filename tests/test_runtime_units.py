"""The runtime's pure parts, without Ray Train: the feed layout, cursors, the ledger, the LR schedule,
checkpoint completeness, the capacity model, the token store, and the coordinator's flight window."""
from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from dflash_ray.config import compose_config
from dflash_ray.data.plan import PlanSpec, build_plan
from dflash_ray.errors import UserError
from dflash_ray.sizing.capacity import best_split, capacity_report
from dflash_ray.runtime.stream.feed import FILLER, Cursor, build_feed, cursor_after, rank_rows
from dflash_ray.runtime.record.ledger import read_jsonl, rewrite_jsonl, rollback, verify_ledger
from dflash_ray.runtime.training.model import lr_lambda


def _plans(num_samples=300, seed=0):
    rng = np.random.default_rng(0)
    lengths = rng.integers(40, 500, size=num_samples)
    plan_spec = PlanSpec(boundaries=[96, 192, 512], max_tokens_per_batch=1024, min_tokens=16)
    cache = {}

    def plan_for(e):
        if e not in cache:
            cache[e] = build_plan(np.arange(num_samples), lengths, plan_spec, seed=seed, epoch=e)
        return cache[e]

    return plan_for


@pytest.mark.parametrize("per_step", [1, 2, 3, 4])
def test_feed_covers_each_epoch_once_in_plan_order(per_step):
    plan_for = _plans()
    feed = build_feed(plan_for, Cursor(), per_step, epochs=2, max_steps=None)
    t = feed.table.to_pydict()
    assert feed.num_rows == feed.steps * per_step and t["index"] == list(range(feed.num_rows))
    for e in (0, 1):
        n = plan_for(e).num_batches
        pos = [p for p, ep in zip(t["position"], t["epoch"]) if ep == e]
        real = [p for p in pos if p != FILLER]
        assert real == list(range(n))                       # plan order, every batch once
        assert len(pos) % per_step == 0                        # a step never spans two epochs
        assert all(p == FILLER for p in pos[n:])            # fillers only at the epoch's tail
        assert feed.epoch_steps[e] == math.ceil(n / per_step)
    # rows carry the plan's batches
    k = t["position"].index(5)
    assert t["sample_ids"][k] == plan_for(0).batch(5).tolist()
    assert feed.schedule_steps == feed.total_steps == feed.steps


def test_feed_resumes_at_cursor_and_stops_at_max_steps():
    plan_for = _plans()
    n0 = plan_for(0).num_batches
    full = build_feed(plan_for, Cursor(), 2, epochs=2, max_steps=None)
    part = build_feed(plan_for, Cursor(), 2, epochs=2, max_steps=5)
    assert part.steps == 5 and part.total_steps == 5 and part.schedule_steps == full.steps
    rest = build_feed(plan_for, Cursor(0, 10, 5), 2, epochs=2, max_steps=None)
    assert rest.table.column("position").to_pylist()[:3] == [10, 11, 12]
    assert rest.total_steps == full.total_steps == rest.schedule_steps
    # a different W from the same global position: same batches, different step boundaries
    rest3 = build_feed(plan_for, Cursor(0, 10, 5), 3, epochs=2, max_steps=None)
    real = lambda f: [(e, p) for e, p in zip(f.table.column("epoch").to_pylist(),  # noqa: E731
                                             f.table.column("position").to_pylist()) if p != FILLER]
    assert real(rest3) == real(rest) and real(rest)[0] == (0, 10) and len(real(rest)) == 2 * n0 - 10 + (
        plan_for(1).num_batches - n0)
    assert build_feed(plan_for, Cursor(2, 0, 99), 2, epochs=2, max_steps=None).steps == 0


def test_feed_resumed_mid_epoch_stops_at_max_steps_across_the_epoch_end():
    """A resume at (epoch 0, position p, step k) with max_steps = m trains steps k+1..m: the rest of
    epoch 0 (ceil((n0 - p) / W) steps, the last padded with fillers), then epoch 1 from position 0."""
    plan_for = _plans()
    n0, per_step, p, k = plan_for(0).num_batches, 2, 11, 4
    left_in_epoch0 = -(-(n0 - p) // per_step)
    m = k + left_in_epoch0 + 3                              # 3 steps into epoch 1
    feed = build_feed(plan_for, Cursor(0, p, k), per_step, epochs=2, max_steps=m)
    t = feed.table.to_pydict()
    assert feed.steps == m - k and feed.total_steps == m and feed.num_rows == (m - k) * per_step
    assert feed.epoch_steps == {0: left_in_epoch0, 1: 3}
    epoch0 = [q for q, e in zip(t["position"], t["epoch"]) if e == 0]
    assert [q for q in epoch0 if q != FILLER] == list(range(p, n0))
    assert len(epoch0) - (n0 - p) == (-(n0 - p)) % per_step     # fillers pad the epoch's last step only
    assert [q for q, e in zip(t["position"], t["epoch"]) if e == 1] == list(range(3 * per_step))
    # the LR schedule still spans every planned step of both epochs at this W
    assert feed.schedule_steps == k + left_in_epoch0 + -(-plan_for(1).num_batches // per_step)


def test_rank_rows_and_cursor_after():
    assert rank_rows(0, 4, 2, 0) == [0, 2] and rank_rows(0, 4, 2, 1) == [1, 3]
    assert rank_rows(3, 2, 2, 1) == [7]
    assert sorted(r for rank in range(3) for r in rank_rows(5, 6, 3, rank)) == list(range(30, 36))
    assert cursor_after(0, [4, 5], 11, 3) == Cursor(0, 6, 3)
    assert cursor_after(0, [10, FILLER], 11, 6) == Cursor(1, 0, 6)
    assert cursor_after(1, [9, 10], 11, 12) == Cursor(2, 0, 12)


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


def test_lr_schedule_warmup_then_cosine_to_zero():
    f = lr_lambda(100, 0.04)
    assert [round(f(s), 3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert f(52) == pytest.approx(0.5, abs=0.02) and f(100) == pytest.approx(0.0, abs=1e-9)
    assert all(f(s) >= f(s + 1) for s in range(4, 100))


def test_checkpoint_manifest_detects_incomplete(tmp_path):
    import torch

    from dflash_ray.runtime.training.checkpoint_format import (IncompleteCheckpoint, load_checkpoint, read_state,
                                                              write_checkpoint, write_rank_files)

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.1))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    d = tmp_path / "ckpt"
    write_checkpoint(d, drafter=model, optimizer=opt, scheduler=sched, cursor=Cursor(0, 6, 3), world_size=2)
    with pytest.raises(IncompleteCheckpoint, match="rng_rank1"):
        read_state(d)
    write_rank_files(d, 1)
    assert read_state(d)["cursor"] == {"epoch": 0, "position": 6, "step": 3}
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda(10, 0.1))
    assert load_checkpoint(d, drafter=model2, optimizer=opt2, scheduler=sched2, rank=1) == Cursor(0, 6, 3)
    assert torch.equal(model2.weight, model.weight) and sched2.last_epoch == 1
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    (d / "optim.pt").write_bytes((d / "optim.pt").read_bytes()[:10])  # truncated upload
    with pytest.raises(IncompleteCheckpoint, match="optim.pt"):
        read_state(d)


@pytest.mark.parametrize("uri", [False, True], ids=["path", "file-uri"])
def test_checkpoint_lookup_reads_ray_trains_record_on_anyfilesystem(tmp_path, uri):
    """One reader (pyarrow's filesystem layer) for the cursor, the latest checkpoint and its files, so
    a URI storage path (s3://, gs://; file:// here) goes the same way as a local one."""
    from dflash_ray.runtime.training.checkpoint_format import cursor_metrics
    from dflash_ray.runtime.registered import latest_checkpoint, local_checkpoint
    from helpers_ray_train import register_with_ray_train

    where = f"file://{tmp_path}" if uri else str(tmp_path)
    assert latest_checkpoint(where) == (Cursor(), None)
    (tmp_path / "checkpoint_x").mkdir()
    (tmp_path / "checkpoint_x" / "state.json").write_text("{}")
    register_with_ray_train(tmp_path, "checkpoint_w", cursor_metrics(Cursor(0, 2, 4)))
    register_with_ray_train(tmp_path, "checkpoint_x", {**cursor_metrics(Cursor(1, 4, 8)), "loss": 1.0})
    assert latest_checkpoint(where) == (Cursor(1, 4, 8), f"{where}/checkpoint_x")
    with local_checkpoint(latest_checkpoint(where)[1]) as d:
        assert (d / "state.json").read_text() == "{}"
        assert (d == tmp_path / "checkpoint_x") != uri          # a URI is copied to a local temp dir


def test_a_record_of_checkpoints_ray_train_cannot_read_is_one_line(tmp_path):
    """Ray Train refuses a record of another format (another Ray version's) or a damaged one: the driver says
    so in one line (a UserError: exit 2) naming the run's directory, instead of Ray's traceback."""
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.registered import latest_checkpoint
    from dflash_ray.runtime.training.checkpoint_format import cursor_metrics
    from helpers_ray_train import register_with_ray_train

    register_with_ray_train(tmp_path, "checkpoint_x", cursor_metrics(Cursor(0, 2, 4)))
    assert latest_checkpoint(str(tmp_path))[0] == Cursor(0, 2, 4)
    (record,) = tmp_path.glob("*.json")     # Ray's own file (its name and format are Ray's, read here only)
    other = json.loads(record.read_text())
    other["ray_version"] = "9.0.0"          # a later Ray whose record lost a field this one needs
    del other["current_report_index"]
    record.write_text(json.dumps(other))
    with pytest.raises(UserError) as e:
        latest_checkpoint(str(tmp_path))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{tmp_path}: Ray Train cannot read this run's record")
    assert "Ray version 9.0.0" in line and line.endswith("resume under the Ray version that wrote it, or train under a new run.name")
    record.write_text("{not json")
    with pytest.raises(UserError, match="Ray Train cannot read this run's record"):
        latest_checkpoint(str(tmp_path))


def test_checkpoint_due_every_n_steps_at_epoch_ends_and_the_last_step():
    from dflash_ray.runtime.training.checkpoint import checkpoint_due

    due = [s for s in range(1, 15) if checkpoint_due(s, 4, last_step=s == 14, end_of_epoch=s in (6, 12))]
    assert due == [4, 6, 8, 12, 14]


def test_capacity_model_balances_the_pipeline():
    r = best_split(8, target_rate=4000.0, drafter_rate=12000.0)
    assert (r["best"]["target"], r["best"]["drafter"]) == (6, 2)
    assert r["best"]["tokens_per_second"] == 24000.0
    r = best_split(8, target_rate=12000.0, drafter_rate=4000.0)
    assert (r["best"]["target"], r["best"]["drafter"]) == (2, 6)
    assert all(s["tokens_per_second"] <= r["best"]["tokens_per_second"] for s in r["splits"])
    # each side in its unit: target 5,000 context tokens/s, drafter 10,000 block tokens/s per GPU; at 4 block
    # tokens per context token a drafter GPU keeps up with 2,500 context tokens/s. By hand, 8 GPUs:
    #   configured 6 + 2: min(6 x 5000, 2 x 2500) = 5,000;  best split 3 + 5: min(15000, 12500) = 12,500
    #   (2 + 6: min(10000, 15000) = 10,000);  colocated: 8 / (1/5000 + 1/2500) = 13,333 -> the best layout
    cluster = _Node(name="8gpu", use_gpu=True, target_workers=6, drafter_workers=2, target_gpus=1.0, drafter_gpus=1.0,
                    target_tokens_per_gpu=5000.0, drafter_block_tokens_per_gpu=10000.0)
    cfg = SimpleNamespace(cluster=cluster, run=SimpleNamespace(dir="/nonexistent"),
                          model=SimpleNamespace(num_draft_layers=5))
    rep = capacity_report(cfg, {"tokens": 3_600_000, "block_tokens_per_token": 4.0})
    cap = rep["capacity"]
    assert cap["configured"]["tokens_per_second"] == 5000 and cap["drafter_tokens_per_gpu"] == 2500
    assert (cap["best"]["target"], cap["best"]["drafter"], cap["best"]["tokens_per_second"]) == (3, 5, 12500)
    assert cap["colocated"]["tokens_per_second"] == pytest.approx(8 / (1 / 5000 + 1 / 2500))
    assert cap["best_layout"] == "colocated" and cap["block_tokens_per_second"] == pytest.approx(4 * 8 / 0.0006)
    assert any("best split" in line and "3 target + 5 drafter" in line and "12,500 context tokens/s = 50,000 block"
               in line for line in rep["text"])
    # when the memory model puts a side over half a GPU, colocated is shown but the best layout is the split
    tight = capacity_report(cfg, {"tokens": 3_600_000, "block_tokens_per_token": 4.0}, colocated_fits=False)
    assert tight["capacity"]["best_layout"] == "split" and tight["capacity"]["tokens_per_second"] == 12500
    assert any("DOES NOT FIT" in line for line in tight["text"])
    # at the density of 512 anchors a 16K batch (0.56) the same GPUs lean the other way: the drafter keeps up
    # with 17,857 context tokens/s a GPU, the best split is 6 + 2 (min(30000, 35714))
    thin = capacity_report(cfg, {"tokens": 3_600_000, "block_tokens_per_token": 0.56})["capacity"]
    assert (thin["best"]["target"], thin["best"]["drafter"]) == (6, 2) and thin["best"]["tokens_per_second"] == 30000
    # one GPU shared by a target actor and a drafter worker: colocated is the only layout, and the configured one
    one = _Node(name="1gpu", use_gpu=True, target_workers=1, drafter_workers=1, target_gpus=0.5, drafter_gpus=0.5,
                target_tokens_per_gpu=5000.0, drafter_block_tokens_per_gpu=10000.0)
    rep1 = capacity_report(SimpleNamespace(cluster=one, run=cfg.run, model=cfg.model),
                           {"tokens": 3_600_000, "block_tokens_per_token": 4.0})
    assert rep1["capacity"]["best"] is None and rep1["capacity"]["configured"]["layout"] == "colocated"
    assert rep1["capacity"]["tokens_per_second"] == pytest.approx(1 / (1 / 5000 + 1 / 2500))
    assert "capacity model (1gpu: 1 GPU)" in rep1["text"][0]
    # the old key (context tokens/s of a drafter, meaningless without a density) is named with its successor
    with pytest.raises(UserError, match="cluster.drafter_block_tokens_per_gpu"):
        compose_config(["cluster.drafter_tokens_per_gpu=1000"])


class _Node(dict):
    __getattr__ = dict.__getitem__


def test_plan_command_prints_capacity(tmp_path, tiny_data, capsys):
    from dflash_ray.cli import main

    shards = next(o for o in tiny_data if o.startswith("data.shards="))
    assert main(["plan", "cluster=8gpu", shards, f"run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "capacity model (8gpu: 8 GPUs)" in out
    # no measured rates: the seed run's (6 target + 2 drafter GPUs at 25,300 context tokens/s, ~3.91 block
    # tokens per context token, drafter-bound) give T = 25300/6 context and D = 25300 x 3.91 / 2 block tokens/s
    # per GPU; this plan's density rho turns D into D / rho context tokens/s; min(t*T, (8-t)*D/rho) over t
    assert main(["plan", "cluster=8gpu", shards, f"run.dir={tmp_path}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rho = out["block_tokens_per_token"]
    t_rate, d_rate = 25300 / 6, 25300 * 3.91 / 2 / rho
    by_hand = max(min(t * t_rate, (8 - t) * d_rate) for t in range(1, 8))
    assert out["capacity"]["best"]["tokens_per_second"] == pytest.approx(by_hand)
    assert out["capacity"]["colocated"]["tokens_per_second"] == pytest.approx(8 / (1 / t_rate + 1 / d_rate))
    assert "seed-run estimate" in out["capacity"]["source"]


def test_token_store_pads_and_truncates():
    from dflash_ray.runtime.stream.token_store import TokenStore

    table = pa.table({"sample_id": pa.array([7, 3], pa.int64()),
                      "input_ids": pa.array([[1, 2, 3, 4], [5, 6]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1, 1, 1], [1, 1]], pa.list_(pa.int8())),
                      "num_tokens": pa.array([4, 2], pa.int32())})
    store = TokenStore.from_table(table, rows_per_block=1)   # two blocks
    ids, mask = store.batch(np.array([7, 3]), np.array([3, 2]), pad_id=0)   # sample 7 truncated to 3
    assert ids.tolist() == [[1, 2, 3], [5, 6, 0]] and mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    with pytest.raises(KeyError):
        store.batch(np.array([5]), np.array([1]), pad_id=0)


def test_flight_window_admits_in_order_and_blocks_beyond(ray_session, tmp_path):
    import ray

    from dflash_ray.runtime.coordinator import RunCoordinator

    coord = ray.remote(RunCoordinator).options(num_cpus=0, max_concurrency=100).remote("window", 3)
    gen = ray.get(coord.reset_feed.remote(10, {}, 2))
    assert ray.get([coord.admit.remote(gen, i) for i in range(3)]) == [True] * 3
    blocked = coord.admit.remote(gen, 3)
    ready, _ = ray.wait([blocked], timeout=1.0)
    assert not ready                                        # row 3 waits: 3 rows in flight
    coord.consumed_upto.remote(gen, 1)
    assert ray.get(blocked, timeout=30) is True             # row 0 trained -> row 3 admitted
    stale = coord.admit.remote(gen, 9)
    new_gen = ray.get(coord.reset_feed.remote(10, {}, 2))   # a restarted stream releases old waiters
    assert ray.get(stale, timeout=30) is False and new_gen == gen + 1
    report = ray.get(coord.report.remote())
    assert report["max_batches_in_flight"] == 3
    ray.kill(coord)


def test_flight_window_holds_a_step_two_rounds_and_the_report_slack(ray_session, tmp_path):
    """Blocks of 4 rows on 2 ranks, 2 rows a step: a block is admitted by its last row, so the window
    holds the step and two rounds (2 + 2 x 4 x 2 = 18 rows), plus one block's rows (4) that rank 0 may
    have trained without reporting them yet: 22, not the configured 3. One row a block: as configured,
    reported every step."""
    import ray

    from dflash_ray.runtime.coordinator import RunCoordinator

    coord = ray.remote(RunCoordinator).options(num_cpus=0, max_concurrency=100).remote("blocks", 3)
    gen = ray.get(coord.reset_feed.remote(10, {}, 2, rows_per_block=4, world=2))
    assert ray.get(coord.feed_info.remote())["report_slack_rows"] == 4
    assert ray.get(coord.admit.remote(gen, 21), timeout=30) is True
    blocked = coord.admit.remote(gen, 22)
    ready, _ = ray.wait([blocked], timeout=1.0)
    assert not ready
    ray.get(coord.consumed_upto.remote(gen + 1, 4))                      # another stream's rows move nothing
    ready, _ = ray.wait([blocked], timeout=1.0)
    assert not ready
    ray.get(coord.consumed_upto.remote(gen, 1))                          # row 0 trained: 22 < 1 + 22
    assert ray.get(blocked, timeout=30) is True
    assert ray.get(coord.report.remote())["window"] == 22
    gen = ray.get(coord.reset_feed.remote(10, {}, 2, rows_per_block=1, world=2))   # one row a block
    assert ray.get(coord.report.remote())["window"] == 3
    assert ray.get(coord.feed_info.remote())["report_slack_rows"] == 0
    ray.kill(coord)


def test_rank0_reports_at_start_on_time_and_before_the_window_runs_short():
    from dflash_ray.runtime.training.record_client import COMMIT_INTERVAL_S, commit_due

    assert commit_due(0, 0.0, 2, 64)                        # the first step at once
    assert not commit_due(5, 0.01, 12, 64)                  # tiny steps: wait and send several
    assert commit_due(5, COMMIT_INTERVAL_S, 12, 64)         # but at least every COMMIT_INTERVAL_S
    assert not commit_due(40, 0.01, 64, 64) and commit_due(40, 0.01, 66, 64)   # never more than the slack late
    assert commit_due(7, 0.0, 2, 0)                         # no slack (one row a block): every step


def test_the_record_writes_several_steps_in_one_call(ray_session, tmp_path):
    from dflash_ray.runtime.record.record import RunRecord

    c = RunRecord(str(tmp_path), "blocks")
    c.begin_attempt(0, 2, attempt=1, restarted=False)
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
    c.new_stream(1, 10)
    c.begin_attempt(0, 2, attempt=1, restarted=False)

    def commit(gen, step, loss):
        c.commit_step(gen, {"epoch": 0, "step": step, "positions": [2 * step - 2, 2 * step - 1], "buckets": [0, 2],
                            "tokens": [10, 20]},
                      {"step": step, "epoch": 0, "loss": loss, "tokens": 30, "lr": 1e-3, "grad_norm": 1.0})

    commit(1, 1, 3.0)
    commit(1, 2, 1.5)
    # a restart from the step-1 checkpoint: the old stream ends before the coordinator hands out the new
    # generation, so the replaced group's late commits are dropped from that moment on, not appended
    c.end_stream()
    commit(1, 3, 9.9)
    c.new_stream(2, 10)
    c.begin_attempt(1, 2, attempt=2, restarted=True)
    commit(2, 2, 1.4)
    commit(1, 3, 9.8)
    c.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "ledger.jsonl")] == [1, 2]
    assert [m["loss"] for m in last_metrics(tmp_path)] == [3.0, 1.4]     # the replayed step's last record
    report = asyncio.run(c.report())
    assert report["trainer_restarts"] == 1 and report["rolled_back_steps"] == 1
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])["event"] == "trainer_group_restarted"


def test_check_resources_names_what_the_cluster_lacks(ray_session):
    """A split the cluster cannot place stops with one line before training, instead of hanging."""
    from types import SimpleNamespace

    from dflash_ray.errors import UserError
    from dflash_ray.runtime.cluster import check_resources

    fits = SimpleNamespace(use_gpu=False, target_workers=1, drafter_workers=2, target_resource="target_slot",
                           target_gpus=1.0, drafter_gpus=1.0)
    check_resources(fits)  # the shared test cluster: 4 CPUs, 2 target slots
    with pytest.raises(UserError, match="CPUs but cluster.drafter_workers = 6"):
        check_resources(SimpleNamespace(**{**vars(fits), "drafter_workers": 6}))
    with pytest.raises(UserError, match="of resource 'target_slot' but cluster.target_workers = 3"):
        check_resources(SimpleNamespace(**{**vars(fits), "target_workers": 3}))
    with pytest.raises(UserError, match="GPUs but cluster.target_workers"):
        check_resources(SimpleNamespace(**{**vars(fits), "use_gpu": True}))
    # one GPU shared: 1 x 0.5 + 1 x 0.5 = 1 GPU (this test cluster has none, so the sum is what it names)
    one_gpu = SimpleNamespace(**{**vars(fits), "use_gpu": True, "drafter_workers": 1, "target_gpus": 0.5,
                                 "drafter_gpus": 0.5})
    with pytest.raises(UserError, match=r"= 1 x 0.5 \+ 1 x 0.5 = 1$"):
        check_resources(one_gpu)


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


def test_one_gpu_holds_a_target_actor_and_a_drafter_worker_at_half_shares(monkeypatch):
    """cluster=1gpu on a one-GPU node: 0.5 + 0.5 fits; whole-GPU shares (the 8-GPU options') do not."""
    import ray

    from dflash_ray.config import compose_config
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.cluster import check_resources
    from omegaconf import OmegaConf

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 1.0, "CPU": 8.0})
    one = OmegaConf.to_object(compose_config(["cluster=1gpu"]).cluster)
    assert (one.target_workers, one.drafter_workers, one.target_gpus, one.drafter_gpus) == (1, 1, 0.5, 0.5)
    check_resources(one)
    with pytest.raises(UserError, match="= 2$"):
        check_resources(SimpleNamespace(**{**vars(one), "target_gpus": 1.0, "drafter_gpus": 1.0}))


def test_progress_lines_end_with_the_runs_last_step(ray_session, capsys):
    """In a log (no terminal) the driver prints a progress line every few seconds; the run's last step
    must be the last line even when it came after the last poll (a rerun's log ended on 'step 9/10')."""
    import time

    import ray

    from dflash_ray.runtime.progress import Progress

    @ray.remote(num_cpus=0)
    class Coord:
        def __init__(self):
            self.step = 9

        def set_step(self, step):
            self.step = step

        def progress(self):
            return {"step": self.step, "total_steps": 10, "loss": 1.0, "tokens_per_second": 5.0,
                    "failures_survived": 0, "heldout_tau": None, "epoch": 0}

    coord = Coord.remote()
    with Progress(coord, enabled=True):
        time.sleep(1.5)                      # polled: step 9 printed
        ray.get(coord.set_step.remote(10))   # the last step, then the run ends before the next poll
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert lines[0].startswith("step 9/10") and lines[-1].startswith("step 10/10"), lines
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


def test_run_plans_travel_as_lengths_and_rebuild_the_same_plans():
    """What the driver hands Ray Train's controller: the lengths (one copy), not every epoch's built plan (a
    copy of the samples per epoch, which sat in the object store as the controller's arguments: with a store
    full of token blocks the controller waited for plasma memory forever). Rebuilt there, equal plans."""
    import pickle

    from dflash_ray.data.shards import SampleLengths
    from dflash_ray.runtime.spec import RunPlans

    n = 20_000
    rng = np.random.default_rng(1)
    tokens = rng.integers(40, 500, size=n).astype(np.int64)
    lengths = SampleLengths(np.arange(n, dtype=np.int64), tokens, tokens - 1, [], 0)
    spec = SimpleNamespace(shards="/nonexistent",   # read again nowhere: the lengths travel
                           plan=PlanSpec(boundaries=[96, 192, 512], max_tokens_per_batch=1024, min_tokens=16), seed=3)
    plans = RunPlans(spec, lengths)
    built = [plans(e) for e in range(10)]
    data = pickle.dumps(plans)
    # the lengths are 3 x 8 bytes a sample; each built plan would add its samples again (ids, lengths, anchors)
    assert len(data) < 3 * 8 * n * 1.5, len(data)
    there = pickle.loads(data)
    for e, plan in enumerate(built):
        again = there(e)
        assert again.num_batches == plan.num_batches
        for field in ("bucket", "offsets", "sample_ids", "lengths", "max_len", "anchors"):
            assert np.array_equal(getattr(again, field), getattr(plan, field)), (e, field)
