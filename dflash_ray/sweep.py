"""`dflash-ray tune SPACE... [overrides]`: a sweep on Ray Tune, every trial the project's own run.

    inputs      the data, target and held-out prompts every trial shares (made once, as compare does)
    space       every value (a range: its two ends) composes, and is checked for what it does to the target's
                features: a key that changes them (the taps, the target, the data) splits the sweep into
                cache groups when its values are a grid or a choice, and is refused over a range
    features    the target's pass over every sample, once per cache group and node (runtime/stream/offline.py),
                before any trial starts; every trial then reads its features (train.features=hybrid)
    trials      Ray Tune runs `run_trial` per sample, side by side as the cluster's free resources allow
                (cluster.runs_that_fit; --max-concurrent caps it): the main job (train.main_job) under
                <run.dir>-tune/<trial>/, with its record, ledger, checkpoints, held-out evaluations and summary
    reports     each in-training held-out evaluation (or, with --metric loss and no held-out prompts, every
                --report-every steps) reaches Tune when the run's record writes it: tau, the training loss's
                mean since the last report, tokens; a last report at the end with the tau after training.
                ASHA (--scheduler asha) stops the hopeless trials on the metric
    resume      rerunning the same command resumes the sweep (Tuner.restore): finished trials kept, the
                unfinished ones resumed from their runs' own checkpoints (exactly once, as a single run)

<run.dir>-tune/ holds space.json (the search space, checked at a resume), sweep/ (Ray Tune's state),
features-*/ (the feature passes' records), one run directory per trial (compare's: under run.root), summary.json (the table) and
sweep_<metric>.png (every trial's metric against its training time).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from dflash_ray.errors import UserError
from dflash_ray.search_space import Dimension, format_value, override, trial_count

METRICS = {"tau": "max", "loss": "min"}   # the metric a sweep ranks by, and which way is better
STATE = "sweep"                           # Ray Tune's experiment, under <run.dir>-tune/
SETTING = "setting"                       # compare's one dimension: the index of a trial's settings


# ----------------------------------------------------------------------------- what a trial reports
def report_rows(metrics: list[dict], evals: list[dict], *, every: int, evaluations: bool, after: int = 0) -> list[dict]:
    """The reports a trial owes Tune, in order, from its run's metrics.jsonl and evals.jsonl rows, after step
    `after` (the last one sent). With evaluations: one per held-out evaluation whose step has its metrics;
    else one every `every` steps. Each: the step, the mean training loss of the steps since the previous
    report, the context tokens and training seconds up to the step, and the evaluation's tau."""
    by_step = {int(m["step"]): m for m in metrics}   # a step logged again after a restart: its last line
    if not by_step:
        return []
    last = max(by_step)
    if evaluations:
        points = sorted({int(e["step"]): e for e in evals if after < int(e["step"]) <= last}.items())
    else:
        points = [(s, None) for s in range((after // every + 1) * every, last + 1, every)]
    rows, prev = [], after
    for step, ev in points:
        rows.append(report_row(by_step, prev, step, ev))
        prev = step
    return rows


def report_row(by_step: dict, prev: int, step: int, ev: dict | None) -> dict:
    window = [by_step[s]["loss"] for s in sorted(by_step) if prev < s <= step]
    upto = [by_step[s] for s in sorted(by_step) if s <= step]
    row = {"step": step, "loss": float(sum(window) / len(window)) if window else float("nan"),
           "tokens": int(sum(m.get("tokens", 0) for m in upto)),
           "train_seconds": round(float(sum(m.get("step_seconds", 0.0) for m in upto)), 3)}
    if ev is not None:
        row["tau"] = float(ev["tau"])
    return row


def final_row(metrics: list[dict], summary: dict, *, every: int) -> dict:
    """The last report: the run's last step, the mean loss of its last `every` steps, and the held-out tau
    after training (on every held-out prompt), when measured."""
    by_step = {int(m["step"]): m for m in metrics}
    last = max(by_step) if by_step else 0
    row = report_row(by_step, max(0, last - every), last, None) if by_step else {"step": 0}
    tau = ((summary.get("heldout_tau") or {}).get("trained") or {}).get("tau")
    if tau is not None:
        row["tau"] = float(tau)
    row["final"] = 1
    return row


@dataclass
class TrialSetup:
    """What every trial shares: the base overrides (the user's and the shared inputs'), where trials live, the
    searched keys, how it reports."""
    base: list[str]
    root: str
    keys: list[str]
    every: int
    evaluations: bool
    cwd: str = "."                            # the driver's: relative paths in the overrides mean the same here
    settings: list[list[str]] | None = None   # compare: each trial's overrides, by config[SETTING]
    names: list[str] | None = None            # compare: each setting's run name
    name: str = "sweep"                       # tune: trials are <name>-<index>

    def overrides(self, config: dict) -> list[str]:
        if self.settings is not None:
            return list(self.settings[int(config[SETTING])])
        return [override(k, config[k]) for k in self.keys]

    def trial_name(self, trial) -> str:
        """The trial's run name (its run directory and Ray Train experiment)."""
        if self.names is not None:
            return self.names[int(trial.config[SETTING])]
        return f"{self.name}-{trial.trial_id.rsplit('_', 1)[-1]}"


def run_trial(config: dict, setup: TrialSetup) -> None:
    """One trial: the main job on this trial's values, its reports sent to Tune while it trains (a thread
    beside it reads the run's record files as they are written), then the last report. A rerun of the same
    trial (a resumed sweep) resumes its run from the run's own checkpoint and sends its reports again from
    the first."""
    import os

    from ray import tune

    from dflash_ray.config import compose_config
    from dflash_ray.run_layout import RunLayout
    from dflash_ray.runtime.record.ledger import read_jsonl
    from dflash_ray.train import main_job

    if os.path.isdir(setup.cwd):   # Ray Tune starts a trial in a directory of its own
        os.chdir(setup.cwd)
    name = tune.get_context().get_trial_name()
    cfg = compose_config([*setup.base, f"run.root={setup.root}", f"run.name={name}", *setup.overrides(config)])
    layout = RunLayout(str(cfg.run.dir))
    layout.root.mkdir(parents=True, exist_ok=True)
    log_file = open(layout.root / "trial.log", "a", buffering=1)

    def log(*a, **_):
        print(*a, file=log_file)

    sent = {"step": 0}
    lock = threading.Lock()

    def forward():
        with lock:
            rows = report_rows(read_jsonl(layout.metrics), read_jsonl(layout.evals), every=setup.every,
                               evaluations=setup.evaluations, after=sent["step"])
            for row in rows:
                tune.report(row)
                sent["step"] = row["step"]

    stop = threading.Event()

    def watch():
        while not stop.wait(0.5):
            if stopped_by_tune():
                # ASHA (or Ctrl-C) stopped the trial: Tune ends its session and drops the trial, but the run goes
                # on in this process and holds its workers' and target actors' resources, which the next trial
                # then waits for (its worker group timed out). Ending the process ends everything it owns; the
                # run's record and checkpoints stay, as a killed run's do. Its worker group's placement group is
                # the job's, not the process's: removed here, or its CPUs/GPUs stay reserved after the exit.
                remove_placement_groups(read_jsonl(layout.events))
                os._exit(0)
            forward()

    watcher = threading.Thread(target=watch, name="tune-reports", daemon=True)
    watcher.start()
    try:
        _, summary = main_job(cfg, progress=False, log=log, plan_log=log)
    finally:
        stop.set()
        watcher.join()
        log_file.close()
    forward()
    tune.report(final_row(read_jsonl(layout.metrics), summary, every=setup.every))


def train_seconds(metrics: list[dict]) -> float:
    """Seconds of training steps (each step's step_seconds: data waits and compute; evaluations, which run
    beside training in their own task, and start-up are not in it)."""
    return float(sum(m.get("step_seconds", 0.0) for m in metrics))


def tau_curve(metrics: list[dict], evals: list[dict]) -> list[dict]:
    """Each in-training held-out tau with the training seconds and context tokens up to its step."""
    secs, toks, out = {}, {}, []
    s = t = 0.0
    for m in metrics:
        s += m.get("step_seconds", 0.0)
        t += m.get("tokens", 0)
        secs[int(m["step"])], toks[int(m["step"])] = s, t
    for e in evals:
        step = int(e["step"])
        if step in secs:
            out.append({"step": step, "tau": e["tau"], "train_seconds": secs[step], "tokens": int(toks[step])})
    return out


def remove_placement_groups(events: list[dict]) -> None:
    """Remove the placement groups the run's worker groups reserved (events.jsonl's worker_placement_group)."""
    import ray
    from ray.util.placement_group import PlacementGroup

    for e in events:
        if e.get("event") == "worker_placement_group":
            try:
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(e["id"]))))
            except Exception:   # noqa: BLE001 - already removed (an earlier attempt's group)
                pass


