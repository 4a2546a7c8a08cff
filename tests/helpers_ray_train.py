"""A run's checkpoints registered the way a Ray Train run registers them, without a run: Ray Train's own
checkpoint manager (the code its controller calls after every rank's report) writes its record, so the tests
of what the driver reads never write Ray's file format by hand. Its imports are Ray's private modules: a
test helper may follow Ray's internals (a new Ray fails here, loudly); the package reads the record through
the public `ray.train.Result.from_path` only."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path


def register_with_ray_train(experiment_dir, dir_name: str, metrics: dict) -> Path:
    """Register <experiment_dir>/<dir_name> (created if missing) as the run's latest checkpoint, reported
    with `metrics`, after those registered before. Returns the checkpoint's directory."""
    from ray.train import Checkpoint, CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    experiment = Path(experiment_dir).resolve()
    checkpoint = experiment / dir_name
    checkpoint.mkdir(parents=True, exist_ok=True)

    async def register():   # the manager notifies its listeners on the running event loop
        storage = StorageContext(storage_path=str(experiment.parent), experiment_dir_name=experiment.name)
        manager = CheckpointManager(checkpoint_config=CheckpointConfig(), storage_context=storage)
        manager.register_checkpoint(_TrainingReport(Checkpoint(str(checkpoint)), dict(metrics), False))

    asyncio.run(register())
    return checkpoint


def forget_checkpoints(experiment_dir) -> None:
    """No checkpoint registered any more (a rerun starts fresh): the experiment directory removed."""
    shutil.rmtree(experiment_dir, ignore_errors=True)
