"""The driver side of the main job: connect to (or start) Ray, start the coordinator, run the
TorchTrainer over the Ray Data stream, show progress, export the drafter, write summary.json."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from dflash_ray.errors import UserError

STATE_TRACKING = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}


def connect(cfg, log=print) -> bool:
    """Connect to cluster.address / $RAY_ADDRESS, or start a local Ray. Returns True if we started it."""
    import ray

    os.environ.update(STATE_TRACKING)  # the dashboard's Train view (local Ray inherits it)
    if ray.is_initialized():
        return False
    c = cfg.cluster
    runtime_env = {"env_vars": dict(STATE_TRACKING)}
    address = c.address
    if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]  # inside `ray job submit`, or set by the user
    if address:
        in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ  # the job's runtime_env applies (jobs/)
        ray.init(address=address, runtime_env=None if in_job else runtime_env, log_to_driver=True)
        log(f"connected to Ray at {address}")
        return False
    resources = {} if c.use_gpu else {str(c.target_resource): float(c.target_workers)}
    ray.init(num_cpus=c.num_cpus, object_store_memory=c.object_store_memory, resources=resources,
             runtime_env=runtime_env, log_to_driver=False)
    log(f"started a local Ray ({c.num_cpus} CPUs, resources {resources or 'GPUs'})")
    return True


def main_job(cfg, *, progress: bool = True, log=print, plan_log=print):
    """The whole main job: resolve, plan, connect, train (or resume), export, summary.json.
    Returns (spec, summary)."""
    from dflash_ray.data.plan import plan_from_config
    from dflash_ray.data.report import format_plan
    from dflash_ray.runtime.spec import resolve_spec

    spec = resolve_spec(cfg, log=log)
    plan_summary = plan_from_config(cfg, epoch=0).summary()
    plan_log(format_plan(plan_summary))
    started = connect(cfg, log=log)
    try:
        summary = run_training(spec, plan_summary, progress=progress, log=log)
        if summary["checkpoint"]:
            export_checkpoint(spec, summary["checkpoint"], summary["export"])
        else:
            summary["export"] = None
        write_json_atomic(Path(spec.run_dir) / "summary.json", summary)
    finally:
        if started:
            import ray

            ray.shutdown()
    return spec, summary


def check_resources(spec) -> None:
    """Fail before training when the cluster cannot place the actors (rather than hanging)."""
    import ray

    total = ray.cluster_resources()
    if spec.use_gpu:
        need = spec.target_workers + spec.drafter_workers
        if total.get("GPU", 0) < need:
            raise UserError(f"cluster has {total.get('GPU', 0):g} GPUs but cluster.target_workers + "
                            f"cluster.drafter_workers = {need}")
    elif total.get(spec.target_resource, 0) < spec.target_workers:
        raise UserError(f"cluster has {total.get(spec.target_resource, 0):g} of resource '{spec.target_resource}' "
                        f"but cluster.target_workers = {spec.target_workers} (start Ray with "
                        f"--resources '{{\"{spec.target_resource}\": {spec.target_workers}}}')")
    # trainers take 1 CPU each, target actors 1 (GPU) or 0.5 (CPU), a token-join task 0.25
    need_cpu = spec.drafter_workers + spec.target_workers * (1 if spec.use_gpu else 0.5) + 0.25
    if total.get("CPU", 0) < need_cpu:
        raise UserError(f"cluster has {total.get('CPU', 0):g} CPUs but cluster.drafter_workers = "
                        f"{spec.drafter_workers} and cluster.target_workers = {spec.target_workers} need "
                        f"{need_cpu:g} (on one machine, raise cluster.num_cpus: oversubscribing is fine)")


def start_coordinator(spec, num_buckets: int):
    import ray

    from dflash_ray.runtime.coordinator import RunCoordinator
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor = ray.remote(RunCoordinator).options(
        name=spec.coordinator, namespace=spec.namespace, num_cpus=0, max_concurrency=1000,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(spec.run_dir, spec.run_name, spec.max_batches_in_flight, num_buckets, spec.tensorboard)
    ray.get(actor.progress.remote())
    return actor


class Progress:
    """The driver's progress bar: step/total, tokens/s, loss, ETA (tqdm), failures survived."""

    def __init__(self, coord, enabled: bool = True):
        self.coord, self.enabled = coord, enabled
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.t0, self.s0 = None, 0

    def __enter__(self):
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.enabled:
            self.thread.join(timeout=5)

    def _run(self):
        import ray

        bar, last_line, last_step = None, 0.0, -1
        tty = sys.stderr.isatty()
        while not self.stop.is_set():
            try:
                p = ray.get(self.coord.progress.remote(), timeout=10)
            except Exception:
                break
            if p["total_steps"]:
                if tty:
                    bar = self._tqdm(bar, p)
                elif p["step"] != last_step and (time.time() - last_line > 5 or p["step"] == p["total_steps"]):
                    print(self.line(p), file=sys.stderr, flush=True)
                    last_line, last_step = time.time(), p["step"]
            self.stop.wait(1.0)
        if bar is not None:
            try:
                bar = self._tqdm(bar, ray.get(self.coord.progress.remote(), timeout=10))
            except Exception:
                pass
            bar.close()

    def line(self, p) -> str:
        """One progress line (for logs, where a redrawn bar would be noise)."""
        if self.t0 is None or p["step"] < self.s0:
            self.t0, self.s0 = time.time(), p["step"]
        done = p["step"] - self.s0
        rate = done / max(time.time() - self.t0, 1e-9)
        eta = (p["total_steps"] - p["step"]) / rate if rate > 0 else float("nan")
        loss = "-" if p["loss"] is None else f"{p['loss']:.4f}"
        return (f"step {p['step']}/{p['total_steps']}  tokens/s {p['tokens_per_second']:.0f}  loss {loss}  "
                f"ETA {eta:.0f}s  failures survived {p['failures_survived']}")

    def _tqdm(self, bar, p):
        from tqdm import tqdm

        if bar is None:
            bar = tqdm(total=p["total_steps"], desc="train", unit="step", dynamic_ncols=True)
        bar.total, bar.n = p["total_steps"], p["step"]
        loss = "-" if p["loss"] is None else f"{p['loss']:.4f}"
        bar.set_postfix_str(f"tok/s={p['tokens_per_second']:.0f} loss={loss} failures={p['failures_survived']}",
                            refresh=False)
        bar.refresh()
        return bar