def stopped_by_tune() -> bool:
    """Whether Ray Tune has stopped this trial: it shuts the trial's session down (Ray 2.60: the session is
    gone; ray.tune has no public call that says so)."""
    from ray.train._internal.session import get_session

    return get_session() is None


# ----------------------------------------------------------------------------- the space, checked
def feature_identity(spec) -> tuple:
    """What decides the target's features (the cache's key, runtime/stream/feature_cache.cache_key): the
    target, the taps, the dtype, the shards."""
    return (spec.target_path, tuple(spec.drafter.target_layer_ids), spec.compute_dtype, spec.shards)


def cache_groups(dims: list[Dimension], identity_of) -> list[list[str]]:
    """The sweep's cache groups: one list of overrides per combination of the values of the keys that change
    the target's features (a grid or a choice); [[]] when no key does. identity_of(overrides) -> the
    features' identity of the base config with those overrides. A range over such a key is refused."""
    import itertools

    here = identity_of([])
    changing = []
    for d in dims:
        # every value composes and resolves (a typo or a value out of bounds: one line now, before anything runs)
        ids = [identity_of([f"{d.key}={value}"]) for value in d.candidates()]
        if any(i != here for i in ids):
            if d.kind not in ("grid", "choice"):
                raise UserError(f"tune: '{d.key}' changes the target's features (the taps, the target or the data), "
                                f"which a sweep computes once: give its values as a grid or a choice (one cache "
                                f"group each), not {d.kind}(...)")
            changing.append(d)
    if not changing:
        return [[]]
    return [[f"{d.key}={v}" for d, v in zip(changing, combo)]
            for combo in itertools.product(*(d.values for d in changing))]


