"""Experiment trackers: TensorBoard, MLflow, Weights & Biases (`train.trackers=[...]`). (Long on purpose:
the three adapters behind one interface, so the run record calls one object whichever are chosen.)

One place logs: the run record (its actor on the driver's node), where metrics.jsonl is written. Each
committed step's scalars go to every chosen tracker, the run's resolved config as parameters, held-out
tau as it is measured; at the end the driver adds the export and the best drafter as artifacts (where the
tracker has them) and the run's final status.

The rule for restarts (trackers cannot rewind: W&B refuses a step lower than its last, MLflow would keep
both values): **a step is logged once, when its first metrics.jsonl line is written.** A step trained
again after a restart (the steps after the checkpoint the group resumed from) or a rerun of the same
run.name that replays steps is not logged again; the trackers keep the first values. The replay trains
the same batches from the same weights (bit for bit on the CPU, within float tolerance on a GPU), so the
curves are the same; only the timings differ, and the restart itself shows as `train/attempt` and
`train/failures_survived` rising at the next new step. metrics.jsonl keeps every record (`attempt`).

A rerun of the same run.name continues the same tracker runs: their ids are kept in
`<run.dir>/trackers.json`.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from dataclasses import asdict, is_dataclass
from pathlib import Path

from dflash_ray.config import chosen_trackers as chosen  # noqa: F401  (trackers.chosen: checked where the config is)
from dflash_ray.errors import UserError
from dflash_ray.run_layout import TRACKERS as STATE   # the trackers' run ids, for a resumed run
from dflash_ray.run_layout import RunLayout

# what each tracker imports, and the extra that installs it
NEEDS = {"tensorboard": (("tensorboardX",), "tensorboard"), "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow"),
         "wandb": (("wandb",), "wandb")}


# ----------------------------------------------------------------------------- choice and checks


def check_installed(names) -> None:
    """A chosen tracker that is not installed: one line naming the pip extra."""
    import importlib.util

    for n in names:
        modules, extra = NEEDS[n]
        for module in modules:
            if importlib.util.find_spec(module) is None:
                raise UserError(f"config key 'train.trackers': {n} is chosen but the '{module}' package is not "
                                f"installed: pip install 'dflash-ray[{extra}]' (or '.[trackers]' in a checkout)")


def options(train, run_dir) -> dict:
    """Where each tracker writes, from the train config (plain values: the run record gets them)."""
    return {"project": str(getattr(train, "tracker_project", None) or "dflash-ray"),
            "mlflow_tracking_uri": mlflow_uri(getattr(train, "mlflow_tracking_uri", None), run_dir),
            "wandb_mode": getattr(train, "wandb_mode", None)}


def mlflow_uri(configured, run_dir) -> str:
    """train.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite store beside the run directory
    (<run.dir>/../mlflow.db: every run of one run.root in one store, `mlflow ui` compares them)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return str(uri)
    return f"sqlite:///{Path(run_dir).resolve().parent / 'mlflow.db'}"


def run_params(run_spec) -> dict:
    """The run's resolved config (the RunSpec: plan, drafter, train, cluster, paths), flattened to
    `a.b.c: str` for trackers' parameter tables."""
    data = asdict(run_spec) if is_dataclass(run_spec) else dict(run_spec)
    return flatten(data)


def flatten(d, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if is_dataclass(v):
            v = asdict(v)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)
    return out


# ----------------------------------------------------------------------------- what a step logs
SKIP = {"step", "time"}


