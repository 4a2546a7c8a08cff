"""Shared fixtures. One local Ray instance for the whole session (`ray_session`), started on first use:
on 2 cores, starting Ray per test would cost more than the tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Token auth off for everything this session starts or joins (a local ray.init() would otherwise turn it
# on and write ~/.ray/auth_token, and later `ray start` / `ray job submit` calls would need the token).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")

RAY_NUM_CPUS = 4          # oversubscribed on purpose: Ray Data starves on 2 logical CPUs
RAY_TARGET_SLOTS = 2      # the custom resource target actors take instead of GPUs


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=RAY_NUM_CPUS, resources={"target_slot": RAY_TARGET_SLOTS},
                 object_store_memory=400_000_000, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small synthetic corpus, its tokenizer, prepared shards and a synthesised tiny target, made once.
    Returns the config overrides that point a run at them."""
    from transformers import AutoTokenizer

    from dflash_ray.config import compose_config
    from dflash_ray.data.default import ensure_data
    from dflash_ray.model.target import build_synthetic_target

    root = tmp_path_factory.mktemp("tiny_data")
    cfg = compose_config([f"run.root={root}", "run.name=data", "data.synthetic.num_conversations=40",
                          "data.synthetic.max_tokens=320"])
    ensure_data(cfg, log=lambda *a, **k: None)
    target = Path(cfg.run.dir) / "target"
    vocab = len(AutoTokenizer.from_pretrained(cfg.data.tokenizer))
    build_synthetic_target(dict(cfg.model.target_config), vocab, str(target), seed=0)
    return [f"data.input={cfg.data.input}", f"data.tokenizer={cfg.data.tokenizer}",
            f"data.shards={cfg.data.shards}", f"model.target_path={target}"]


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

        from dflash_ray.runtime.driver import main_job

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


@pytest.fixture(scope="session")
def train_run(ray_session, tiny_data, tmp_path_factory):
    return TrainRun(tmp_path_factory.mktemp("runs"), tiny_data)