# ----------------------------------------------------------------------------- the sweep
@dataclass
class SweepOptions:
    samples: int = 1
    metric: str = "tau"
    scheduler: str = "asha"
    max_concurrent: int | None = None
    grace: int = 2
    report_every: int | None = None


def tune_space(dims: list[Dimension]) -> dict:
    from ray import tune

    make = {"grid": lambda d: tune.grid_search(list(d.values)), "choice": lambda d: tune.choice(list(d.values)),
            "uniform": lambda d: tune.uniform(d.low, d.high), "loguniform": lambda d: tune.loguniform(d.low, d.high),
            "randint": lambda d: tune.randint(int(d.low), int(d.high))}
    return {d.key: make[d.kind](d) for d in dims}


def scheduler_for(opts: SweepOptions):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if opts.scheduler == "none":
        return FIFOScheduler()
    # training_iteration: the trial's reports, one per evaluation (or --report-every steps), the same cadence
    # in every trial; max_t only bounds the rungs (a trial ends when its run does)
    return ASHAScheduler(time_attr="training_iteration", max_t=10**6, grace_period=opts.grace, reduction_factor=3)


def sweep(cfg, dims: list[Dimension], overrides: list[str], opts: SweepOptions, *, log=print,
          settings: list[list[str]] | None = None, names: list[str] | None = None, out_suffix: str = "-tune",
          features: bool = True) -> dict:
    """Run (or resume) a sweep; returns its result ({"rows": [...], "best": row or None, "dir": ...}), also
    written to <run.dir><out_suffix>/summary.json with a PNG of every trial's metric against training time.
    The trials: the search space `dims` (run names <run.name>-<index> under the sweep's directory), or, for
    compare, `settings` (each trial's overrides) named `names` (under run.root, as single runs are).
    features: one feature pass for every trial (tune); False: the trials' train.features as configured."""
    import os

    from omegaconf import OmegaConf

    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import make_demo_inputs, make_missing_inputs
    from dflash_ray.runtime.cluster import ray_cluster, runs_that_fit
    from dflash_ray.runtime.spec import resolve_spec

    if opts.metric not in METRICS:
        raise UserError(f"tune: --metric {opts.metric}: one of {', '.join(METRICS)}")
    out_dir = Path(str(cfg.run.dir) + out_suffix).resolve()
    base_overrides = [o for o in overrides if not o.startswith(("run.name=", "run.root=", "run.dir="))]
    space = {"space": [str(d) for d in dims] if settings is None else settings, "samples": opts.samples,
             "metric": opts.metric, "scheduler": opts.scheduler}
    space_file = out_dir / "space.json"
    if space_file.exists() and json.loads(space_file.read_text()) != space:
        raise UserError(f"{out_dir} holds a sweep of another space ({space_file}): resume it with the same "
                        f"command, or give another run.name")
    cluster = OmegaConf.to_object(cfg.cluster)
    with ray_cluster(cluster, log=log, runs=max(1, opts.max_concurrent or 1)):
        make_demo_inputs(cfg, log=log)
        make_missing_inputs(cfg, log=log)
        base = resolve_spec(cfg, log=lambda *a, **k: None, record=False)
        shared = [f"data.input={cfg.data.input}", f"data.tokenizer={base.tokenizer}", f"data.shards={base.shards}",
                  f"model.target_path={base.target_path}"]
        if base.heldout:
            shared.append(f"data.prompts={base.heldout}")
        evaluations = bool(base.heldout) and base.train.heldout_every > 0
        if opts.metric == "tau" and not evaluations:
            raise UserError("tune: --metric tau needs held-out prompts (data.prompts, or the held-out slice prepare "
                            "writes) and train.heldout_every > 0 (the evaluations it reports); or use --metric loss")
        trial_base = [*base_overrides, *shared]
        online = not features or features_online(trial_base, base_overrides, log=log)
        if features and not online:
            trial_base.append("train.features=hybrid")

        def identity_of(extra):
            c = compose_config([*trial_base, "train.features=online", *extra])
            return feature_identity(resolve_spec(c, log=lambda *a, **k: None, record=False))

        groups = cache_groups(dims, identity_of) if settings is None else [[]]
        out_dir.mkdir(parents=True, exist_ok=True)
        space_file.write_text(json.dumps(space, indent=2))
        holds = runs_that_fit(cluster)
        concurrent = min(holds, opts.max_concurrent) if opts.max_concurrent else holds
        n = trial_count(dims, opts.samples) if settings is None else len(settings)
        what = ", ".join(d.key for d in dims) if settings is None else "the compared settings"
        log(f"tune: {n} trial(s) over {what}, {concurrent} at a time (the cluster holds {holds} run(s) at once), "
            f"metric {opts.metric} ({METRICS[opts.metric]}), scheduler {opts.scheduler}; under {out_dir}")
        passes = [] if online else feature_passes(trial_base, groups, out_dir, cfg.run.name, log=log)
        setup = TrialSetup(base=trial_base, root=str(out_dir) if settings is None else str(Path(cfg.run.root).resolve()),
                           keys=[d.key for d in dims], every=opts.report_every or base.train.heldout_every or 10,
                           evaluations=evaluations, settings=settings, names=names, name=str(cfg.run.name),
                           cwd=os.getcwd())
        space_param = tune_space(dims) if settings is None else {SETTING: _grid(list(range(len(settings))))}
        grid = run_tuner(space_param, setup, opts, out_dir, concurrent, log=log)
    rows = result_rows(grid, dims, out_dir, setup)
    best = best_row(rows, opts.metric)
    # an interrupt leaves trials running, or not yet made (Ray Tune makes a trial when it can start it)
    unfinished = sum(r["status"] == "unfinished" for r in rows) + max(0, n - len(rows))
    result = {"space": space, "dir": str(out_dir), "concurrent": concurrent, "feature_passes": passes,
              "rows": rows, "best": best, "unfinished": unfinished}
    if unfinished:
        log(f"tune: interrupted with {unfinished} trial(s) unfinished: rerun the same command to resume (finished "
            f"trials are kept, the others resume from their runs' checkpoints)")
    result["png"] = str(plot_trials(rows, out_dir, opts.metric, setup))
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2))
    return result