def step_scalars(metrics: dict, record: dict | None = None, targets: dict | None = None) -> dict:
    """Every scalar of a committed step, named as the trackers show them:
    `train/<key>` for each number of its metrics.jsonl line (lists as `train/<key>/<i>`, e.g. the
    per-slot accuracy), `bucket/batch<i>` the length bucket of each of the step's batches (-1: a filler),
    `target/<i>/share|idle_fraction|batches|busy_seconds` for each target actor (in order of start)."""
    out = {}
    for k, v in metrics.items():
        if k in SKIP:
            continue
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)):
            out[f"train/{k}"] = float(v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
            for i, x in enumerate(v):
                out[f"train/{k}/{i}"] = float(x)
    for i, b in enumerate((record or {}).get("buckets", []) or []):
        out[f"bucket/batch{i}"] = float(b)
    if targets:
        now = time.time()
        total = sum(t["batches"] for t in targets.values()) or 1
        for i, t in enumerate(targets.values()):
            life = max(now - t["started"], 1e-9)
            out[f"target/{i}/share"] = t["batches"] / total
            out[f"target/{i}/idle_fraction"] = max(0.0, 1.0 - t["busy_s"] / life)
            out[f"target/{i}/batches"] = float(t["batches"])
            out[f"target/{i}/busy_seconds"] = float(t["busy_s"])
    return out


def eval_scalars(result: dict) -> dict:
    """A held-out evaluation's numbers: `heldout/tau`, `heldout/prompts`, `heldout/outputs_match_greedy`."""
    out = {}
    for k, v in result.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)) and k not in SKIP:
            out[f"heldout/{k}"] = float(v)
    return out


# ----------------------------------------------------------------------------- the trackers
class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: str, run_name: str, opts: dict):
        self.dir = RunLayout(run_dir).tensorboard
        self.w = None

    def start(self, params: dict, state: dict | None) -> dict:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # pragma: no cover - ray[train] ships tensorboardX
            from torch.utils.tensorboard import SummaryWriter
        self.w = SummaryWriter(str(self.dir))
        if state is None:  # the config once, as text (TensorBoard has no parameter table of its own)
            self.w.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(params.items())), 0)
        return {"dir": str(self.dir)}

    def log(self, step: int, scalars: dict) -> None:
        for k, v in scalars.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def log_eval(self, step: int, scalars: dict) -> None:
        self.log(step, scalars)

    log_final = log_eval

    def artifact(self, path: str, name: str) -> None:  # TensorBoard keeps no artifacts
        pass

    def finish(self, failed: bool) -> None:
        pass

    def close(self) -> None:
        if self.w is not None:
            self.w.close()


class MLflow:
    name = "mlflow"

    def __init__(self, run_dir: str, run_name: str, opts: dict):
        self.run_dir, self.run_name, self.opts = run_dir, run_name, opts
        self.uri = opts["mlflow_tracking_uri"]
        self.client = self.run_id = None

    def start(self, params: dict, state: dict | None) -> dict:
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient(tracking_uri=self.uri)
        run = None
        if state and state.get("run_id") and state.get("tracking_uri") == self.uri:
            try:
                run = c.get_run(state["run_id"])
            except Exception:  # noqa: BLE001 - the store was replaced: a new run
                run = None
        if run is None:
            exp = c.get_experiment_by_name(self.opts["project"])
            if exp is not None:
                eid = exp.experiment_id
            else:
                # our default store (a SQLite file): artifacts beside it; a server decides for itself
                local = self.uri.startswith("sqlite:///")
                where = (Path(self.uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri() if local else None
                try:
                    eid = c.create_experiment(self.opts["project"], artifact_location=where)
                except Exception:  # noqa: BLE001 - another run created it meanwhile
                    eid = c.get_experiment_by_name(self.opts["project"]).experiment_id
            run = c.create_run(eid, run_name=self.run_name,
                               tags={"dflash.run_dir": str(Path(self.run_dir).resolve()),
                                     "mlflow.source.name": "dflash-ray train"})
        else:
            c.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self._params(params, dict(run.data.params))
        return {"run_id": self.run_id, "tracking_uri": self.uri, "experiment_id": run.info.experiment_id}

    def _params(self, params: dict, existing: dict) -> None:
        from mlflow.entities import Param, RunTag

        new, changed = [], []
        for k, v in sorted(params.items()):
            key = re.sub(r"[^\w\-./ ]", "_", k)
            value = str(v)[:6000]
            if key not in existing:
                new.append(Param(key, value))
            elif existing[key] != value:  # MLflow's parameters are immutable: a resume's change is a tag
                changed.append(RunTag(f"param_changed.{key}", value[:5000]))
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        for i in range(0, len(changed), 100):
            self.client.log_batch(self.run_id, tags=changed[i:i + 100])

    def log(self, step: int, scalars: dict) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k.replace(":", "_"), float(v), ts, int(step)) for k, v in scalars.items()]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def log_eval(self, step: int, scalars: dict) -> None:
        self.log(step, scalars)

    log_final = log_eval

    def artifact(self, path: str, name: str) -> None:
        self.client.log_artifacts(self.run_id, path, artifact_path=name)

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def close(self) -> None:  # the run stays RUNNING until the driver says how it ended (finish)
        pass


