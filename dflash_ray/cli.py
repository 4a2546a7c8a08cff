"""`dflash-ray <command> [flags] [overrides]` (also `python -m dflash_ray <command>`): every command's
handler, in one place. Each handler reads the composed config and calls the library; what it prints is
decided here.

Overrides use Hydra's grammar (`a.b=1`, `++a.b=1`, `~a.b`, `group=option`, `+name=1` at the root).
`--cfg job` prints the composed config and exits. Bad input or config: one line on stderr, exit code 2
(`--debug` shows the traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_ray.errors import UserError

COMMANDS = ("regenerate", "prepare", "plan", "order-stats", "train", "compare-orders", "eval", "export", "push", "plot")


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
    if cmd == "compare-orders":
        p.add_argument("--strategies", default=None, metavar="A,B",
                       help="the interleave strategies to train, comma-separated (default: all of them)")
    if cmd == "plot":
        p.add_argument("run_dir", nargs="?", help="a run directory (default: run.dir of the config)")
    if cmd == "export":
        p.add_argument("--dtype", default="target", choices=("target", "float32", "bfloat16", "float16"),
                       help="weights' dtype (default: the target's, as serving engines load the drafter)")
    if cmd == "push":
        p.add_argument("repo_id", metavar="REPO_ID", help="the hub repository, OWNER/NAME")
        p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("overrides", nargs="*", help="config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: dflash-ray {{{','.join(COMMANDS)}}} [--cfg job] [--json] [--debug] [overrides...]")
        return 0 if argv else 2
    return run_command(argv[0], argv[1:])


def missing_dependencies() -> list[str]:
    """The project's dependencies this Python cannot import (a Ray job run by a cluster started outside the
    project's environment lands here: its `python` is the system one)."""
    import importlib.util

    return [m for m in ("omegaconf", "hydra", "ray", "torch", "transformers", "pyarrow")
            if importlib.util.find_spec(m) is None]


