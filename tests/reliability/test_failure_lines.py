"""The one line a run ends with when Ray Train gives up (runtime/runtime/fit.py), from the errors Ray Train 2.60
raises (`WorkerGroupError` with each rank's exception), without a cluster. The runs that really fail this
way are in test_faults_on_ray.py; this file covers the kinds of last failure those runs do not end on."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from dflash_ray.errors import UserError
from dflash_ray.runtime.fit import failure_error, stopped_message


@pytest.fixture
def spec(tmp_path):
    storage = tmp_path / "ray_train"
    return SimpleNamespace(name="r", storage_path=str(storage), experiment_dir=str(storage / "r"),
                           train=SimpleNamespace(max_failures=2))


def line(err: UserError) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_dead_worker_wins_over_its_echoes(spec):
    died = WorkerHealthCheckFailedError("Worker health check failed", ActorDiedError())
    echo = RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")
    msg = line(failure_error(spec, WorkerGroupError("...", {0: echo, 1: died})))
    assert msg.startswith("training failed 3 times, more than train.max_failures=2 allows; the last failure: "
                          "a trainer worker died")
    assert msg.endswith("no checkpoint was completed: a rerun of the same run.name starts from step 0")


def test_storage_error_names_the_key(spec):
    err = PermissionError(13, f"Cannot create directory '{spec.experiment_dir}/checkpoint_x'. Detail: denied")
    msg = line(failure_error(spec, WorkerGroupError("...", {0: err, 1: err})))
    assert f"a checkpoint could not be written to train.storage_path ({spec.storage_path})" in msg


def test_other_exception_is_its_first_line_and_a_user_error_passes_through(spec):
    spec.train.max_failures = 0
    msg = line(failure_error(spec, WorkerGroupError("...", {0: RuntimeError("the stream lost its order\nx")})))
    assert msg.startswith("training failed once, more than train.max_failures=0 allows; the last failure: "
                          "RuntimeError: the stream lost its order x;")
    bad = UserError("config key 'model.init_from': shapes differ")
    assert failure_error(spec, WorkerGroupError("...", {1: bad})) is bad
    assert line(failure_error(spec, ControllerError(ValueError("boom")))).startswith("training failed: ")


def test_nonfinite_stop_line(spec):
    msg = line(UserError(stopped_message(spec, {"reason": "nonfinite", "step": 9, "streak": 4, "first_step": 6,
                                                "limit": 4, "loss": float("nan"), "grad_norm": float("nan")})))
    assert msg.startswith("training stopped at step 9: 4 steps in a row (steps 6-9) had a non-finite loss or "
                          "gradient (loss nan, grad norm nan), the limit set by train.max_nonfinite_steps=4")


def test_a_full_local_temporary_directory_names_it(spec, tmpfs, tmp_path):
    """A real ENOSPC (a 64 KiB tmpfs) while a worker writes its checkpoint files into its local temporary
    directory (/tmp/dflash-ckpt-<pid>-*): torch.save's own error says neither where nor why
    ("unexpected pos ..."); the line names the directory, its free space and "No space left on device"."""
    import errno

    import torch

    from helpers_model import tiny_step_drafter

    from dflash_ray.config import TrainConfig
    from dflash_ray.runtime.training.checkpoint_format import write_checkpoint
    from dflash_ray.runtime.stream.feed import Cursor
    from dflash_ray.runtime.training.model import make_optimizer

    drafter, _ = tiny_step_drafter(tmp_path / "model")
    opt, sched = make_optimizer(TrainConfig(), drafter, 10)
    sum(p.sum() for p in drafter.trainable_parameters()).backward()
    opt.step()                                               # AdamW's moments: the checkpoint's larger part
    local = tmpfs("64k") / "dflash-ckpt-4242-abc"
    with pytest.raises(OSError) as e:
        write_checkpoint(local, drafter=drafter, optimizer=opt, scheduler=sched, cursor=Cursor(), world_size=1)
    assert e.value.errno == errno.ENOSPC and str(local) in str(e.value)
    msg = line(failure_error(spec, WorkerGroupError("...", {0: e.value, 1: torch.distributed.DistBackendError(
        "[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer")})))
    print(msg)
    assert (f"the last failure: a checkpoint could not be written to its local temporary directory: [Errno 28] "
            f"{local}: No space left on device (0.") in msg and " MiB free there); RuntimeError: " in msg, msg


def test_a_full_storage_names_the_key_when_the_error_names_no_path(spec):
    """A rank's upload into a full train.storage_path, as pyarrow words it (no path in it): still named as
    the storage, with its free space."""
    err = OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device")
    msg = line(failure_error(spec, WorkerGroupError("...", {1: err})))
    assert f"a checkpoint could not be written to train.storage_path ({spec.storage_path}" in msg, msg
    assert "No space left on device" in msg
