"""The TorchTrainer of a run: the Ray Data stream as its dataset, the worker loop, the scaling, storage,
checkpoint and failure policies. `fit` trains (or resumes) and returns what the run record saw.

A run that cannot go on ends here with one line (a UserError: the CLI prints it, exit code 2) that says
why and where the next invocation of the same run.name resumes from: more worker-group failures than
train.max_failures (Ray Train's `TrainingFailedError`, its last failure named: a storage error, a dead
worker, an exception), or train.max_nonfinite_steps non-finite steps in a row (the workers stop together
and tell the run record). The original error stays chained (`--debug` shows its traceback)."""
from __future__ import annotations

import dataclasses
import errno
import time
from dataclasses import dataclass

from dflash_ray.errors import UserError
from dflash_ray.threads import threads_for


@dataclass
class FitOutcome:
    report: dict          # the run record's and the coordinator's reports: restarts, target actors, checkpoints, timeline
    started: float        # time.time() when this invocation started training
    wall_seconds: float


_FITS: dict[str, int] = {}   # fits started from this process, by coordinator name


def start_run_actors(run_spec):
    """The run's RunCoordinator (the flight window) and RunRecord (the run directory's writer), both pinned
    to the driver's node: the run directory is there. Returns (coordinator, record)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dflash_ray.runtime.coordinator import RunCoordinator
    from dflash_ray.runtime.record import trackers
    from dflash_ray.runtime.coordinator import record_actor_name
    from dflash_ray.runtime.record.record import RunRecord

    names = trackers.chosen(run_spec.train)   # train.trackers (+ train.tensorboard, its alias)
    here = dict(namespace=run_spec.namespace, num_cpus=0, max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False))
    coord = ray.remote(RunCoordinator).options(name=run_spec.coordinator, **here).remote(
        run_spec.name, run_spec.cluster.max_batches_in_flight)
    record = ray.remote(RunRecord).options(name=record_actor_name(run_spec.coordinator), **here).remote(
        run_spec.run_dir, run_spec.name, trackers=names,
        tracker_options=trackers.options(run_spec.train, run_spec.run_dir),
        params=trackers.run_params(run_spec) if names else None)
    try:
        ray.get([record.progress.remote(), coord.feed_info.remote()])
    except ray.exceptions.RayActorError as e:  # e.g. a chosen tracker not installed where the actor runs
        line = next((x.strip() for x in str(e).splitlines() if "config key 'train.trackers'" in x), None)
        if line:
            raise UserError(line.split("UserError: ", 1)[-1]) from e
        raise
    return coord, record


def _fresh_coordinator(run_spec):
    """The spec with a coordinator name this process has not used yet. The name is per run and driver
    process (spec.coordinator_name); a second fit of the same run.name from the same process (a rerun after
    a stop, from a notebook or a test) must not meet the first fit's killed coordinator, whose handle the
    pooled Ray Data workers keep cached by name (pipeline.join_tokens)."""
    n = _FITS.get(run_spec.coordinator, 0)
    _FITS[run_spec.coordinator] = n + 1
    return run_spec if n == 0 else dataclasses.replace(run_spec, coordinator=f"{run_spec.coordinator}-{n}")


def fit(run_spec, plans, *, progress: bool = True) -> FitOutcome:
    """Train (or resume) the run on Ray. plans: the run's RunPlans (spec.py), built in the driver."""
    import ray
    from ray.data import DataContext
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    from dflash_ray.runtime.checkpoints import RunCheckpoints
    from dflash_ray.runtime.training.faults import faults_for_tests
    from dflash_ray.runtime.training.loop import train_loop_per_worker
    from dflash_ray.runtime.stream.node_local import NodeLocalDataConfig
    from dflash_ray.runtime.stream.pipeline import DatasetFactory
    from dflash_ray.runtime.stream.token_store import build_token_store
    from dflash_ray.runtime.progress import Progress

    run_spec = _fresh_coordinator(run_spec)
    c, t = run_spec.cluster, run_spec.train
    coord, record = start_run_actors(run_spec)
    checkpoints = RunCheckpoints(run_spec.experiment_dir)
    t0 = time.time()
    try:   # a previous driver's never-registered checkpoints: whole checkpoints' bytes nothing will read
        removed, error = checkpoints.remove_unregistered(), None
    except OSError as e:  # storage trouble shows (with its own line) when the run next writes there
        removed, error = [], str(e)
    if removed or error:
        ray.get(record.event.remote("unregistered_checkpoints_removed", dirs=list(removed),
                                    **({"error": error} if error else {})))
    store, store_info = build_token_store(run_spec.shards, run_spec.vocab_size, block_mb=c.token_block_mb,
                                          cache_mb=c.token_cache_mb)
    tokens_ref = ray.put(store)
    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False  # our own progress line says what matters; Ray Data's bars flood job logs
    exec_opts = data_ctx.execution_options
    exec_opts.preserve_order = True  # with equal blocks: round-robin over the train workers
    offline = None
    if run_spec.features == "offline":   # the target's pass first, on every target slot (stream/offline.py)
        from dflash_ray.runtime.stream.offline import compute_offline_features

        feed = DatasetFactory(run_spec, plans, tokens_ref, checkpoints).feed()
        offline = compute_offline_features(run_spec, feed.table, tokens_ref)

    def trainer_for(spec):
        return TorchTrainer(
            train_loop_per_worker,
            # threads: cluster.cpu_threads.trainer on CPUs (dflash_ray/threads.py); test_faults: {} outside tests/reliability
            train_loop_config={"spec": spec, "threads": threads_for(c.cpu_threads, "trainer"),
                               "test_faults": faults_for_tests()},
            torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
            # SPREAD: trainer workers over the nodes, so each node's target actors have trainers to feed
            scaling_config=ScalingConfig(num_workers=c.drafter_workers, use_gpu=c.use_gpu, placement_strategy="SPREAD",
                                         resources_per_worker={"GPU": c.drafter_gpus, "CPU": 1} if c.use_gpu
                                         else {"CPU": 1}),
            run_config=RunConfig(
                name=spec.name, storage_path=spec.storage_path,
                checkpoint_config=CheckpointConfig(num_to_keep=t.num_to_keep),
                failure_config=FailureConfig(max_failures=t.max_failures)),
            datasets={"train": ray.data.range(1)},   # a placeholder: the streams are built per node by the config
            dataset_config=NodeLocalDataConfig(DatasetFactory(spec, plans, tokens_ref, checkpoints), exec_opts),
        )

    failure = result = None
    try:
        with Progress(record, enabled=progress):
            for spec in stream_segments(run_spec, plans, checkpoints, record):
                try:
                    result = trainer_for(spec).fit()
                except TrainingFailedError as e:  # Ray Train gave up: after train.max_failures restarts
                    failure = e
                    break
                if result.error is not None or ray.get(record.progress.remote())["stopped"]:
                    break
        report, flight = ray.get([record.report.remote(), coord.report.remote()])
        admits = {k: round(t - report["started"], 3) for k, t in flight.pop("first_admit").items()}
        report = {**report, **flight, "timeline": {**report["timeline"], **admits}, "token_store": store_info.as_dict(),
                  "offline_features": offline, "removed_checkpoints": list(removed)}
        ray.get(record.close.remote())
    finally:
        ray.kill(coord)  # the names are free for a rerun of this run from this process
        ray.kill(record)
    if failure is None and result.error is not None:
        failure = result.error
    if failure is not None:
        raise failure_error(run_spec, failure) from failure
    if report.get("stopped"):
        raise UserError(stopped_message(run_spec, report["stopped"]))
    return FitOutcome(report=report, started=t0, wall_seconds=time.time() - t0)


