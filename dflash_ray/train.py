"""The main job: `dflash-ray train` / `python -m dflash_ray.train [overrides]`.

With no arguments it runs the embedded default: synthetic corpus and tokenizer, prepared shards, the
epoch plan. (Training through the Ray runtime is added by the runtime layer.)
"""
from __future__ import annotations

import sys


def train_command(cfg, args) -> int:
    from dflash_ray.data.default import ensure_data
    from dflash_ray.data.plan import plan_from_config
    from dflash_ray.data.report import format_plan

    ensure_data(cfg)
    plan = plan_from_config(cfg, epoch=0)
    print(format_plan(plan.summary()))
    return 0


def export_command(cfg, args) -> int:
    from dflash_ray.errors import UserError

    raise UserError("export needs a trained run (the runtime layer provides it)")


if __name__ == "__main__":
    from dflash_ray.cli import run_command

    sys.exit(run_command("train", sys.argv[1:]))
