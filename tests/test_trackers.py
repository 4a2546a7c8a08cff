"""Watching a run: the experiment trackers (TensorBoard, MLflow, W&B offline), the Grafana dashboard and
the Ray dashboard's Train view.

Every tracker is read back from what it wrote (TensorBoard's event files, MLflow's SQLite store, W&B's
offline run files) and compared with metrics.jsonl, the run's own record: the expected values never come
from the tracker code. The rule under test (dflash_ray/runtime/trackers.py): a step is logged once, with
the values of its first metrics.jsonl line, and a rerun of the same run.name continues the same tracker
runs.

The real runs: one main job with all three trackers and held-out evaluations (4 steps), then a rerun of
the same run.name to 6 steps; the metrics port of the session's Ray is scraped meanwhile for the Grafana
check. The Train view is read from the submitted job's dashboard (conftest.job_run) and from Ray Train's
state actor for the runs here.
"""
from __future__ import annotations

import json
import re
import struct
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from helpers_cluster import TrainRun

from dflash_ray.runtime.record.ledger import read_jsonl

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "dashboards" / "grafana" / "dflash_dashboard.json"
ALL = ["tensorboard", "mlflow", "wandb"]


# ----------------------------------------------------------------------------- reading trackers back
def tensorboard_scalars(logdir) -> dict:
    """tag -> [(step, value)] from every event file (TFRecord framing: length, crc, event, crc)."""
    from tensorboardX.proto import event_pb2

    out = defaultdict(list)
    for f in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, pos = f.read_bytes(), 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    out[v.tag].append((ev.step, v.simple_value))
    return out


def mlflow_run(uri: str, experiment: str, name: str):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name(experiment)
    runs = c.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    return c, runs


def mlflow_history(client, run_id) -> dict:
    """key -> [(step, value)] in logging order."""
    run = client.get_run(run_id)
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.timestamp)]
            for k in run.data.metrics}


def wandb_records(run_dir):
    """(segment, record) of every offline run file under <run_dir>/wandb, in start order. The file is
    LevelDB-log framed (W&B's `.wandb` format: 7-byte header, 32 KiB blocks, records split across them)."""
    from wandb.proto import wandb_internal_pb2 as pb

    for seg in sorted((Path(run_dir) / "wandb").glob("offline-run-*")):
        for f in seg.glob("run-*.wandb"):
            data = f.read_bytes()
            assert data[:4] == b":W&B", f
            pos, buf = 7, b""
            while pos + 7 <= len(data):
                space = 32768 - pos % 32768
                if space < 7:
                    pos += space
                    continue
                _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
                chunk = data[pos + 7:pos + 7 + length]
                pos += 7 + length
                if kind == 0:
                    break
                if kind in (1, 2):
                    buf = b""
                buf += chunk
                if kind in (1, 4):
                    r = pb.Record()
                    r.ParseFromString(buf)
                    yield seg.name, r


def wandb_history(run_dir):
    """[(segment, {key: value, '_step': n})] of every history row, in order; run ids by segment."""
    rows, ids, configs, artifacts = [], {}, {}, []
    for seg, r in wandb_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append((seg, {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}))
        elif kind == "run":
            ids[seg] = r.run.run_id
            configs[seg] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
        elif kind == "artifact":
            artifacts.append((seg, r.artifact.name, r.artifact.type, [e.path for e in r.artifact.manifest.contents]))
    return rows, ids, configs, artifacts


def first_lines(run_dir) -> dict:
    """step -> its first metrics.jsonl line (the values the trackers hold, by the once rule)."""
    first = {}
    for m in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        first.setdefault(int(m["step"]), m)
    return first


def scalar_keys(line: dict) -> dict:
    """The tracker names of a metrics line's numbers (train/<key>, lists as train/<key>/<i>)."""
    out = {}
    for k, v in line.items():
        if k in ("step", "time"):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"train/{k}"] = float(v)
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out.update({f"train/{k}/{i}": float(x) for i, x in enumerate(v)})
    return out


