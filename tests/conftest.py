"""Shared fixtures. One local Ray instance for the whole session (`ray_session`), started on first use:
on 2 cores, starting Ray per test would cost more than the tests.

Markers are applied here, by the fixtures a test uses, so no test file has to remember them:
`ray` (the test starts or joins Ray) and `slow` (it runs the main job, submits a job or starts
torch.distributed ranks; a test that starts a Ray of its own marks itself). The quick loop is
`./scripts/run-tests.sh -m "not slow"`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# idle torch threads sleep in the test process, as in a command's (dflash_ray/threads.py): set before torch loads
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from durations_report import pytest_addoption, pytest_configure  # noqa: F401  (--durations-json)
from helpers_cluster import RUNTIME_RUN, TrainRun, submit_job_to_fresh_cluster

# Token auth off for everything this session starts or joins (a local ray.init() would otherwise turn it
# on and write ~/.ray/auth_token, and later `ray start` / `ray job submit` calls would need the token).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
# the session's Ray workers at the pytest process's priority, as the job's local Ray (runtime/cluster.py)
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray Train's controller polls its workers every 2 s by default and takes one poll to see a fit's last
# report and another to see it finished: ~4 s of every fit's tail (measured), ~30 fits in the suite. The
# tests poll every 0.5 s (the runs they start inherit it); real runs keep Ray's default (hours a fit).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# idle Ray workers kept for reuse, as a local Ray of the job keeps them (runtime/cluster.py KEEP_IDLE_WORKERS):
# a fit on the session Ray measured ~42 s with Ray's default (idle workers killed after 1 s, new ones started
# for the next tasks) and ~28 s (median of 10) with them kept. Every cluster the tests start inherits it.
from dflash_ray.runtime.cluster import KEEP_IDLE_WORKERS  # noqa: E402  (no Ray, no torch imported)

for _key, _value in KEEP_IDLE_WORKERS.items():
    os.environ.setdefault(_key, _value)

# The machine cache (demo worlds, converted GGUF files: dflash_ray/machine_cache.py) of this session only:
# tests share what they build with each other, never with the user's ~/.cache or an earlier session.
if "DFLASH_RAY_CACHE" not in os.environ:
    import tempfile

    os.environ["DFLASH_RAY_CACHE"] = tempfile.mkdtemp(prefix="dflash-ray-test-cache-")

RAY_NUM_CPUS = 4          # oversubscribed on purpose: Ray Data starves on 2 logical CPUs
RAY_TARGET_SLOTS = 2      # the custom resource target actors take instead of GPUs

RAY_FIXTURES = {"ray_session", "train_run", "job_run"}
SLOW_FIXTURES = {"train_run", "job_run", "ranks"}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Whatever a test started and left running (a rank stuck in a collective after its test timed out, a
    process a failed test did not stop) ends with the session: a leftover that holds the terminal's pipe keeps
    the caller (CI) waiting after the summary. Named, so a leak is seen. Session fixtures are torn down by now;
    under pytest-xdist the controller's children are its workers, so only a worker (or a plain run) sweeps."""
    import psutil

    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    say = getattr(config.pluginmanager.get_plugin("terminalreporter"), "write_line", print)
    for p in psutil.Process().children(recursive=True):
        try:
            name = " ".join(p.cmdline())[:120]
            p.kill()
            say(f"killed a process the tests left running: pid {p.pid}: {name}")
        except psutil.Error:
            pass


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & RAY_FIXTURES:
            item.add_marker(pytest.mark.ray)
        if used & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models: a second thread only adds contention on a shared 2-core machine (10x slower measured).
    Ray's workers are other processes and set their own thread counts."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ranks():
    """`run_ranks` (helpers_ranks.py): real torch.distributed ranks, each a fresh interpreter importing torch
    and the package (~5 s a rank on two cores). A test that uses it is slow: the quick loop keeps the
    single-process checks of the same code."""
    from helpers_ranks import run_ranks

    return run_ranks


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # address="local": always this session's own Ray, never a cluster another test (or another xdist
        # worker) started with `ray start --head`
        ray.init(address="local", num_cpus=RAY_NUM_CPUS, resources={"target_slot": RAY_TARGET_SLOTS},
                 object_store_memory=400_000_000, include_dashboard=False, log_to_driver=False,
                 # Ray's default 10 s: a gauge set in a run's last seconds may never reach the metrics port
                 _system_config={"metrics_report_interval_ms": 2000},
                 runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small synthetic corpus, its tokenizer, prepared shards and a synthesised tiny target, made once.
    Returns the config overrides that point a run at them."""
    from transformers import AutoTokenizer

    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import ensure_data
    from dflash_ray.model.target import build_synthetic_target

    root = tmp_path_factory.mktemp("tiny_data")
    cfg = compose_config([f"run.root={root}", "run.name=data", "data.synthetic.num_conversations=64",
                          "data.synthetic.max_tokens=256"])
    ensure_data(cfg, log=lambda *a, **k: None)
    target = Path(cfg.run.dir) / "target"
    vocab = len(AutoTokenizer.from_pretrained(cfg.data.tokenizer))
    build_synthetic_target(dict(cfg.model.target_config), vocab, str(target), seed=0)
    return [f"data.input={cfg.data.input}", f"data.tokenizer={cfg.data.tokenizer}",
            f"data.shards={cfg.data.shards}", f"model.target_path={target}"]


@pytest.fixture(scope="session")
def tiny_plan_batches(tiny_data):
    """Planned batches of epochs 0 and 1 of the tiny data under RUNTIME_RUN: the inputs from which the
    runtime tests derive their expected steps, rows and cursors (W = 2 drafter workers x 1)."""
    from dflash_ray.config import compose_config
    from dflash_ray.data.plan import plan_from_config

    cfg = compose_config([*tiny_data, *RUNTIME_RUN])
    return [plan_from_config(cfg, epoch=e).num_batches for e in (0, 1)]


@pytest.fixture(scope="session")
def train_run(ray_session, tiny_data, tmp_path_factory):
    return TrainRun(tmp_path_factory.mktemp("runs"), tiny_data)


def built_once(tmp_path_factory, name: str, build):
    """`build()`'s result, built once for the whole test run: under pytest-xdist the first worker to ask builds
    it and the others wait for it and read it (pickled beside the workers' temporary directories). For a run
    the tests only read, whose inputs every worker makes alike (the tiny data: the same seeds, the same
    files): a second build would cost a run's minutes and show nothing new."""
    import pickle

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    done = shared / f"{name}.pickle"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            done.write_bytes(pickle.dumps(build()))
        return pickle.loads(done.read_bytes())


@pytest.fixture(scope="session")
def split_run(train_run, tmp_path_factory):
    """One run for two bit-for-bit comparisons with job_run (each a Ray Train fit's worth of start-up saved):
    trained in two stream segments (train.stream_segment_blocks=12 at one plan batch a block:
    reliability/test_stream_segments.py) with its target over two stage processes
    (cluster.target_gpus_per_replica=2: test_target_stages.py). Neither may change a weight, so together
    they may not either; a fault in either fails both tests, each of which also checks its own facts."""
    return built_once(tmp_path_factory, "split_run", lambda: train_run(
        "split", [*RUNTIME_RUN, "train.stream_segment_blocks=12", "cluster.stream_block_mb=0",
                  "cluster.target_gpus_per_replica=2"]))


@pytest.fixture(scope="session")
def job_run(tiny_data, tmp_path_factory):
    """The run every runtime test compares against (RUNTIME_RUN), submitted as a user would. Tests only
    read its run directory; one that writes works on a copy.

    Built once for the whole test run (`built_once`: a fresh cluster, ~3 minutes on two cores)."""
    def submit():
        root = tmp_path_factory.mktemp("job")
        result = submit_job_to_fresh_cluster(root, [f"run.root={root}", "run.name=job", *tiny_data, *RUNTIME_RUN])
        result["run_dir"] = root / "job"
        return result

    result = built_once(tmp_path_factory, "job_run", submit)
    summary = result["run_dir"] / "summary.json"
    result["summary"] = json.loads(summary.read_text()) if summary.exists() else None
    return result