def _grid(values):
    from ray import tune

    return tune.grid_search(values)


def features_online(trial_base: list[str], user: list[str], *, log=print) -> bool:
    """Whether the trials run online: only when the user says so (train.features=online on the command line)
    or the cache cannot hold the corpus (the line why). Otherwise hybrid, whatever the preset says: a sweep's
    trials all read the features one pass computed."""
    from dflash_ray.config import compose_config
    from dflash_ray.runtime.spec import resolve_spec

    if any(o.replace(" ", "") == "train.features=online" for o in user):
        log("tune: train.features=online: every trial computes the target's features itself")
        return True
    try:
        resolve_spec(compose_config([*trial_base, "train.features=hybrid"]), log=lambda *a, **k: None, record=False)
    except UserError as e:
        if "train.features" not in str(e):
            raise
        log(f"tune: the trials run online, every one computing the target's features: {e}")
        return True
    return False


def feature_passes(trial_base: list[str], groups: list[list[str]], out_dir: Path, name: str, *, log=print) -> list:
    """The target's features of every cache group, computed once per node before the trials start."""
    import ray

    from dflash_ray.config import compose_config
    from dflash_ray.runtime.fit import start_run_actors
    from dflash_ray.runtime.spec import resolve_spec

    out = []
    for i, group in enumerate(groups):
        cfg = compose_config([*trial_base, *group, f"run.root={out_dir}", f"run.name={name}-features-{i}"])
        spec = resolve_spec(cfg, log=lambda *a, **k: None, record=False)
        coord, record = start_run_actors(spec)   # the target actors report to a record of the pass's own
        try:
            nodes = fill_feature_cache(spec, log=lambda m: log(f"tune: {' '.join(group) or 'features'}: {m}"))
            ray.get(record.close.remote())
        finally:
            ray.kill(coord)
            ray.kill(record)
        out.append({"group": group, "key": spec.feature_cache, "nodes": nodes})
    return out


