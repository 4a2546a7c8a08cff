"""The main job, as a recipe: `dflash-ray train` / `python -m dflash_ray.train [overrides]` /
`ray job submit ... -- python -m dflash_ray.train cluster=8gpu ...`.

    spec     the config's choices answered once: data (with no arguments: a synthetic corpus and
             tokenizer, prepared), the target (model.target_path, or a tiny one synthesised), the
             drafter's tapped layers and mask token
    plan     the epoch plan (printed), a pure function of the data and the config
    train    on Ray: plan rows -> tokens -> TargetForward actors -> TorchTrainer drafter workers (DDP),
             checkpoints every train.checkpoint_every steps, restarts from them on failure
    summary  <run.dir>/summary.json: steps, tokens/s, restarts, and the ledger's exactly-once check
    export   <run.dir>/export, a Hugging Face drafter the reference `dflash` package loads

Rerunning the same run.name resumes the run from its latest checkpoint.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main_job(cfg, *, progress: bool = True, log=print, plan_log=print):
    """The whole main job. Returns (run_spec, summary)."""
    from dflash_ray.atomic import write_json_atomic
    from dflash_ray.data.report import format_plan
    from dflash_ray.runtime.checkpoint import export_latest
    from dflash_ray.runtime.cluster import check_resources, ray_cluster
    from dflash_ray.runtime.spec import resolve_spec
    from dflash_ray.runtime.summary import build_summary
    from dflash_ray.runtime.trainer import fit

    run_spec = resolve_spec(cfg, log=log)
    plan_summary = run_spec.build_plan(epoch=0).summary()
    plan_log(format_plan(plan_summary))

    with ray_cluster(run_spec.cluster, log=log):
        check_resources(run_spec.cluster)
        outcome = fit(run_spec, num_buckets=len(plan_summary["buckets"]) or 1, progress=progress)

    summary = build_summary(run_spec, plan_summary, outcome.report, started=outcome.started,
                            wall_seconds=outcome.wall_seconds)
    if export_latest(run_spec) is None:
        summary["export"] = None
    write_json_atomic(Path(run_spec.run_dir) / "summary.json", summary)
    return run_spec, summary


if __name__ == "__main__":
    from dflash_ray.cli import run_command

    sys.exit(run_command("train", sys.argv[1:]))
