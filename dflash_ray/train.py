"""The main job: `dflash-ray train` / `python -m dflash_ray.train [overrides]` / `ray job submit ... --
python -m dflash_ray.train cluster=8gpu ...`.

    data    ensure_data: the shards (with no arguments: a synthetic corpus + tokenizer, prepared)
    target  model.target_path, or a tiny one synthesised into <run.dir>/target
    plan    the epoch plan (printed), a pure function of the data and the config
    train   Ray: plan rows -> tokens -> TargetForward actors -> TorchTrainer drafter workers (DDP),
            checkpoints every train.checkpoint_every steps, restarts from them on failure
    export  <run.dir>/export, a Hugging Face drafter the reference `dflash` package loads
    summary <run.dir>/summary.json

Rerunning the same run.name resumes the run from its latest checkpoint.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def train_command(cfg, args) -> int:
    from dflash_ray.runtime.driver import main_job

    quiet = bool(getattr(args, "json", False))
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if quiet else print
    spec, summary = main_job(cfg, progress=not quiet, log=log, plan_log=log)
    if quiet:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    led = summary["ledger"]
    loss = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
    print(f"trained {summary['steps']} steps, {summary['tokens']} tokens at "
          f"{summary['tokens_per_second']:.0f} tokens/s; final loss {loss}; "
          f"failures survived: {summary['failures_survived']}; ledger "
          f"{'exactly-once' if led['ok'] else 'NOT OK: ' + json.dumps(led)}")
    print(f"export: {summary['export']}")
    print(f"run directory: {spec.run_dir}")
    return 0


def export_command(cfg, args) -> int:
    """`dflash-ray export [run.name=...]`: export the latest checkpoint of a run to <run.dir>/export."""
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.driver import export_checkpoint, latest_checkpoint_dir
    from dflash_ray.runtime.spec import resolve_spec

    spec = resolve_spec(cfg, log=lambda *a, **k: None)
    ckpt = latest_checkpoint_dir(spec)
    if ckpt is None:
        raise UserError(f"{spec.storage_path}/{spec.run_name}: no checkpoint to export (train the run first)")
    out = export_checkpoint(spec, ckpt, str(Path(spec.run_dir) / "export"))
    print(f"exported {ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    from dflash_ray.cli import run_command

    sys.exit(run_command("train", sys.argv[1:]))