def stream_segments(run_spec, plans, checkpoints, record):
    """The run as a series of Ray Train fits of at most `train.stream_segment_blocks` stream blocks each (0: one
    fit for the whole run). Ray Data keeps state for every block of a stream (its split coordinator grows
    ~25 KB a block: benchmarks/bench_load.py), so one stream over the 280K one-row blocks of a seed-size GPU
    run would hold ~7 GB; the bound is in blocks, as that is what grows (a CPU run's tiny batches share a
    block 64 at a time and never need a second segment). A segment ends at a step with a checkpoint (the loop
    checkpoints at its last step) and the next fit resumes from it exactly, as a restart does: its cost is a
    worker group's and the target actors' start and a restore (benchmarks/gpu_ray_check.py measures it).
    Yields the spec of each segment (train.max_steps = its last step), each begun in the run record (which
    counts its attempts). ("Segment", not "window": the flight window is the coordinator's bound on batches
    in flight.) `checkpoints`: the run's RunCheckpoints, where each segment starts."""
    import dataclasses

    import ray

    from dflash_ray.runtime.cluster import check_object_stores
    from dflash_ray.runtime.stream.pipeline import node_resources, stream_store_need
    from dflash_ray.runtime.stream.pipeline import DatasetFactory

    feed = DatasetFactory(run_spec, plans, None, checkpoints).feed()   # every epoch's plan built here
    run_end = feed.total_steps
    c = run_spec.cluster
    need = stream_store_need(run_spec, feed, node_resources())
    ray.get(record.event.remote("stream_store_need", **need))
    check_object_stores(need, c.use_gpu, c.target_resource, record)
    ray.get(record.begin_segment.remote(run_end))
    blocks = run_spec.train.stream_segment_blocks
    if blocks <= 0:
        yield run_spec
        return
    per_segment = max(1, blocks * need["rows_per_block"] // run_spec.batches_per_step)
    start, first = None, True
    while True:
        now = checkpoints.latest()[0].step
        if not first and (now >= run_end or now == start):   # done, or the last segment made no progress
            return
        start = now
        end = min(run_end, start + per_segment)
        if not first:
            ray.get(record.begin_segment.remote(run_end))
        first = False
        yield dataclasses.replace(run_spec, train=dataclasses.replace(run_spec.train, max_steps=end))
        if end >= run_end:
            return


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def resume_point(run_spec) -> str:
    """Where a rerun of this run.name starts: the latest checkpoint Ray Train registered (complete)."""
    from dflash_ray.runtime.checkpoints import RunCheckpoints

    try:
        cursor, checkpoint = RunCheckpoints(run_spec.experiment_dir).latest()
    except Exception as e:  # noqa: BLE001 - the storage itself may be what failed
        return f"the run's checkpoints could not be read ({_one_line(e, 120)})"
    if checkpoint is None:
        return "no checkpoint was completed: a rerun of the same run.name starts from step 0"
    return (f"the latest complete checkpoint (step {cursor.step}, {checkpoint}) is intact: rerun the same "
            f"run.name to resume from it")


def _cause(run_spec, failures: list) -> str:
    """The last failure in words: a storage error first (every rank hits it), then a dead worker (the
    others' errors are its echoes), then any other exception."""
    import ray.exceptions

    from dflash_ray.runtime.checkpoints import RunCheckpoints

    storage_dir = RunCheckpoints(run_spec.experiment_dir).storage_path
    for e in failures:   # naming the run's storage, or a full disk that is not the local temporary directory
        if isinstance(e, OSError) and (storage_dir in str(e) or run_spec.experiment_dir in str(e) or (
                e.errno in (errno.ENOSPC, errno.EDQUOT) and "dflash-ckpt-" not in str(e))):
            return (f"a checkpoint could not be written to train.storage_path ({run_spec.storage_path}"
                    f"{_free_space(run_spec.storage_path)}): {_one_line(e)}")
    for e in failures:
        inner = getattr(e, "health_check_failure", e)   # Ray Train's WorkerHealthCheckFailedError
        if isinstance(inner, ray.exceptions.RayActorError):
            return "a trainer worker died (killed, out of memory, or its node lost)"
    for e in failures:
        if isinstance(e, OSError) and "dflash-ckpt-" in str(e):
            return f"a checkpoint could not be written to its local temporary directory: {_one_line(e)}"
    e = failures[0]
    return f"{type(e).__name__}: {_one_line(e)}"


def _free_space(path: str) -> str:
    """', <space> free' for a local path (is its disk full?), else ''."""
    import shutil

    if "://" in str(path):
        return ""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f", {free / 2**30:.1f} GiB free" if free >= 2**30 else f", {free / 2**20:.2f} MiB free"


def failure_error(run_spec, err: Exception) -> UserError:
    """One line for a run Ray Train gave up on; a UserError raised inside a worker is returned as it is."""
    failures = list((getattr(err, "worker_failures", None) or {}).values())
    for e in failures:
        if isinstance(e, UserError):
            return e
    cause = _cause(run_spec, failures) if failures else _one_line(err)
    if failures:  # a WorkerGroupError: Ray Train retries those, up to max_failures
        k = run_spec.train.max_failures
        times = "once" if k == 0 else f"{k + 1} times"
        return UserError(f"training failed {times}, more than train.max_failures={k} allows; the last failure: "
                         f"{cause}; {resume_point(run_spec)}")
    return UserError(f"training failed: {cause}; {resume_point(run_spec)}")


def stopped_message(run_spec, why: dict) -> str:
    if why.get("reason") == "nonfinite":
        return (f"training stopped at step {why['step']}: {why['streak']} steps in a row (steps {why['first_step']}-"
                f"{why['step']}) had a non-finite loss or gradient (loss {why.get('loss')}, grad norm "
                f"{why.get('grad_norm')}), the limit set by train.max_nonfinite_steps={why['limit']}; their "
                f"batches were skipped (no update); {resume_point(run_spec)}")
    if why.get("reason") == "oom":
        return (f"training stopped at step {why['step']}: {why['streak']} steps in a row (steps {why['first_step']}-"
                f"{why['step']}) had a batch that did not fit in device memory even as single rows (buckets "
                f"{why.get('buckets')}), the limit set by train.max_skipped_batches={why['limit']}; their batches "
                f"were skipped (no update): lower model.max_block_tokens_per_batch or data.max_tokens_per_batch, "
                f"or set train.recompute_layers=true; {resume_point(run_spec)}")
    return f"training stopped at step {why.get('step')}: {why}; {resume_point(run_spec)}"
