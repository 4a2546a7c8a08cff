"""The run's place on a Ray cluster: connect to one (or start a local one), check it can hold the run,
and start the run's actors (coordinator, record) on the driver's node."""
from __future__ import annotations

import contextlib
import json
import os

from dflash_ray.errors import UserError

STATE_TRACKING = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}   # the dashboard's Train view
WORKER_NICENESS = "RAY_worker_niceness"   # Ray's config for its workers' niceness (default 15), read from the environment
HEALTH_CHECK = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"   # how often Ray Train's controller looks at its workers
# Ray kills an idle worker process after 1 s once more than num_cpus are idle, and starts a new one (a Python
# that imports Ray again, ~1.5 CPU-s) for the next task: a fit's Ray Data tasks and Train's helper actors
# churned through ~19 fresh processes. A local Ray (the run's own machine) keeps idle workers for reuse.
KEEP_IDLE_WORKERS = {"RAY_num_workers_soft_limit": "64", "RAY_idle_worker_killing_time_threshold_ms": "600000"}
AUTH_MODE = "RAY_AUTH_MODE"   # Ray 2.60's token authentication: token | disabled


def token_on_this_machine() -> bool:
    """Whether this machine holds a Ray auth token where Ray looks for one (RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token): the cluster it started (scripts/ray-start.sh) uses it."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return os.path.isfile(path)


def choose_auth_mode() -> str | None:
    """RAY_AUTH_MODE where the user left it unset: token, with this machine's token, or the one Ray's own CLI makes
    when it has none (`ray get-auth-token --generate`: ~/.ray/auth_token). A local Ray the job starts then keeps
    token auth, Ray's default, without the warning Ray prints when left to choose; a driver joining a cluster
    started with token auth (scripts/ray-start.sh) sends the token, which Ray 2.60 does only in token mode (a
    cluster without token auth accepts it too). Ray reads the mode once per process: the process's entry calls
    this before Ray is imported (cli.console_main). Returns the mode set, or None (the user's, or Ray's default)."""
    if os.environ.get(AUTH_MODE):
        return None
    if not token_on_this_machine() and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        _generate_token()
    if token_on_this_machine():
        os.environ[AUTH_MODE] = "token"
        return "token"
    return None


def _generate_token() -> None:
    """Ray's own `ray get-auth-token --generate` (the `ray` beside this Python): quietly; where it fails, Ray's
    default stays (it makes the token itself, and warns)."""
    import subprocess
    import sys

    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    try:
        subprocess.run([ray_cli if os.path.exists(ray_cli) else "ray", "get-auth-token", "--generate"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError):
        pass


@contextlib.contextmanager
def ray_cluster(cluster, log=print, runs: int = 1):
    """Connect to cluster.address / $RAY_ADDRESS, or start a local Ray (shut down again on exit).
    `cluster` is the typed cluster config. Yields the Ray session's log directory (None when Ray was
    already connected): where Ray's own messages are, which its INFO lines no longer print (--debug: they do).
    runs: how many runs the local Ray must hold at once (a sweep's concurrent trials: its target resource)."""
    import logging

    import ray

    from dflash_ray.console import debug_console

    os.environ.update(STATE_TRACKING)  # a local Ray inherits it
    if ray.is_initialized():
        yield None
        return
    level = logging.INFO if debug_console() else logging.WARNING
    runtime_env = {"env_vars": dict(STATE_TRACKING)}
    address = cluster.address
    if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]  # inside `ray job submit`, or set by the user
    if address:
        in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ  # the job's runtime_env applies (jobs/)
        context = _ray_init(f"could not connect to Ray at {address}",
                            "is the cluster up (`ray status --address <head>:6379`)? Or leave cluster.address and "
                            "$RAY_ADDRESS unset for a local Ray",
                            address=address, runtime_env=None if in_job else runtime_env, log_to_driver=True,
                            logging_level=level)
        log(f"connected to Ray at {address}")
        yield _logs_dir(context)
        return
    stages = getattr(cluster, "target_gpus_per_replica", 1)
    resources = {} if cluster.use_gpu else {cluster.target_resource: float(cluster.target_workers * stages * runs)}
    # Ray runs its workers at niceness 15 so that its own daemons come first; on a machine shared with other
    # work that hands the run's CPU to any nice-0 process: beside one busy loop the drafter's training ran
    # 4.4x slower (1,060 vs 4,700 tokens/s, benchmarks/bench_first_run.py). A local Ray is the run's own:
    # its workers get the driver's priority (a value set by the user wins).
    os.environ.setdefault(WORKER_NICENESS, "0")
    # Ray Train's controller looks at its workers every 2 s by default, and a fit's start and end each wait a
    # look or two (~4 s of a fit's tail, measured in the tests): on the run's own machine, every 0.5 s
    os.environ.setdefault(HEALTH_CHECK, "0.5")
    for key, value in KEEP_IDLE_WORKERS.items():
        os.environ.setdefault(key, value)
    # a sweep's local Ray holds `runs` runs: its logical CPUs too (oversubscribed, as a single run's are)
    num_cpus = cluster.num_cpus if runs == 1 else (cluster.num_cpus or os.cpu_count() or 1) * runs
    start = f"scripts/ray-start.sh --head --num-cpus {num_cpus}" + (
        f" --resources '{json.dumps(resources)}'" if resources else "")
    context = _ray_init("a local Ray did not start",
                        "retry when the machine is less busy (Ray waits 30 s for its node's processes), or start Ray "
                        f"once with `{start}` and run with cluster.address=auto",
                        num_cpus=num_cpus, object_store_memory=cluster.object_store_memory,
                        resources=resources, runtime_env=runtime_env, log_to_driver=False, logging_level=level)
    logs = _logs_dir(context)
    log(f"started a local Ray ({num_cpus} CPUs, resources {resources or 'GPUs'}; its logs: {logs})")
    try:
        yield logs
    finally:
        ray.shutdown()