def run_command(cmd: str, argv: list[str]) -> int:
    missing = missing_dependencies()
    if missing:
        print(f"dflash-ray {cmd}: error: {sys.executable} cannot import {', '.join(missing)}: run it with the "
              "project's environment (.venv/bin/python), and start Ray clusters from it (scripts/ray-start.sh) so "
              "submitted jobs' `python` is that one", file=sys.stderr)
        return 2
    if cmd not in COMMANDS:
        print(f"dflash-ray: error: unknown command '{cmd}' (one of {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    from omegaconf.errors import MissingMandatoryValue

    args = _parser(cmd).parse_intermixed_args(argv)
    try:
        return _dispatch(cmd, args)
    except MissingMandatoryValue as e:  # a `???` value read where no require() named it
        if args.debug:
            raise
        key = getattr(e, "full_key", None) or "?"
        print(f"dflash-ray {cmd}: error: config key '{key}' must be set (e.g. {key}=...)", file=sys.stderr)
        return 2
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
        return order_stats_command(args)
    from dflash_ray.config import compose_config, to_yaml

    overrides = list(args.overrides)
    if cmd == "plot" and args.run_dir and "=" in args.run_dir:
        overrides.insert(0, args.run_dir)
        args.run_dir = None
    if cmd == "push":  # export=DIR is push's argument, not a config key
        from dflash_ray.publish import take_export_override

        overrides, args.export = take_export_override(overrides)
    cfg = compose_config(overrides)
    if args.cfg == "job":
        print(to_yaml(cfg), end="")
        return 0
    from dflash_ray.paths import resolve_hub_ids

    resolve_hub_ids(cfg)  # hub ids -> their local snapshot (downloaded where the hub is reachable)
    handler = {"regenerate": regenerate_command, "prepare": prepare_command, "plan": plan_command,
               "train": train_command, "compare-orders": compare_orders_command, "eval": eval_command,
               "export": export_command, "push": push_command, "plot": plot_command}[cmd]
    return handler(cfg, args)


# ----------------------------------------------------------------------------- data
def regenerate_command(cfg, args) -> int:
    """Conversations -> the same conversations with the target's own greedy answers (a Ray Data job on
    the configured cluster; resumable; failures counted by reason)."""
    from omegaconf import OmegaConf

    from dflash_ray.config import require
    from dflash_ray.runtime.cluster import ray_cluster
    from dflash_ray.runtime.jobs.regenerate import regenerate

    source, tokenizer = require(cfg, "data.input"), require(cfg, "data.tokenizer")
    target, output = require(cfg, "model.target_path"), require(cfg, "regenerate.output")
    if not (Path(target) / "config.json").exists():
        raise UserError(f"{target}: not a Hugging Face model directory (no config.json) (config key 'model.target_path')")
    cluster = OmegaConf.to_object(cfg.cluster)
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    with ray_cluster(cluster, log=log):
        counts = regenerate(source, output, target_dir=target, tokenizer_dir=tokenizer, cluster=cluster,
                            max_new_tokens=cfg.regenerate.max_new_tokens,
                            batch_size=cfg.regenerate.batch_size, log=log)
    if args.json:
        print(json.dumps(counts, indent=2))
    return 0


def prepare_command(cfg, args) -> int:
    from dflash_ray.config import require
    from omegaconf import OmegaConf

    from dflash_ray.data.prepare import options_from_config, prepare

    where = (require(cfg, "data.input"), require(cfg, "data.tokenizer"), require(cfg, "data.output"))
    if cfg.data.prepare_engine == "ray":
        from dflash_ray.runtime.cluster import ray_cluster
        from dflash_ray.runtime.jobs.prepare_on_ray import prepare_on_ray

        log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
        with ray_cluster(OmegaConf.to_object(cfg.cluster), log=log):
            summary = prepare_on_ray(*where, rows_per_task=cfg.data.prepare_rows_per_task,
                                     **options_from_config(cfg))
    else:
        summary = prepare(*where, progress=not args.json, **options_from_config(cfg))
    out = summary.as_dict()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        dropped = ", ".join(f"{k}: {v}" for k, v in out["dropped"].items()) or "none"
        untrusted = ", ".join(f"{k}: {v}" for k, v in out["untrusted_turns"].items()) or "none"
        print(f"prepared {out['samples']} samples from {out['conversations']} conversations, {out['tokens']} tokens "
              f"({out['supervised_tokens']} supervised) in {out['shards']} shards -> {Path(out['output'])}")
        print(f"one row per assistant turn (the template rewrites history): {out['per_turn_conversations']} "
              f"conversations; assistant turns left out (mask not trustworthy): {untrusted}")
        print(f"dropped: {dropped}; {summary.bad_rows.summary_line()}")
    return 0


def plan_command(cfg, args) -> int:
    """The epoch plan of data.shards (sample_id and num_tokens only, unless --check), with the
    runtime's capacity model (best target/drafter split) for the configured cluster."""
    from dflash_ray.config import require
    from dflash_ray.data.plan import plan_from_config
    from dflash_ray.data.report import format_plan
    from dflash_ray.data.shards import check_shards, write_table_atomic
    from dflash_ray.sizing.capacity import capacity_report

    if args.check:
        check_shards(require(cfg, "data.shards"), cfg.data.vocab_size)
    plan = plan_from_config(cfg)
    summary = plan.summary()
    capacity = capacity_report(cfg, summary, feature_bytes_per_token(cfg))
    memory = plan_memory(cfg, plan)
    if args.dump:
        write_table_atomic(plan.to_arrow().drop_columns(["num_tokens"]), args.dump)
    if args.json:
        print(json.dumps({**summary, **{k: v for k, v in capacity.items() if k != "text"},
                          "memory": {k: v for k, v in memory.items() if k != "text"}}, indent=2))
    else:
        print(format_plan(summary))
        for text in capacity["text"] + memory["text"]:
            print(text)
        if args.dump:
            print(f"plan written to {args.dump}")
    return 0


def feature_bytes_per_token(cfg) -> float | None:
    """Bytes of the target's features per token as they travel (hidden x tapped layers; bf16 on GPUs,
    fp32 on CPUs); None when the target's shape is unknown."""
    from dflash_ray.data.plan import target_fields
    from dflash_ray.model.target import default_target_layer_ids
    from dflash_ray.sizing.memory import text_config

    target = target_fields(cfg)
    text = text_config(target or {})
    if "hidden_size" not in text:
        return None
    m = cfg.model
    taps = len(m.target_layer_ids or default_target_layer_ids(int(text["num_hidden_layers"]), m.num_draft_layers))
    return float(text["hidden_size"]) * taps * (2 if cfg.cluster.use_gpu else 4)


def plan_memory(cfg, plan) -> dict:
    """The memory model for the plan's batches, the configured drafter and the target's shape (from
    model.target_path's config.json or model.target_config); only a line when the shape is unknown."""
    from dflash_ray.data.plan import target_fields
    from dflash_ray.model.target import default_target_layer_ids
    from dflash_ray.sizing.memory import memory_report, text_config

    target = target_fields(cfg)
    if not target or "vocab_size" not in text_config(target):
        return {"text": ["memory model: the target's shape is unknown (model.target_path is not a local "
                         "directory with a config.json; a synthesised target is known once a run built it)"]}
    text = text_config(target)
    m, c = cfg.model, cfg.cluster
    layer_ids = list(m.target_layer_ids or default_target_layer_ids(int(text["num_hidden_layers"]), m.num_draft_layers))
    dtype = str(target.get("dtype") or target.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") or "float32")
    return memory_report(plan, target, draft_layers=m.num_draft_layers, layer_ids=layer_ids, use_gpu=c.use_gpu,
                         stored_bytes=4 if "32" in dtype else 2, device_memory_gib=c.device_memory_gb,
                         drafter_share=c.drafter_gpus, target_share=c.target_gpus,
                         recompute_layers=cfg.train.recompute_layers,
                         drafter_sizes={"intermediate": m.drafter_intermediate_size,
                                        "heads": m.drafter_num_attention_heads,
                                        "kv_heads": m.drafter_num_key_value_heads})


def order_stats_command(args) -> int:
    """Order measures of the interleave strategies for given batch counts (no data needed)."""
    import numpy as np

    from dflash_ray.data.interleave import STRATEGIES, interleave_order, order_measures
    from dflash_ray.data.report import compare_table, format_measures, plot_orders

    try:
        counts = [int(x) for x in args.counts.split(",")]
    except ValueError as e:
        raise UserError(f"--counts: expected comma-separated integers, got '{args.counts}'") from e
    if not counts or min(counts) < 0:
        raise UserError(f"--counts: expected non-negative integers, got '{args.counts}'")
    if args.strategy not in STRATEGIES:
        raise UserError(f"--strategy: unknown '{args.strategy}' (one of {', '.join(STRATEGIES)})")
    names = list(STRATEGIES) if args.compare or args.plot else [args.strategy]
    orders = {n: interleave_order(counts, strategy=n, seed=args.seed, epoch=args.epoch) for n in names}
    measures = {n: order_measures(o, len(counts)) for n, o in orders.items()}
    if args.dump_order:
        Path(args.dump_order).parent.mkdir(parents=True, exist_ok=True)
        np.save(args.dump_order, orders[args.strategy])
    if args.plot:
        plot_orders(orders, counts, args.plot)
    if args.json:
        print(json.dumps(measures if args.compare else measures[args.strategy], indent=2))
    elif args.compare:
        print(compare_table(measures))
    else:
        print(format_measures(measures[args.strategy], args.strategy))
    return 0


# ----------------------------------------------------------------------------- training
def train_command(cfg, args) -> int:
    from dflash_ray.train import main_job

    quiet = bool(args.json)
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if quiet else print
    run_spec, summary = main_job(cfg, progress=not quiet, log=log, plan_log=log)
    if quiet:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    led = summary["ledger"]
    loss = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
    print(f"trained {summary['steps']} steps, {summary['tokens']} tokens at "
          f"{summary['tokens_per_second']:.0f} tokens/s; final loss {loss}; "
          f"failures survived: {summary['failures_survived']}; ledger "
          f"{'exactly-once' if led['ok'] else 'NOT OK: ' + json.dumps(led)}")
    busy = summary.get("target_busy_by_bucket") or []
    if busy:
        print("target actors' busy time per batch by bucket: "
              + ", ".join(f"{r['bucket']}: {r['mean_busy_ms']:.1f} ms" for r in busy)
              + f" (max/min {summary['target_busy_max_over_min']:.2f})")
    tau = summary.get("heldout_tau")
    if tau:
        a, b = tau["initial"], tau["trained"]
        print(f"held-out tau ({b['prompts']} prompts, block {run_spec.drafter.block_size}): {a['tau']:.2f} for the "
              f"freshly initialised drafter -> {b['tau']:.2f} trained (the target's forward time "
              f"{b['target_time_speedup']:.2f}x lower than plain greedy decoding's); output equals the target's "
              f"greedy output: "
              f"{'yes' if b['outputs_match_greedy'] and a['outputs_match_greedy'] else 'NO'}")
    print(f"export: {summary['export']}")
    print(f"run directory: {run_spec.run_dir}")
    return 0


def compare_orders_command(cfg, args) -> int:
    """The same drafter trained once per interleave strategy with the same budget, side by side."""
    from dflash_ray.data.interleave import STRATEGIES
    from dflash_ray.runtime.jobs.compare_orders import compare_orders, format_comparison

    strategies = list(STRATEGIES)
    if args.strategies is not None:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown or not strategies:
            raise UserError(f"--strategies: unknown {', '.join(repr(s) for s in unknown) or 'empty list'} "
                            f"(any of {', '.join(STRATEGIES)})")
    overrides = [o for o in args.overrides if not o.startswith(("run.name=", "data.interleave="))]
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    result = compare_orders(cfg, overrides, log=log, strategies=strategies)
    if args.json:
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("losses", "buckets_in_order")}
                          for k, v in result["rows"].items()}, indent=2))
    else:
        print(format_comparison(result["rows"]))
        for p in result["pngs"]:
            print(p)
    return 0