class WandB:
    """W&B's history is one row per `log` with a strictly rising `_step`; a held-out evaluation ends after
    later training steps were logged, and several can end between two steps. So every log call is a row of
    its own (`_step` = this run's row counter, kept in trackers.json before each row is written, so a
    rerun never reuses one), and the charts use their own axes: `train/step` for train/, bucket/ and
    target/ keys, `heldout/step` for heldout/ keys (`define_metric`)."""

    name = "wandb"

    def __init__(self, run_dir: str, run_name: str, opts: dict):
        self.run_dir, self.run_name, self.opts = run_dir, run_name, opts
        self.run = None
        self.row = -1
        self.save = lambda update: None   # set by Trackers: persists {"row": n} in trackers.json

    def mode(self) -> str:
        m = self.opts.get("wandb_mode") or os.environ.get("WANDB_MODE")
        if m:
            return str(m)
        return "online" if _wandb_logged_in() else "offline"

    def start(self, params: dict, state: dict | None) -> dict:
        import wandb

        run_id = (state or {}).get("run_id") or uuid.uuid4().hex[:12]
        self.row = int((state or {}).get("row", -1))
        mode = self.mode()
        if state and int(time.time()) == int(state.get("started", 0)):
            # each start of an offline run is a directory named by the second it starts in: two starts
            # within one second (a rerun that trains nothing) would share it
            time.sleep(1.0 - time.time() % 1.0 + 0.01)
        self.run = wandb.init(
            project=self.opts["project"], name=self.run_name, id=run_id, resume="allow", mode=mode,
            dir=str(self.run_dir), config=_nest(params), reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False,
                                    disable_git=True))
        if state:  # a resume may change values (train.max_steps): the run's config shows the latest
            self.run.config.update(_nest(params), allow_val_change=True)
        self.row = max(self.row, int(getattr(self.run, "step", 0) or 0) - 1)   # online: the server's count
        for axis, keys in (("train/step", ("train/*", "bucket/*", "target/*")), ("heldout/step", ("heldout/*",))):
            self.run.define_metric(axis)
            for k in keys:
                self.run.define_metric(k, step_metric=axis)
        return {"run_id": run_id, "project": self.opts["project"], "mode": mode, "row": self.row,
                "dir": str(RunLayout(self.run_dir).wandb)}

    def _row(self, data: dict) -> None:
        self.row += 1
        self.save({"row": self.row})   # before the row: a crash leaves a gap, never a reused _step
        self.run.log(data, step=self.row)

    def log(self, step: int, scalars: dict) -> None:
        self._row({**scalars, "train/step": int(step)})

    def log_eval(self, step: int, scalars: dict) -> None:
        self._row({**scalars, "heldout/step": int(step)})

    def log_final(self, step: int, scalars: dict) -> None:  # the run's summary: what its table shows
        self.run.summary.update(scalars)

    def artifact(self, path: str, name: str) -> None:
        import wandb

        art = wandb.Artifact(re.sub(r"[^\w\-.]", "_", f"{self.run_name}-{name}"), type="model")
        art.add_dir(path)
        self.run.log_artifact(art)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        self.run = None

    def close(self) -> None:  # the run record's end: its process is killed right after, so wait for the
        # W&B service to write everything (finish() can return with the last rows still in flight)
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            wandb.teardown()


CLASSES = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        d = out
        parts = k.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                break
        else:
            d[parts[-1]] = v
    return out


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