def run_training(spec, plan_summary: dict, *, progress: bool = True, log=print) -> dict:
    """Train (or resume) the run described by spec. Returns summary.json's content."""
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dflash_ray.data.shards import read_all
    from dflash_ray.runtime.coordinator import last_metrics
    from dflash_ray.runtime.loop import train_loop_per_worker
    from dflash_ray.runtime.pipeline import DatasetFactory, TokenStore

    check_resources(spec)
    coord = start_coordinator(spec, len(plan_summary.get("buckets", [])) or 1)
    t0 = time.time()
    tokens_ref = ray.put(TokenStore.from_table(read_all(spec.shards, spec.vocab_size)).arrays())
    experiment_dir = f"{spec.storage_path.rstrip('/')}/{spec.run_name}"
    from ray.data import DataContext

    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False  # our own progress line says what matters; Ray Data's bars flood job logs
    exec_opts = data_ctx.execution_options
    exec_opts.preserve_order = True  # with one-row blocks: round-robin over the train workers
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec, "threads": 1},  # one torch thread per worker: measured best on CPUs
        torch_config=TorchConfig(backend="nccl" if spec.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=spec.drafter_workers, use_gpu=spec.use_gpu,
                                     resources_per_worker=None if spec.use_gpu else {"CPU": 1}),
        run_config=RunConfig(
            name=spec.run_name, storage_path=spec.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=spec.num_to_keep),
            failure_config=FailureConfig(max_failures=spec.max_failures)),
        datasets={"train": DatasetFactory(spec, tokens_ref, experiment_dir)},
        dataset_config=DataConfig(execution_options=exec_opts),
    )
    try:
        with Progress(coord, enabled=progress):
            result = trainer.fit()
        report = ray.get(coord.report.remote())
        ray.get(coord.close.remote())
    finally:
        ray.kill(coord)  # the name is free for a rerun of this run from this process
    wall = time.time() - t0
    if result.error is not None:
        raise result.error
    cursor_epoch = (result.metrics or {}).get("cursor_epoch")
    return build_summary(spec, plan_summary, report, result.checkpoint.path if result.checkpoint else None,
                         last_metrics(spec.run_dir), wall, t0,
                         finished_before=None if cursor_epoch is None else int(cursor_epoch))