def export_command(cfg, args) -> int:
    """Export the latest checkpoint of a run (local or remote storage) to <run.dir>/export."""
    from dflash_ray.runtime.training.checkpoint import export_latest
    from dflash_ray.runtime.spec import resolve_spec

    # the checkpoint and the drafter's shape only: the shards are not read (they may have changed or be gone)
    run_spec = resolve_spec(cfg, log=lambda *a, **k: None, inputs=False)
    exported = export_latest(run_spec, dtype=args.dtype)
    if exported is None:
        raise UserError(f"{run_spec.experiment_dir}: no checkpoint to export (train the run first)")
    print(f"exported {exported[0]} -> {exported[1]}")
    return 0


def push_command(cfg, args) -> int:
    """Publish the run's export (or export=DIR) to the Hugging Face hub as REPO_ID (dflash_ray/publish.py)."""
    from dflash_ray.publish import push_command as push

    return push(cfg, args)


def plot_command(cfg, args) -> int:
    from dflash_ray.runtime.record.plots import plot_run

    for p in plot_run(args.run_dir or cfg.run.dir):
        print(p)
    return 0


# ----------------------------------------------------------------------------- evaluation
def format_eval(s: dict) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in enumerate(s["acceptance_histogram"]) if v)
    return "\n".join([
        f"drafter {s['drafter']} vs target {s['target']}: {s['num_prompts']} prompts, {s['new_tokens']} new tokens, block {s['block_size']}",
        f"  tau (mean accepted + 1 per cycle)       : {s['tau']:.3f}  (per cycle over all prompts: {s['tau_per_cycle']:.3f})",
        f"  acceptance lengths (length:cycles)      : {hist}",
        f"  target forwards, speculative vs greedy  : {s['target_forwards_speculative']} vs {s['target_forwards_greedy']}",
        f"  target seconds, speculative vs greedy   : {s['target_seconds_speculative']:.3f} vs {s['target_seconds_greedy']:.3f} "
        f"(x{s['target_time_speedup']:.2f}, {s['target_seconds_saved']:.3f} s saved)",
        f"  output equals plain greedy decoding     : {'yes' if s['outputs_match_greedy'] else 'NO'}",
    ])


