"""The TorchTrainer of a run: the Ray Data stream as its dataset, the worker loop, the scaling, storage,
checkpoint and failure policies. `fit` trains (or resumes) and returns what the coordinator saw."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class FitOutcome:
    report: dict          # the coordinator's report: restarts, target actors, checkpoints, timeline
    started: float        # time.time() when this invocation started training
    wall_seconds: float


def fit(run_spec, num_buckets: int, *, progress: bool = True) -> FitOutcome:
    import ray
    from ray.data import DataContext
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dflash_ray.data.shards import read_all
    from dflash_ray.runtime.cluster import start_coordinator
    from dflash_ray.runtime.loop import train_loop_per_worker
    from dflash_ray.runtime.pipeline import DatasetFactory, TokenStore
    from dflash_ray.runtime.progress import Progress

    c, t = run_spec.cluster, run_spec.train
    coord = start_coordinator(run_spec, num_buckets)
    t0 = time.time()
    tokens_ref = ray.put(TokenStore.from_table(read_all(run_spec.shards, run_spec.vocab_size)).arrays())
    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False  # our own progress line says what matters; Ray Data's bars flood job logs
    exec_opts = data_ctx.execution_options
    exec_opts.preserve_order = True  # with one-row blocks: round-robin over the train workers
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": run_spec, "threads": 1},  # one torch thread per worker: measured best on CPUs
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=c.drafter_workers, use_gpu=c.use_gpu,
                                     resources_per_worker={"GPU": c.drafter_gpus, "CPU": 1} if c.use_gpu else {"CPU": 1}),
        run_config=RunConfig(
            name=run_spec.name, storage_path=run_spec.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=t.num_to_keep),
            failure_config=FailureConfig(max_failures=t.max_failures)),
        datasets={"train": DatasetFactory(run_spec, tokens_ref, run_spec.experiment_dir)},
        dataset_config=DataConfig(execution_options=exec_opts),
    )
    try:
        with Progress(coord, enabled=progress):
            result = trainer.fit()
        report = ray.get(coord.report.remote())
        ray.get(coord.close.remote())
    finally:
        ray.kill(coord)  # the name is free for a rerun of this run from this process
    if result.error is not None:
        raise result.error
    return FitOutcome(report=report, started=t0, wall_seconds=time.time() - t0)