def _logs_dir(context) -> str | None:
    """The Ray session's log directory, from what ray.init returned."""
    session = (getattr(context, "address_info", None) or {}).get("session_dir")
    return os.path.join(session, "logs") if session else None


def _ray_init(what: str, advice: str, **kwargs):
    """ray.init (its RayContext returned), its failure one line (what happened, Ray's first line, what to do)
    instead of Ray's traceback: e.g. a local node that did not come up within Ray's 30 s on a loaded machine."""
    import ray

    try:
        return ray.init(**kwargs)
    except Exception as e:   # noqa: BLE001 - Ray raises bare Exception, RuntimeError, ConnectionError
        ray.shutdown()   # the processes a half-started local Ray left
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{what} ({said}): {advice}") from e


def run_need(cluster) -> dict:
    """What one run asks of the cluster: its GPUs (target replicas' stages and drafter workers), or on CPUs
    its target resource's slots, and its CPUs (trainers 1 each, target actors 1 on a GPU or 0.5 on CPUs, a
    token-join task 0.25)."""
    c = cluster
    k = getattr(c, "target_gpus_per_replica", 1)   # a target replica's stages, each an actor's share
    need = {"CPU": c.drafter_workers + c.target_workers * k * (1 if c.use_gpu else 0.5) + 0.25}
    if c.use_gpu:
        need["GPU"] = c.target_workers * c.target_gpus * k + c.drafter_workers * c.drafter_gpus
    else:
        need[c.target_resource] = float(c.target_workers * k)
    return need


def check_resources(cluster) -> None:
    """Fail before training when the cluster cannot place the actors (rather than hanging)."""
    import ray

    total = ray.cluster_resources()
    c = cluster
    k = getattr(c, "target_gpus_per_replica", 1)
    need = run_need(c)
    if c.use_gpu:
        if total.get("GPU", 0) < need["GPU"] - 1e-9:
            replica = f" x {k} (cluster.target_gpus_per_replica)" if k > 1 else ""
            raise UserError(f"cluster has {total.get('GPU', 0):g} GPUs but cluster.target_workers x target_gpus"
                            f"{' x target_gpus_per_replica' if k > 1 else ''} + cluster.drafter_workers x drafter_gpus = "
                            f"{c.target_workers} x {c.target_gpus:g}{replica} + {c.drafter_workers} x {c.drafter_gpus:g} = {need['GPU']:g}")
    elif total.get(c.target_resource, 0) < need[c.target_resource]:
        raise UserError(f"cluster has {total.get(c.target_resource, 0):g} of resource '{c.target_resource}' "
                        f"but cluster.target_workers{' x target_gpus_per_replica' if k > 1 else ''} = "
                        f"{c.target_workers * k} (start Ray with "
                        f"--resources '{{\"{c.target_resource}\": {c.target_workers * k}}}')")
    if total.get("CPU", 0) < need["CPU"]:
        raise UserError(f"cluster has {total.get('CPU', 0):g} CPUs but cluster.drafter_workers = "
                        f"{c.drafter_workers} and cluster.target_workers = {c.target_workers} need "
                        f"{need['CPU']:g} (on one machine, raise cluster.num_cpus: oversubscribing is fine)")


def runs_that_fit(cluster) -> int:
    """How many runs of this cluster config the cluster's free resources hold at once (a sweep's concurrent
    trials): the fewest copies of run_need that any of its free resources holds, at least 1."""
    import ray

    total = ray.available_resources()
    return max(1, min(int(total.get(key, 0.0) / amount + 1e-9) for key, amount in run_need(cluster).items()
                      if amount > 0))


def cap_gpu_memory(share: float) -> None:
    """A process holding a share (< 1) of a GPU may allocate only that share of its memory, so a target
    actor and a drafter worker on one GPU cannot starve each other. No-op without CUDA or for a whole GPU."""
    import torch

    if share < 1 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(share), torch.cuda.current_device())


def _shm_bytes() -> int | None:
    """/dev/shm's size on this node (None where there is none)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


def node_stores(use_gpu: bool, target_resource: str) -> dict:
    """node id -> {"store": object store bytes, "shm": /dev/shm bytes, "ip"} of the alive nodes that can host
    the stream's work (GPUs, or the target resource on CPU clusters), /dev/shm read on each node by a task."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    key = "GPU" if use_gpu else target_resource
    nodes = {n["NodeID"]: {"store": n["Resources"].get("object_store_memory", 0), "ip": n.get("NodeManagerAddress")}
             for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(key)}
    probe = ray.remote(num_cpus=0)(_shm_bytes)
    refs = {node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in nodes}
    for node, ref in refs.items():
        nodes[node]["shm"] = ray.get(ref, timeout=60)
    return nodes


def check_object_stores(need: dict, use_gpu: bool, target_resource: str, record=None, log=print) -> list[str]:
    """Fail before training when a node's object store cannot hold the stream's blocks (one line naming the
    node and the fix); warn (printed, and an event in the run record) where the store is on disk because
    /dev/shm is smaller than it. Returns the warnings."""
    from dflash_ray.sizing.object_store import store_problems

    errors, warnings = store_problems(need, node_stores(use_gpu, target_resource))
    if errors:
        raise UserError(errors[0])
    for w in warnings:
        log(w)
        if record is not None:
            record.event.remote("object_store_on_disk", message=w)
    return warnings