def assert_matches_metrics(by_key: dict, run_dir, *, rel=1e-6):
    """by_key: tracker key -> [(step, value)]. Every number of every step's first metrics line is there,
    once, with that value; and the tracker has no train/ step metrics.jsonl lacks."""
    first = first_lines(run_dir)
    expected = defaultdict(dict)
    for step, line in first.items():
        for k, v in scalar_keys(line).items():
            expected[k][step] = v
    assert expected, "metrics.jsonl is empty"
    for key, steps in expected.items():
        got = by_key.get(key, [])
        assert sorted(s for s, _ in got) == sorted(steps), (key, got, steps)     # each step once
        for s, v in got:
            assert v == pytest.approx(steps[s], rel=rel, abs=1e-6), (key, s, v, steps[s])
    extra = {k for k in by_key if k.startswith("train/")} - set(expected)
    assert not extra, extra


def wandb_by_key(rows) -> dict:
    """key -> [(its axis' step, value)]: a training row's keys on train/step, an evaluation's on
    heldout/step. W&B's own row counter (_step) must rise strictly over every segment of the run (a sync
    drops rows that do not)."""
    steps = [row["_step"] for _seg, row in rows]
    assert steps == sorted(set(steps)), steps
    out = defaultdict(list)
    for _seg, row in rows:
        axis = row.get("train/step", row.get("heldout/step"))
        for k, v in row.items():
            if not k.startswith("_") and k not in ("train/step", "heldout/step") and isinstance(v, (int, float)):
                out[k].append((axis, float(v)))
    return out


# ----------------------------------------------------------------------------- the rule, no main job
def commit(c, step, loss, buckets=(0, 2)):
    c.commit_steps(c.gen, [({"epoch": 0, "step": step, "positions": [2 * step - 2, 2 * step - 1],
                             "buckets": list(buckets), "tokens": [10, 20]},
                            {"step": step, "epoch": 0, "loss": loss, "tokens": 30, "lr": 1e-3 * step, "grad_norm": 0.5,
                             "slot_accuracy": [0.5, 0.25], "train_tau": 1.5, "wait_seconds": 0.01,
                             "compute_seconds": 0.2, "checkpoint_upload": "async"})])


def test_each_step_is_logged_once_across_a_restart_and_a_rerun(ray_session, tmp_path):
    """Steps 3-4 are trained again after a restart from the step-2 checkpoint (other values), then a rerun
    of the same run.name goes on to step 7: every tracker holds steps 1-7 once, with the first values,
    in one tracker run (MLflow: one run; W&B: one run id in every offline segment)."""
    from dflash_ray.runtime.record.record import RunRecord

    run = tmp_path / "r"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    opts = {"project": "unit", "mlflow_tracking_uri": uri, "wandb_mode": "offline"}
    c = RunRecord(str(run), "r", trackers=ALL, tracker_options=opts,
                       params={"train.lr": 0.001, "train.max_steps": 5, "plan.bucket_boundaries": "[32, 64]"})
    c.begin_attempt(0, 2)
    c.target_started("actor-a", 1, "node")
    for step in range(1, 5):
        c.target_batches("actor-a", [(0.01, 100, 1, -1, 0, False, 1)])   # one computed batch of bucket 1
        commit(c, step, 10.0 - step)
        if step == 2:
            c.checkpoint(1, 2, {"seconds": 0.75, "upload": "async", "write_seconds": 0.5, "bytes": 10})
    for st, tau in ((4, 2.5), (2, 1.75)):     # two held-out evaluations end between two steps, out of order
        c.trackers.log_eval(st, {"heldout/tau": tau})
    assert c.begin_attempt(2, 2)["restarted"]                       # restart: steps 3, 4 again
    for step in range(3, 6):
        commit(c, step, 100.0 + step, buckets=(1, -1))
    c.close()
    c2 = RunRecord(str(run), "r", trackers=ALL, tracker_options=opts,
                        params={"train.lr": 0.001, "train.max_steps": 7, "plan.bucket_boundaries": "[32, 64]"})
    assert c2.begin_attempt(5, 2)["attempt"] == 1
    for step in (6, 7):
        commit(c2, step, 10.0 - step)
    c2.close()

    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 3, 4, 5, 6, 7]     # metrics.jsonl keeps both records
    assert lines[2]["checkpoint_seconds"] == 0.75 and lines[2]["checkpoint_seconds_step"] == 2
    first = first_lines(run)
    assert [first[s]["loss"] for s in (3, 4)] == [7.0, 6.0]             # the first attempt's values

    tb = tensorboard_scalars(run / "tensorboard")
    assert_matches_metrics(tb, run)
    assert [s for s, _ in tb["bucket/batch0"]] == list(range(1, 8))
    assert dict(tb["bucket/batch1"])[5] == -1.0 and dict(tb["bucket/batch1"])[4] == 2.0   # 4: first attempt's
    assert dict(tb["target/0/share"])[4] == 1.0 and dict(tb["target/0/batches"])[3] == 3.0
    evals = [(2, 1.75), (4, 2.5)]
    assert sorted(tb["heldout/tau"]) == evals

    client, runs = mlflow_run(uri, "unit", "r")
    assert len(runs) == 1                                        # the rerun continued the same MLflow run
    hist = mlflow_history(client, runs[0].info.run_id)
    assert_matches_metrics(hist, run)
    assert sorted(hist["heldout/tau"]) == evals
    params, tags = runs[0].data.params, runs[0].data.tags
    assert params["train.lr"] == "0.001" and params["train.max_steps"] == "5"
    assert tags["param_changed.train.max_steps"] == "7"          # MLflow's parameters are immutable
    state = json.loads((run / "trackers.json").read_text())
    assert state["mlflow"]["run_id"] == runs[0].info.run_id

    rows, ids, configs, _ = wandb_history(run)
    assert len(ids) == 2 and set(ids.values()) == {state["wandb"]["run_id"]}   # two segments, one run
    by_key = wandb_by_key(rows)
    assert_matches_metrics(by_key, run)
    assert sorted(by_key["heldout/tau"]) == evals
    assert [configs[s]["train"]["max_steps"] for s in sorted(configs)] == [5, 7]