def fill_feature_cache(run_spec, log=print) -> list[dict]:
    """The target's pass over every sample of the run's first epoch into the feature cache of every node that
    can host a target actor, one node after the other (runtime/stream/offline.py pins each pass to its
    node), so that a trial on any node reads every feature (train.features=hybrid) instead of computing it.
    The run's record and coordinator must be up (start_run_actors). Returns each node's counts."""
    import ray

    from dflash_ray.runtime.checkpoints import RunCheckpoints
    from dflash_ray.runtime.spec import RunPlans
    from dflash_ray.runtime.stream.offline import compute_offline_features
    from dflash_ray.runtime.stream.pipeline import DatasetFactory, node_resources, target_room
    from dflash_ray.runtime.stream.token_store import build_token_store

    c = run_spec.cluster
    store, _ = build_token_store(run_spec.shards, run_spec.vocab_size, block_mb=c.token_block_mb,
                                 cache_mb=c.token_cache_mb)
    tokens_ref = ray.put(store)
    feed = DatasetFactory(run_spec, RunPlans(run_spec), tokens_ref, RunCheckpoints(run_spec.experiment_dir)).feed()
    nodes = [n for n, total in sorted(node_resources().items()) if target_room(c, total, 0) > 0]
    if not nodes:
        raise UserError(f"tune: no node can host a target actor for the feature pass: nodes {node_resources()}")
    return [compute_offline_features(run_spec, feed.table, tokens_ref, log=log, node_id=n) for n in nodes]


def run_tuner(space_param: dict, setup: TrialSetup, opts: SweepOptions, out_dir: Path, concurrent: int, *, log=print):
    from ray import tune

    import os

    # Ray Tune's own console (a banner, a table every few seconds, a TensorBoard hint): the sweep prints its lines
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": 0.01})
    state = out_dir / STATE
    if tune.Tuner.can_restore(str(state)):
        log(f"tune: resuming the sweep at {state}: finished trials kept, unfinished ones resume their runs")
        tuner = tune.Tuner.restore(str(state), trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable, param_space=space_param,
            tune_config=tune.TuneConfig(metric=opts.metric, mode=METRICS[opts.metric], num_samples=opts.samples,
                                        scheduler=scheduler_for(opts), max_concurrent_trials=concurrent,
                                        trial_name_creator=setup.trial_name, trial_dirname_creator=setup.trial_name),
            run_config=tune.RunConfig(name=STATE, storage_path=str(out_dir), verbose=0,
                                      callbacks=[trial_lines(log, opts.metric)],
                                      failure_config=tune.FailureConfig(max_failures=0)))
    return tuner.fit()