# ----------------------------------------------------------------------------- the set a run uses
class Trackers:
    """The chosen trackers of one run, in one process (the run record, or the driver at the end).
    A tracker that fails while logging is reported (`on_error`) and dropped: trackers never stop a run."""

    def __init__(self, run_dir: str, run_name: str, names, opts: dict, on_error=None):
        self.dir = Path(run_dir)
        self.run_name = run_name
        self.names = list(names)
        self.opts = opts
        self.on_error = on_error or (lambda name, where, e: None)
        self.active: list = []
        self.logged: set[int] = set()
        self._state: dict = {}

    def state(self) -> dict:
        try:
            return json.loads((self.dir / STATE).read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self, state: dict) -> None:
        from dflash_ray.atomic import write_json_atomic

        write_json_atomic(self.dir / STATE, state)

    def start(self, params: dict, logged_steps=()) -> None:
        """Open (or continue) each tracker's run. logged_steps: the steps metrics.jsonl already has (they
        were logged when first written, or belong to a time before the trackers were on)."""
        check_installed(self.names)
        self.logged = {int(s) for s in logged_steps}
        state = self.state()
        self._state = state
        for n in self.names:
            t = CLASSES[n](str(self.dir), self.run_name, self.opts)
            t.save = lambda update, n=n: self._save(n, update)
            try:
                state[n] = {**t.start(params, state.get(n)), "started": time.time()}
            except Exception as e:  # noqa: BLE001 - a tracker's failure is reported, never the run's
                self.on_error(n, "start", e)
                continue
            self.active.append(t)
        self._write_state(state)

    def _save(self, name: str, update: dict) -> None:
        self._state.setdefault(name, {}).update(update)
        self._write_state(self._state)

    def _each(self, where: str, fn) -> None:
        for t in list(self.active):
            try:
                fn(t)
            except Exception as e:  # noqa: BLE001
                self.on_error(t.name, where, e)
                self.active.remove(t)

    def log_step(self, step: int, scalars: dict) -> bool:
        """Log a committed step unless it was logged before (the once rule). True when logged."""
        step = int(step)
        if step in self.logged:
            return False
        self.logged.add(step)
        clean = {k: v for k, v in scalars.items() if v is not None and not isinstance(v, bool)}
        self._each("log", lambda t: t.log(step, clean))
        return True

    def log_eval(self, step: int, scalars: dict) -> None:
        self._each("log_eval", lambda t: t.log_eval(int(step), scalars))

    def artifact(self, path, name: str) -> None:
        if path and Path(path).is_dir():
            self._each("artifact", lambda t: t.artifact(str(path), name))

    def finish(self, failed: bool) -> None:
        self._each("finish", lambda t: t.finish(failed))

    def close(self) -> None:
        for t in self.active:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001
                self.on_error(t.name, "close", e)
        self.active = []


def end_run(run_spec, summary: dict | None, *, failed: bool = False, log=print) -> None:
    """Driver side, after the export: the export and best drafter as artifacts, the held-out tau of the
    summary, the final status. Continues the runs the run record opened (trackers.json); none when no
    tracker is chosen."""
    try:
        _end_run(run_spec, summary, failed, log)
    except Exception as e:  # noqa: BLE001 - the run's outcome stands whatever a tracker does
        log(f"WARNING: trackers could not record the run's end: {type(e).__name__}: {str(e)[:300]}")


def _end_run(run_spec, summary, failed, log) -> None:
    names = chosen(run_spec.train)
    if not names:
        return
    run_dir = Path(run_spec.run_dir)
    state = Trackers(str(run_dir), run_spec.name, names, {}).state()
    names = [n for n in names if n in state]   # only runs the run record opened
    if not names:
        return

    def report(name, where, e):
        log(f"WARNING: tracker {name} failed at {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")

    ts = Trackers(str(run_dir), run_spec.name, names, options(run_spec.train, run_dir), on_error=report)
    ts.start(run_params(run_spec), logged_steps=())
    if summary:
        step = int(summary.get("steps") or 0)
        final = {}
        tau = summary.get("heldout_tau") or {}
        for which in ("initial", "trained"):
            if isinstance(tau.get(which), dict) and tau[which].get("tau") is not None:
                final[f"final/heldout_tau_{which}"] = float(tau[which]["tau"])
        for k in ("final_loss", "tokens_per_second", "wall_seconds", "failures_survived"):
            v = summary.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                final[f"final/{k}"] = float(v)
        if final:
            ts._each("final", lambda t: t.log_final(step, final))
        if summary.get("export"):
            ts.artifact(summary["export"], "export")
        if (summary.get("best") or {}).get("dir"):
            ts.artifact(summary["best"]["dir"], "best")
    ts.finish(failed)
    ts.close()