def eval_command(cfg, args) -> int:
    """Greedy speculative decoding of an exported drafter against its target: tau, its distribution,
    target time saved, and a check that the output equals plain greedy decoding (exit 1 if not, in fp32)."""
    from dflash_ray.config import require
    from dflash_ray.data.prompts import find_tokenizer, read_prompts
    from dflash_ray.model.evaluate import evaluate_acceptance
    from dflash_ray.sizing.memory import text_config

    drafter_dir, target_dir = require(cfg, "drafter"), require(cfg, "target")
    for key, d in (("drafter", drafter_dir), ("target", target_dir)):
        if not (Path(d) / "config.json").exists():
            raise UserError(f"{d}: no config.json (config key '{key}' must name a Hugging Face-format directory)")
    tcfg, dcfg = (json.loads((Path(d) / "config.json").read_text()) for d in (target_dir, drafter_dir))
    tcfg = text_config(tcfg)
    for key, want in (("hidden_size", tcfg.get("hidden_size")), ("num_target_layers", tcfg.get("num_hidden_layers"))):
        if dcfg.get(key) != want:
            raise UserError(f"{drafter_dir}: drafter {key} {dcfg.get(key)} does not fit target {target_dir} ({want})")
    tok = find_tokenizer(cfg.data.tokenizer, target_dir)
    prompts = read_prompts(require(cfg, "data.prompts"), tok, cfg.eval.max_prompts)
    vocab = int(tcfg["vocab_size"])
    for i, p in enumerate(prompts):
        if not p or min(p) < 0 or max(p) >= vocab:
            raise UserError(f"{cfg.data.prompts}: prompt {i + 1}: needs 1+ token ids in [0, {vocab}), got {p[:8]}")
    stop = [tok.eos_token_id] if tok is not None and tok.eos_token_id is not None else None
    stats = evaluate_acceptance(drafter_dir, target_dir, prompts, cfg.eval.max_new_tokens, stop_token_ids=stop)
    print(json.dumps(stats, indent=2) if args.json else format_eval(stats))
    if stats["outputs_match_greedy"]:
        return 0
    import torch

    if torch.cuda.is_available():
        # bf16: verifying a block and decoding one token can round differently without any bug
        print("warning: speculative output differs from plain greedy decoding (bf16 rounding?)", file=sys.stderr)
        return 0
    return 1  # fp32: the outputs must be equal; a difference is a bug


if __name__ == "__main__":
    sys.exit(main())