def build_summary(spec, plan_summary, report, checkpoint_path, metrics, wall, t0=0.0,
                  finished_before: int | None = None) -> dict:
    """finished_before: the final checkpoint's cursor epoch; every epoch before it was trained to the
    end, so the ledger must cover each of them exactly once (even one the ledger lacks entirely)."""
    from dflash_ray.runtime.ledger import LEDGER, read_jsonl, verify_ledger

    ledger = read_jsonl(Path(spec.run_dir) / LEDGER)
    epochs = {int(r["epoch"]) for r in ledger} | set(range(finished_before or 0))
    plan_sizes = _plan_sizes(spec, sorted(epochs))
    if finished_before is not None:
        finished = [e for e in plan_sizes if e < finished_before]
    else:
        finished = [e for e in plan_sizes if any(int(r["epoch"]) > e for r in ledger)
                    or _epoch_complete(ledger, e, plan_sizes[e])]
    check = verify_ledger(ledger, plan_sizes, finished_epochs=finished)
    tokens = sum(int(m["tokens"]) for m in metrics)
    now = [m for m in metrics if m.get("time", 0) >= t0]      # steps trained by this invocation
    base = now or metrics                                     # (a rerun of a finished run trains none)
    steady = base[1:]
    span = (steady[-1]["time"] - base[0]["time"]) if steady else 0.0
    tps = sum(int(m["tokens"]) for m in steady) / span if span > 0 else 0.0
    return {
        "run": spec.run_name, "run_dir": spec.run_dir,
        "steps": int(metrics[-1]["step"]) if metrics else 0,
        "epochs": sorted({int(m["epoch"]) for m in metrics}),
        "epochs_finished": finished,
        "tokens": tokens, "tokens_per_second": tps, "wall_seconds": wall,
        "tokens_this_invocation": sum(int(m["tokens"]) for m in now),
        "end_to_end_tokens_per_second": sum(int(m["tokens"]) for m in now) / wall if wall > 0 else 0.0,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "final_acceptance_length": metrics[-1].get("acceptance_length") if metrics else None,
        "plan": {k: plan_summary.get(k) for k in ("batches", "tokens", "padding_efficiency", "strategy", "order")},
        "world": spec.world, "drafter_workers": spec.drafter_workers, "target_workers": spec.target_workers,
        "failures_survived": report["failures_survived"], "trainer_restarts": report["trainer_restarts"],
        "target_restarts": report["target_restarts"], "rolled_back_steps": report["rolled_back_steps"],
        "max_batches_in_flight": report["max_batches_in_flight"], "flight_window": report["window"],
        "target_actors": report["targets"], "checkpoints": report["checkpoints"],
        "timeline_seconds": report.get("timeline", {}),
        "measured": measured_rates(report["targets"], metrics, spec),
        "model": spec.model_cfg, "target_path": spec.target_path, "use_gpu": spec.use_gpu,
        "checkpoint": checkpoint_path, "ledger": check, "export": str(Path(spec.run_dir) / "export"),
    }


def measured_rates(targets: dict, metrics: list, spec) -> dict:
    """Per-device rates for the capacity model: target tokens per busy second of an actor, drafter tokens
    per compute second of a worker (median over steps; data waits excluded)."""
    import numpy as np

    busy = sum(t["busy_s"] for t in targets.values())
    tokens = sum(t.get("tokens", 0) for t in targets.values())
    per_worker = [m["tokens"] / spec.drafter_workers / m["compute_seconds"] for m in metrics[1:]
                  if m.get("compute_seconds")]
    waits = [m.get("wait_seconds", 0.0) for m in metrics[1:]]
    steps = [m.get("step_seconds", 0.0) for m in metrics[1:]]
    return {"target_tokens_per_second_per_actor": tokens / busy if busy > 0 else None,
            "drafter_tokens_per_second_per_worker": float(np.median(per_worker)) if per_worker else None,
            "trainer_wait_fraction": float(sum(waits) / sum(steps)) if sum(steps) > 0 else None}


def _epoch_complete(ledger, epoch, n) -> bool:
    got = {p for r in ledger if int(r["epoch"]) == epoch for p in r["positions"] if p >= 0}
    return len(got) >= n


def _plan_sizes(spec, epochs) -> dict:
    from dflash_ray.runtime.spec import build_plan_for
    from dflash_ray.data.shards import read_lengths

    lengths = read_lengths(spec.shards)[:2]
    return {e: build_plan_for(spec.plan_cfg, e, lengths=lengths).num_batches for e in epochs}


def export_checkpoint(spec, checkpoint_dir: str, out_dir: str) -> str:
    """Write the drafter of a checkpoint as a Hugging Face directory the reference `dflash` loads."""
    import torch

    from dflash_ray.model.export import export_drafter
    from dflash_ray.runtime.checkpoint import load_weights, read_state
    from dflash_ray.runtime.loop import build_model

    read_state(Path(checkpoint_dir))
    drafter = build_model(spec, torch.device("cpu"))
    drafter.load_state_dict(load_weights(Path(checkpoint_dir)), strict=True)
    return export_drafter(drafter, out_dir)


def latest_checkpoint_dir(spec) -> str | None:
    from dflash_ray.runtime.checkpoint import SNAPSHOT

    path = Path(spec.storage_path) / spec.run_name / SNAPSHOT
    if not path.exists():
        return None
    latest = json.loads(path.read_text()).get("latest_checkpoint_result")
    if not latest:
        return None
    return str(Path(spec.storage_path) / spec.run_name / latest["checkpoint_dir_name"])


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