def trial_lines(log, metric):
    """A Tune callback: one line per trial that ends (Ray Tune's own table is off: verbose=0)."""
    from ray.tune import Callback

    class TrialLines(Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            r = trial.last_result or {}
            how = "finished" if r.get("final") else f"stopped by the scheduler after {r.get('training_iteration')} report(s)"
            log(f"tune: {trial} {how}: step {r.get('step')}, {metric} {_num(r.get(metric))}")

        def on_trial_error(self, iteration, trials, trial, **info):
            log(f"tune: {trial} failed: {error_line(str(trial.get_error() or ''))}")

    return TrialLines()


def _num(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def error_line(text: str) -> str:
    """A trial's error in one line: the project's own (UserError) line where there is one, else the last line."""
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    for x in reversed(lines):
        if "UserError: " in x:
            return x.split("UserError: ", 1)[1]
    return lines[-1] if lines else "(no message)"


def result_rows(grid, dims, out_dir: Path, setup: TrialSetup) -> list[dict]:
    """One row per trial: its values, how it ended (finished; stopped by the scheduler; failed; unfinished, when
    the sweep was interrupted) and its last report."""
    from ray.tune import ExperimentAnalysis

    # each trial's status in the sweep's saved state, what a resume starts from (RUNNING or PENDING: unfinished);
    # the ResultGrid's trials all read TERMINATED once an interrupted sweep has stopped them
    statuses = {str(t): t.status for t in ExperimentAnalysis(str(out_dir / STATE)).trials}
    rows = []
    for r in grid:
        m = r.metrics or {}
        name = Path(r.path).name if r.path else None
        status = ("failed" if r.error else "finished" if m.get("final")
                  else "unfinished" if statuses.get(name) in ("RUNNING", "PENDING", "PAUSED") else "stopped")
        values = ({d.key: format_value(r.config.get(d.key)) for d in dims} if setup.settings is None
                  else {SETTING: " ".join(setup.settings[int(r.config[SETTING])])})
        rows.append({"trial": name, **values, "status": status,
                     "reports": m.get("training_iteration"), "step": m.get("step"), "loss": m.get("loss"),
                     "tau": m.get("tau"), "tokens": m.get("tokens"), "train_seconds": m.get("train_seconds"),
                     "run_dir": str(Path(setup.root) / name) if name else None,
                     "error": error_line(r.error) if r.error else None})
    return sorted(rows, key=lambda x: str(x["trial"]))


def best_row(rows: list[dict], metric: str) -> dict | None:
    """The finished trial with the best metric (its last report: after training); None if none finished."""
    done = [r for r in rows if r["status"] == "finished" and r.get(metric) is not None]
    if not done:
        return None
    return (max if METRICS[metric] == "max" else min)(done, key=lambda r: r[metric])


def plot_trials(rows: list[dict], out_dir: Path, metric: str, setup: TrialSetup) -> Path:
    """sweep_<metric>.png: every trial's reports (held-out tau, or the training loss) against its training
    seconds, read back from its run's record as the trial reported them; a stopped trial's line ends early."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash_ray.run_layout import RunLayout
    from dflash_ray.runtime.record.ledger import read_jsonl

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in rows:
        if not r["run_dir"]:
            continue
        layout = RunLayout(r["run_dir"])
        points = report_rows(read_jsonl(layout.metrics), read_jsonl(layout.evals), every=setup.every,
                             evaluations=setup.evaluations)
        points = [p for p in points if p.get(metric) is not None]
        if r["status"] == "finished" and r.get(metric) is not None and r.get("train_seconds") is not None:
            points.append({"train_seconds": r["train_seconds"], metric: r[metric]})   # after training
        if points:
            ax.plot([p["train_seconds"] for p in points], [p[metric] for p in points], marker="o", ms=3, lw=1,
                    label=f"{r['trial']} ({r['status']})")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("held-out tau" if metric == "tau" else "training loss (mean since the last report)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"sweep_{metric}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_rows(result: dict, dims) -> str:
    keys = [d.key for d in dims] or [SETTING]
    head = ["trial", *keys, "status", "step", "loss", "tau", "tokens", "train s"]
    table = [[str(r["trial"]), *(str(r[k]) for k in keys), r["status"], str(r["step"] if r["step"] is not None else "-"),
              _num(r["loss"]), _num(r["tau"]), str(r["tokens"] if r["tokens"] is not None else "-"),
              "-" if r["train_seconds"] is None else f"{r['train_seconds']:.0f}"] for r in result["rows"]]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    best = result["best"]
    if result.get("unfinished"):
        lines.append(f"{result['unfinished']} trial(s) unfinished (interrupted): rerun the same command to resume")
    if best:
        lines.append(f"best by {result['space']['metric']}: {best['trial']} "
                     f"({', '.join(f'{k}={best[k]}' for k in keys)}): its drafter is {best['run_dir']}/export")
    else:
        lines.append("no trial finished")
    lines.append(f"table: {result['dir']}/summary.json; curves: {result['png']}")
    return "\n".join(lines)