def test_tracker_choice_is_checked_before_anything_starts(capsys, monkeypatch, tmp_path):
    from dflash_ray.cli import main
    from dflash_ray.config import compose_config
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.record import trackers

    with pytest.raises(UserError, match=r"config key 'train.trackers': 'neptune' is not one of tensorboard, mlflow"):
        compose_config(["train.trackers=[mlflow,neptune]"])
    assert main(["train", "train.trackers=[neptune]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.trackers" in err
    # the alias: train.tensorboard=true is the tensorboard tracker
    assert trackers.chosen(compose_config(["train.tensorboard=true", "train.trackers=[mlflow]"]).train) == \
        ["mlflow", "tensorboard"]
    # a chosen tracker that is not installed: one line naming the extra, before Ray starts
    monkeypatch.setitem(trackers.NEEDS, "wandb", (("no_such_wandb_module",), "wandb"))
    assert main(["train", "train.trackers=[wandb]", f"run.root={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'dflash-ray[wandb]'" in err and "train.trackers" in err


def test_step_scalars_names_every_number_of_a_metrics_line():
    from dflash_ray.runtime.record.trackers import step_scalars

    line = {"step": 3, "time": 1.0, "loss": 2.5, "slot_accuracy": [0.5, 0.25], "skipped_nonfinite": 0,
            "checkpoint_upload": "async", "train_tau": 1.75}
    got = step_scalars(line, {"buckets": [4, -1]}, {"a": {"batches": 3, "busy_s": 1.0, "started": time.time() - 4},
                                                    "b": {"batches": 1, "busy_s": 0.0, "started": time.time() - 4}})
    assert {k: v for k, v in got.items() if k.startswith("train/")} == scalar_keys(line)
    assert got["bucket/batch0"] == 4.0 and got["bucket/batch1"] == -1.0
    assert got["target/0/share"] == 0.75 and got["target/1/share"] == 0.25
    assert 0.7 < got["target/0/idle_fraction"] < 0.8 and got["target/1/idle_fraction"] == 1.0


# ----------------------------------------------------------------------------- the Grafana dashboard
def dashboard_metrics() -> set[str]:
    """Every metric name a panel's PromQL queries (identifiers before a selector or in a range vector)."""
    dash = json.loads(DASHBOARD.read_text())
    names = set()
    for p in dash["panels"]:
        for t in p.get("targets", []):
            names |= set(re.findall(r"\b(ray_[a-z_]+)\s*[{\[]", t["expr"]))
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if isinstance(q, dict):
            names |= set(re.findall(r"\b(ray_[a-z_]+)\b", q.get("query", "")))
    return names


def test_dashboard_is_grafana_json_with_every_panel_on_the_prometheus_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "run"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert 'run=~"$run"' in t["expr"], (p["title"], t["expr"])
    wanted = {"ray_dflash_tokens_per_second", "ray_dflash_block_tokens_per_second", "ray_dflash_loss", "ray_dflash_heldout_tau", "ray_dflash_train_tau",
              "ray_dflash_bucket_batches_total", "ray_dflash_target_busy_seconds_total",
              "ray_dflash_target_idle_fraction", "ray_dflash_batches_in_flight", "ray_dflash_checkpoint_seconds",
              "ray_dflash_failures_survived", "ray_dflash_oom_splits", "ray_dflash_skipped_oom"}
    assert wanted <= dashboard_metrics()


def scrape_text(port: int) -> str | None:
    """What a node's metrics port serves now (Prometheus text); None when it did not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def bucket_counts(text: str, run: str) -> dict[str, float]:
    """bucket -> batches, from the ray_dflash_bucket_batches_total lines of one run."""
    out = {}
    for line in (text or "").splitlines():
        if line.startswith("ray_dflash_bucket_batches_total{") and f'run="{run}"' in line:
            out[re.search(r'bucket="([^"]*)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return out


def test_two_runs_on_one_node_both_export_their_bucket_mix(ray_session):
    """Two runs' records in two processes of one node, with different buckets: each run's batches per bucket
    reach the node's metrics port. Ray defines a metric once per node, from the first process to report it:
    the histogram this replaced took its bounds from the run's bucket count, and a later run's points with
    other bounds were dropped (Ray 2.60 skips them; 2.59 also dropped the rest of that process's report)."""
    import uuid

    import ray

    from dflash_ray.runtime.record.gauges import Gauges

    @ray.remote(num_cpus=0)
    class Record:
        def __init__(self, run):
            self.gauges = Gauges(run)

        def steps(self, buckets_per_step):
            for i, buckets in enumerate(buckets_per_step, 1):
                self.gauges.step({"loss": 1.0, "step": i}, {"buckets": buckets}, 1.0, 1.0)

    tag = uuid.uuid4().hex[:8]
    few, many = f"few-{tag}", f"many-{tag}"
    records = [Record.remote(few), Record.remote(many)]
    try:
        ray.get(records[0].steps.remote([[0, 1], [2, 2]]))      # 3 buckets
        ray.get(records[1].steps.remote([[6, 0], [6, -1]]))     # 7 buckets; -1 is a filler, nothing trained
        port = ray._private.worker.global_worker.node.metrics_export_port
        expected = {few: {"0": 1.0, "1": 1.0, "2": 2.0}, many: {"0": 1.0, "6": 2.0}}
        deadline, seen = time.time() + 60, {}
        while time.time() < deadline:
            text = scrape_text(port)
            seen = {run: bucket_counts(text, run) for run in expected}
            if seen == expected:
                break
            time.sleep(1.0)
        assert seen == expected
    finally:
        for r in records:
            ray.kill(r)


# ----------------------------------------------------------------------------- the real runs
TRACKED = ["train.trackers=[tensorboard,mlflow,wandb]", "train.wandb_mode=offline", "train.checkpoint_every=2",
           "train.heldout_every=2", "eval.max_new_tokens=8", "train.tracker_project=dflash-test"]


def metric_names_on(port: int) -> set[str] | None:
    """The ray_dflash_* names the port serves now; None when it did not answer."""
    text = scrape_text(port)
    if text is None:
        return None
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("ray_dflash_")}


@pytest.fixture(scope="module")
def tracked(train_run, tiny_data, tmp_path_factory):
    """The main job with all three trackers (4 steps, held-out tau every 2), then the same run.name rerun
    to 6 steps; the session Ray's metrics port scraped during the first."""
    import ray

    root = tmp_path_factory.mktemp("tracked")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("one two three", "four five six")))
    runs = TrainRun(root, [*tiny_data, f"data.prompts={prompts}"])
    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = dashboard_metrics()
    t0 = time.time()
    first_seen, unanswered = {}, []   # when each name first showed; scrapes the port did not answer

    def scrape(name):
        start = time.time()
        while time.time() - start < 300 and not (root / name / "summary.json").exists():
            now = metric_names_on(port)
            if now is None:
                unanswered.append(round(time.time() - t0, 1))
            for n in now or ():
                first_seen.setdefault(n, round(time.time() - t0, 1))
            time.sleep(1.0)

    first = runs("tracked", [*TRACKED, "train.max_steps=4"], during=scrape)
    t1 = time.time()
    state_after_first = json.loads((root / "tracked" / "trackers.json").read_text())
    mlflow_first = mlflow_run(f"sqlite:///{root}/mlflow.db", "dflash-test", "tracked")[1][0]
    (root / "tracked" / "summary.json").unlink()
    second = runs("tracked", [*TRACKED, "train.max_steps=6"], during=scrape)
    names = set(first_seen)
    print(f"tracked run: {t1 - t0:.1f} s, rerun to 6 steps: {time.time() - t1:.1f} s; "
          f"dashboard metrics seen: {sorted(wanted & names)}, not seen: {sorted(wanted - names)}")
    uploads = [(m["step"], m["checkpoint_upload_step"], round(m["time"] - t0, 1))
               for m in read_jsonl(root / "tracked" / "metrics.jsonl") if "checkpoint_upload_step" in m]
    scrapes = (f"first seen (s from the start): {first_seen}; port unanswered at {unanswered}; upload seconds "
               f"on metrics lines (step, its checkpoint's step, s): {uploads}; runs ended at {t1 - t0:.1f} and "
               f"{time.time() - t0:.1f} s")
    return {"root": root, "run": root / "tracked", "first": first, "second": second, "names": names,
            "scrapes": scrapes,
            "state_after_first": state_after_first, "mlflow_first": mlflow_first}


def test_trackers_hold_every_step_of_metrics_jsonl(tracked):
    run = tracked["run"]
    spec, s = tracked["second"]
    assert s["steps"] == 6 and s["ledger"]["ok"]
    assert sorted(first_lines(run)) == list(range(1, 7))
    evals = sorted(read_jsonl(run / "evals.jsonl"), key=lambda e: e["step"])   # they may end out of order
    assert [e["step"] for e in evals] == [2, 4, 6]
    failed = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "tracker_failed"]
    assert not failed, failed

    # TensorBoard: every number of every step, held-out tau at its step
    tb = tensorboard_scalars(run / "tensorboard")
    assert_matches_metrics(tb, run)
    assert sorted(tb["heldout/tau"]) == [(e["step"], pytest.approx(e["tau"])) for e in evals]
    ledger = {r["step"]: r for r in read_jsonl(run / "ledger.jsonl")}
    assert [v for _, v in sorted(tb["bucket/batch0"])] == [ledger[st]["buckets"][0] for st in range(1, 7)]

    # MLflow: one run, every step, params, held-out tau, artifacts, FINISHED
    client, runs = mlflow_run(f"sqlite:///{tracked['root']}/mlflow.db", "dflash-test", "tracked")
    assert len(runs) == 1 and runs[0].info.run_id == tracked["mlflow_first"].info.run_id
    r = runs[0]
    hist = mlflow_history(client, r.info.run_id)
    assert_matches_metrics(hist, run)
    assert sorted(hist["heldout/tau"]) == [(e["step"], pytest.approx(e["tau"])) for e in evals]
    assert r.info.status == "FINISHED" and tracked["mlflow_first"].info.status == "FINISHED"
    assert r.data.params["train.lr"] == str(spec.train.lr) and r.data.params["name"] == "tracked"
    assert r.data.params["train.max_steps"] == "4" and r.data.tags["param_changed.train.max_steps"] == "6"
    exported = {Path(a.path).name for a in client.list_artifacts(r.info.run_id, "export")}
    assert exported == {p.name for p in (run / "export").iterdir()}
    assert {Path(a.path).name for a in client.list_artifacts(r.info.run_id, "best")} == \
        {p.name for p in (run / "best").iterdir()}
    assert hist["final/heldout_tau_trained"][-1] == (6, pytest.approx(s["heldout_tau"]["trained"]["tau"]))

    # W&B offline: one run id in every segment, every step once, held-out tau on its own axis
    rows, ids, configs, artifacts = wandb_history(run)
    assert set(ids.values()) == {tracked["state_after_first"]["wandb"]["run_id"]} and len(ids) >= 3
    by_key = wandb_by_key(rows)
    assert_matches_metrics(by_key, run)
    assert sorted(by_key["heldout/tau"]) == [(e["step"], pytest.approx(e["tau"])) for e in evals]
    assert any(c["train"]["lr"] == spec.train.lr for c in configs.values())
    kinds = {(name, kind) for _, name, kind, _ in artifacts}
    assert {("tracked-export", "model"), ("tracked-best", "model")} <= kinds
    files = {Path(p).name for _, name, _, paths in artifacts if name == "tracked-export" for p in paths}
    assert files == {p.name for p in (run / "export").iterdir()}


def test_the_rerun_continued_the_same_tracker_runs(tracked):
    run = tracked["run"]
    state = json.loads((run / "trackers.json").read_text())
    assert state["mlflow"]["run_id"] == tracked["state_after_first"]["mlflow"]["run_id"]
    assert state["wandb"]["run_id"] == tracked["state_after_first"]["wandb"]["run_id"]
    tb = tensorboard_scalars(run / "tensorboard")
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) >= 2   # one file per invocation
    assert sorted(s for s, _ in tb["train/loss"]) == list(range(1, 7))       # no step twice, none rewound


