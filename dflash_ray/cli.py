"""`dflash-ray <command> [flags] [overrides]` and `python -m dflash_ray.<command>`.

Overrides use Hydra's grammar (`a.b=1`, `+new=1`, `++a.b=1`, `~a.b`, `group=option`). `--cfg job` prints
the composed config and exits. Bad input or config: one line on stderr, exit code 2 (`--debug` shows
the traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_ray.errors import UserError

COMMANDS = ("prepare", "plan", "order-stats", "train", "eval", "export", "plot")


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"dflash-ray {cmd}", description=__doc__.splitlines()[0])
    p.add_argument("--cfg", choices=["job"], help="print the composed config as YAML and exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    if cmd == "plan":
        p.add_argument("--dump", metavar="PATH", help="write the plan as parquet (position, bucket, sample_ids)")
        p.add_argument("--check", action="store_true", help="also validate every token column of the shards")
    if cmd == "order-stats":
        p.add_argument("--counts", required=True, help="batch counts per bucket, e.g. 2120,4019,5468")
        p.add_argument("--strategy", default="default")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--epoch", type=int, default=0)
        p.add_argument("--dump-order", metavar="PATH.npy")
        p.add_argument("--compare", action="store_true", help="all strategies side by side")
        p.add_argument("--plot", metavar="PNG", help="bucket sequence and run lengths per strategy")
    if cmd == "plot":
        p.add_argument("run_dir", nargs="?", help="a run directory (default: run.dir of the config)")
    p.add_argument("overrides", nargs="*", help="config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: dflash-ray {{{','.join(COMMANDS)}}} [--cfg job] [--json] [--debug] [overrides...]")
        return 0 if argv else 2
    return run_command(argv[0], argv[1:])


def run_command(cmd: str, argv: list[str]) -> int:
    if cmd not in COMMANDS:
        print(f"dflash-ray: error: unknown command '{cmd}' (one of {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    args = _parser(cmd).parse_intermixed_args(argv)
    try:
        return _dispatch(cmd, args)
    except UserError as e:
        if args.debug:
            raise
        print(f"dflash-ray {cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unwritable or missing output path, a full disk
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"dflash-ray {cmd}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash-ray {cmd}: interrupted", file=sys.stderr)
        return 130


def _dispatch(cmd: str, args) -> int:
    if cmd == "order-stats":
        from dflash_ray.data.report import order_stats_command

        return order_stats_command(args)
    from dflash_ray.config import compose_config, to_yaml

    overrides = list(args.overrides)
    if cmd == "plot" and args.run_dir and "=" in args.run_dir:
        overrides.insert(0, args.run_dir)
        args.run_dir = None
    cfg = compose_config(overrides)
    if args.cfg == "job":
        print(to_yaml(cfg), end="")
        return 0
    if cmd == "prepare":
        return _prepare(cfg, args)
    if cmd == "plan":
        from dflash_ray.data.report import plan_command

        return plan_command(cfg, args, extras=_capacity_report())
    if cmd == "train":
        from dflash_ray.train import train_command

        return train_command(cfg, args)
    if cmd == "eval":
        from dflash_ray.eval import eval_command

        return eval_command(cfg, args)
    if cmd == "export":
        from dflash_ray.train import export_command

        return export_command(cfg, args)
    if cmd == "plot":
        from dflash_ray.runtime.plots import plot_command

        return plot_command(cfg, args)
    raise AssertionError(cmd)


def _capacity_report():
    """The runtime's capacity model (GPU split) for the plan report; the data layer knows no runtime."""
    try:
        from dflash_ray.runtime.capacity import capacity_report
    except ImportError:
        return None
    return capacity_report


def _prepare(cfg, args) -> int:
    from dflash_ray.config import require
    from dflash_ray.data.prepare import prepare

    summary = prepare(
        require(cfg, "data.input"), require(cfg, "data.tokenizer"), require(cfg, "data.output"),
        shard_size=int(cfg.data.shard_size), min_supervised=2 * int(cfg.model.block_size),
        vocab_size=cfg.data.vocab_size, progress=not args.json,
    )
    out = summary.as_dict()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        dropped = ", ".join(f"{k}: {v}" for k, v in out["dropped"].items()) or "none"
        print(f"prepared {out['samples']} samples, {out['tokens']} tokens "
              f"({out['supervised_tokens']} supervised) in {out['shards']} shards -> {Path(out['output'])}")
        print(f"dropped: {dropped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