def test_every_metric_the_dashboard_queries_is_exported_by_a_real_run(tracked):
    """Scraped from the session Ray's metrics export port while the tracked run trained."""
    missing = dashboard_metrics() - tracked["names"]
    assert not missing, (f"queried by dashboards/grafana/dflash_dashboard.json but never exported: {sorted(missing)}; "
                         f"{tracked['scrapes']}")


def test_train_view_shows_the_runs(tracked):
    """Ray Train's state actor (what the dashboard's Train view reads, /api/train/v2/runs/v1): both fits
    of the tracked run, finished, with their two workers."""
    from ray.train.v2._internal.state.state_actor import get_state_actor

    import ray

    actor = get_state_actor()
    assert actor is not None, "no Train state actor: RAY_TRAIN_ENABLE_STATE_TRACKING is not on"
    runs = [r for r in ray.get(actor.get_train_runs.remote()).values() if r.name == "tracked"]
    assert len(runs) == 2 and {r.status.value for r in runs} == {"FINISHED"}
    attempts = ray.get(actor.get_train_run_attempts.remote())
    for r in runs:
        assert any(len(a.workers) == 2 for a in attempts[r.id].values())


def test_train_view_of_the_submitted_job(job_run):
    """The dashboard's own endpoint for the Train view, on the `ray job submit` cluster: the run by its
    run.name, FINISHED, under the job that submitted it."""
    assert job_run["status"] == "SUCCEEDED", job_run["logs"][-3000:]
    assert job_run["train_runs"], "the dashboard's /api/train/v2/runs/v1 did not answer"
    runs = [r for r in json.loads(job_run["train_runs"])["train_runs"] if r["name"] == "job"]
    assert len(runs) == 1 and runs[0]["status"] == "FINISHED", runs
    assert runs[0]["job_details"]["submission_id"] == job_run["submission_id"]
    assert len(runs[0]["attempts"][-1]["workers"]) == 2
    # the job's own scrape: the dashboard's training panels have data there too
    print("job_run exported:", sorted(job_run["metric_names"]))
    assert {"ray_dflash_loss", "ray_dflash_tokens_per_second", "ray_dflash_step"} <= job_run["metric_names"]
