"""`dflash-ray <command> [flags] [overrides]` (also `python -m dflash_ray <command>`): every command's
handler, in one place. Each handler reads the composed config and calls the library; what it prints is
decided here. (Long on purpose: a command's help, its handler and its output sit together, one screen each.)

Overrides use Hydra's grammar (`a.b=1`, `++a.b=1`, `~a.b`, `group=option`, `+name=1` at the root).
`--cfg job` prints the composed config and exits. Bad input or config: one line on stderr, exit code 2
(`--debug` shows the traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from dflash_ray.errors import UserError

COMMANDS = ("regenerate", "prepare", "plan", "order-stats", "train", "compare", "compare-orders", "tune", "eval", "export",
            "push",
            "plot", "config")

# What `dflash-ray --help` (the one line) and `dflash-ray <command> --help` (the description and the main
# config keys, each shown with its default and its line from dflash_ray/config.py) say about each command.
HELP = {
    "regenerate": (
        "the conversations with every assistant turn answered by the target (greedy; a Ray Data job)",
        "The same conversations with every assistant turn replaced by the target's greedy answer, turn by turn "
        "on the regenerated history, rendered as prepare and serving render it (data.chat_template_kwargs, the "
        "row's tools and system prompt): a Ray Data job over target actors (one per GPU the cluster has; on CPU "
        "machines one per cluster.cpu_threads.regenerate cores), or over vLLM or SGLang as a Ray Data LLM stage "
        "(regenerate.engine=vllm|sglang), or sent to an OpenAI-compatible server you run (regenerate.engine=http "
        "regenerate.url=...). Greedy unless regenerate.temperature > 0. Resumable: the rows' own ids already in the output are skipped, a torn last "
        "line is cut. A turn that hits regenerate.max_new_tokens is dropped with the rest of its conversation "
        "(regenerate.on_max_tokens=keep keeps it); a conversation stops after the target's first tool call. "
        "Every case is counted by reason (malformed line or conversation, prompt over the target's context, "
        "capped answers, greedy loops, tool calls).",
        ("data.input", "data.tokenizer", "model.target_path", "regenerate.output", "regenerate.max_new_tokens",
         "regenerate.on_max_tokens", "regenerate.batch_size", "regenerate.engine", "regenerate.url",
         "regenerate.engine_kwargs", "regenerate.temperature", "data.chat_template_kwargs", "cluster.use_gpu")),
    "prepare": (
        "conversations -> parquet shards of token ids and loss masks",
        "Conversations (ShareGPT, OpenAI messages with tools and reasoning, or this project's rows; jsonl, json, "
        "parquet, a directory or a glob) -> parquet shards (sample_id, input_ids, loss_mask, num_tokens, "
        "num_supervised). The loss mask covers exactly what the target generates for each assistant turn when "
        "served (the tokenizer's chat template with data.chat_template_kwargs); a template that rewrites history "
        "gives one row per assistant turn (data.turns). Samples with fewer than 2 x model.block_size supervised "
        "tokens are dropped, counted. A bad row stops it with one line naming the file "
        "and line (data.on_bad_row=fail) or is skipped and counted by reason (skip). Prints samples, tokens, "
        "drops, untrusted turns and bad rows.",
        ("data.input", "data.tokenizer", "data.output", "data.format", "data.on_bad_row", "data.turns",
         "data.chat_template_kwargs", "data.shard_size", "data.prepare_engine", "model.block_size")),
    "plan": (
        "the epoch plan of the shards: buckets, batches, budgets, order, GPU split, memory model",
        "The epoch plan from the shards' sample_id / num_tokens / num_supervised only: buckets, batches, "
        "padding efficiency, both budgets' use per bucket (target fill and cost, drafter anchors, block tokens, "
        "anchor density, block tokens per context token), order measures; the capacity model's best target/drafter GPU split for cluster=...; "
        "the memory model (drafter step and target actor peak for the worst batch; a WARNING above "
        "cluster.device_memory_gb x the process's GPU share). The target's shape comes from "
        "model.target_path's config.json, else from the model preset (model.target_config). --dump writes "
        "position, bucket, sample_ids as parquet; --check validates every token.",
        ("data.shards", "model.target_path", "data.bucket_boundaries", "data.max_tokens_per_batch",
         "data.interleave", "data.attention_tokens", "model.max_block_tokens_per_batch", "model.anchors_per_batch",
         "cluster.device_memory_gb",
         "plan.epoch", "seed")),
    "order-stats": (
        "order measures of the interleave strategies for given batch counts (no data needed)",
        "Order measures of the interleave strategies for given batch counts per bucket: quarter shares, prefix "
        "discrepancy, run lengths, when each bucket runs out. No data and no config needed.",
        ()),
    "train": (
        "the main job: plan, stream through target actors, train the drafter, checkpoint, export, tau",
        "The main job: prepare and plan the data, stream it through target actors into a Ray Train drafter "
        "loop, checkpoint (and resume from the latest checkpoint when rerun with the same run.name), export, "
        "measure held-out tau (fresh vs trained drafter), write summary.json (the run directory is printed at "
        "the end). With no arguments: the embedded demo (tiny models, synthetic data, a local Ray).",
        ("model", "data", "cluster", "model.target_path", "data.tokenizer", "data.shards", "train.epochs",
         "train.max_steps", "train.lr", "train.checkpoint_every_minutes", "train.storage_path", "train.trackers",
         "cluster.target_workers", "cluster.drafter_workers", "run.name")),
    "compare": (
        "one config key's values, each trained with everything else equal, side by side",
        "The same drafter (same data, target, seed and initial weights) trained once per value of KEY "
        "(dflash-ray compare KEY=V1,V2[,...] [overrides]), everything else equal. Prints final loss, held-out "
        "tau after training (equal target tokens) and at equal training time (the runs' in-training "
        "evaluations: set train.heldout_every), context and block tokens (the density), training seconds, "
        "loss roughness, quarter shares and bucket ends; writes compare.json and two PNGs into "
        "<run.dir>-compare/. Other overrides with as many values move with KEY (run i takes each one's i-th). "
        "E.g. model.anchors_per_batch=null,32: the recipe's density against thinning.",
        ("train.epochs", "train.heldout_every", "run.name")),
    "compare-orders": (
        "the same drafter trained once per interleave strategy, side by side",
        "The same drafter (same data, target, seed, initial weights and batches) trained once per interleave "
        "strategy with the same budget; only the order differs. Prints final loss, held-out tau, loss "
        "roughness, quarter shares and bucket ends, and writes two PNGs next to the run directory.",
        ("train.epochs", "train.heldout_every", "run.name")),
    "tune": (
        "a sweep on Ray Tune: trials side by side over one feature pass, early stopping, resumable",
        "A search over config keys on Ray Tune, every trial the main job under <run.dir>-tune/<trial>/ (its record, "
        "ledger, checkpoints, held-out evaluations, summary, export). The space: KEY=V1,V2 (a grid), "
        "KEY=choice(V1,V2), KEY=uniform(LO,HI), KEY=loguniform(LO,HI), KEY=randint(LO,HI); the other overrides "
        "are every trial's. The target's features are computed once per node before the trials (a key that "
        "changes them makes cache groups, or is refused over a range); each in-training held-out evaluation "
        "reaches Tune as it is measured, and ASHA stops hopeless trials on it. Trials run side by side as the "
        "cluster's free resources allow. Rerunning the same command resumes the sweep. Prints the table and the "
        "best trial's drafter; writes tune.json.",
        ("train.heldout_every", "train.epochs", "train.lr", "model.num_draft_layers", "run.name")),
    "eval": (
        "tau of an exported drafter against its target by greedy speculative decoding",
        "Greedy speculative decoding of an exported drafter against its target on the prompts of data.prompts "
        "(required here: a .jsonl of token-id lists, texts or conversations): tau (mean accepted + 1 per cycle), "
        "its distribution, the target's forward time against plain greedy decoding's, and a check that the "
        "output equals plain greedy decoding (exit 1 if it does not, in fp32). Progress per prompt on stderr.",
        ("drafter", "model.target_path", "data.prompts", "data.tokenizer", "eval.max_new_tokens", "eval.max_prompts")),
    "export": (
        "rewrite <run.dir>/export/ from the run's latest checkpoint",
        "Rewrite <run.dir>/export/ (a Hugging Face-format drafter the reference dflash package, SGLang and vLLM "
        "load) from the run's latest checkpoint, on local or remote storage.",
        ("run.name", "run.root", "train.storage_path")),
    "push": (
        "publish a run's export (drafter + model card) to the Hugging Face hub",
        "Publish <run.dir>/export (or export=DIR: config.json, model.safetensors, README.md, the model card, and "
        "the drafter's code for trust_remote_code) "
        "to the Hugging Face hub as REPO_ID (OWNER/NAME; created if it does not exist, --private for a private "
        "one) with huggingface_hub's upload_folder. The card's serve commands are rewritten to name REPO_ID. "
        "The token is huggingface_hub's (`hf auth login` or HF_TOKEN); HF_ENDPOINT picks the hub. No token or "
        "an unreachable hub: one line, exit code 2.",
        ("run.name", "run.root")),
    "plot": (
        "PNGs of a run's loss, held-out tau, tokens/s and the bucket of every step",
        "PNGs of loss over steps, loss beside held-out tau (the fresh drafter, every evaluation during training, "
        "the trained drafter), tokens/s over steps and the bucket of every step, written into RUN_DIR/plots/ "
        "(RUN_DIR, default: run.dir of the config).",
        ("run.name", "run.root")),
    "config": (
        "every config key: its type, default and meaning (the typed schema)",
        "Every config key of the typed schema with its type, its default and what it is, and what composition "
        "accepts for it (choices, a minimum); only the keys under each PREFIX given (e.g. `dflash-ray config "
        "train regenerate.engine`). --markdown prints the configuration reference, docs/configuration.md, with "
        "every group's options. `--cfg job` on any command prints a composed config instead.",
        ()),
}

RAY_COMMANDS = ("regenerate", "prepare", "train", "compare", "compare-orders", "tune")   # those that start or join Ray
USAGE = "dflash-ray <command> [--cfg job] [--json] [--debug] [overrides...]"
OVERRIDES = ("Overrides use Hydra's grammar on the config in dflash_ray/conf/: a.b=1, ++a.b=1, ~a.b (back to its default), "
             "group=option, lists [1,2] and dicts {a: 1}; +name=1 adds a key at the root. --cfg job prints the "
             "composed config and exits. Bad input or config: one line on stderr naming the key, file or row, exit "
             "code 2 (--debug shows the traceback).")


def _help(cmd: str) -> tuple:
    """HELP's (line, description, main keys) of a command; a command not in it yet: its handler's docstring."""
    if cmd in HELP:
        return HELP[cmd]
    handler = globals().get(f"{cmd.replace('-', '_')}_command")
    doc = " ".join((getattr(handler, "__doc__", None) or "").split())
    return doc.split(". ")[0].rstrip("."), doc, ()


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("dflash-ray")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "unknown (not installed)"


def _groups() -> str:
    from dflash_ray.config import CONF_DIR

    return ", ".join(f"{d.name}=" + "|".join(sorted(p.stem for p in d.glob("*.yaml")))
                     for d in sorted(CONF_DIR.iterdir()) if d.is_dir())


def _top_help() -> str:
    """`dflash-ray --help`: every command on one line."""
    width = max(map(len, COMMANDS))
    lines = [f"usage: {USAGE}", "       dflash-ray --version", "",
             "Train DFlash speculative-decoding drafters as a Ray application.", "", "commands:"]
    lines += [f"  {cmd:<{width}}  {_help(cmd)[0]}" for cmd in COMMANDS]
    lines += ["", "`dflash-ray <command> --help` says what a command does and its main config keys.", ""]
    lines += [_wrap(OVERRIDES), "", _wrap(f"Config groups: {_groups()}.")]
    return "\n".join(lines)


def key_docs() -> dict:
    """Every config key -> (its default as YAML writes it, its line): the typed schema's (dflash_ray/config.py)."""
    from dflash_ray.config import schema_keys

    return {k.key: (json.dumps(k.default), k.doc + (f" [{k.checks()}]" if k.checks() else "")) for k in schema_keys()}


def _command_help(cmd: str) -> str:
    """The epilog of `dflash-ray <command> --help`: the command's main config keys."""
    keys = _help(cmd)[2]
    if not keys:
        return ""
    docs = key_docs()
    lines = ["main config keys (key=value on the command line; `--cfg job` prints them all):"]
    for key in keys:
        if key in ("model", "data", "cluster"):
            lines.append(f"  {key}=OPTION  the config group's option (see `dflash-ray --help`)")
            continue
        default, doc = docs[key]
        lines.append(f"  {key} (default {default})")
        lines.append(_wrap(doc, indent="      "))
    return "\n".join(lines + ["", _wrap(OVERRIDES)])


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"dflash-ray {cmd}", description=_wrap(_help(cmd)[1]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    if cmd == "compare":
        p.add_argument("sweep", metavar="KEY=V1,V2[,...]", help="the config key to compare and its values")
    if cmd == "tune":
        p.add_argument("--samples", type=int, default=1, metavar="N",
                       help="trials per combination of the grids' values (each draws the other keys anew); default 1")
        p.add_argument("--metric", default="tau", choices=("tau", "loss"),
                       help="what ranks and stops trials: held-out tau (default; higher is better) or training loss")
        p.add_argument("--scheduler", default="asha", choices=("asha", "none"),
                       help="asha: stop hopeless trials early on the metric (default); none: every trial to its end")
        p.add_argument("--grace", type=int, default=2, metavar="N",
                       help="reports a trial makes before ASHA may stop it (default 2)")
        p.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                       help="trials at once at most (default: as many as the cluster's free resources hold)")
        p.add_argument("--report-every", type=int, default=None, metavar="STEPS",
                       help="with --metric loss and no evaluations: a report every STEPS steps (default "
                            "train.heldout_every, else 10)")
    if cmd == "compare-orders":
        p.add_argument("--strategies", default=None, metavar="A,B",
                       help="the interleave strategies to train, comma-separated (default: all of them)")
    if cmd == "plot":
        p.add_argument("run_dir", nargs="?", help="a run directory (default: run.dir of the config)")
    if cmd == "config":
        p.add_argument("--markdown", action="store_true", help="the configuration reference as markdown")
    if cmd == "export":
        p.add_argument("--dtype", default="target", choices=("target", "float32", "bfloat16", "float16"),
                       help="weights' dtype (default: the target's, as serving engines load the drafter)")
    if cmd == "push":
        p.add_argument("repo_id", metavar="REPO_ID", help="the hub repository, OWNER/NAME")
        p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("overrides", nargs="*", help="key prefixes" if cmd == "config" else "config overrides")
    return p


def console_main() -> int:
    """The process's entry (the `dflash-ray` script, `python -m dflash_ray`): `main` with Ray's routine messages
    kept off the console (dflash_ray/console.py says which and how), all of them shown with --debug."""
    import os

    from dflash_ray.console import DEBUG, quiet_console, quiet_ray_environment

    argv = sys.argv[1:]
    debug = "--debug" in argv
    if debug:
        os.environ[DEBUG] = "1"
    else:
        quiet_ray_environment()
    if argv[:1] and argv[0] in RAY_COMMANDS and not {"-h", "--help"} & set(argv):
        from dflash_ray.runtime.cluster import choose_auth_mode

        choose_auth_mode()   # before Ray is imported: it reads the mode once
    with quiet_console(enabled=not debug):
        return main(argv)


def main(argv: list[str] | None = None) -> int:
    from dflash_ray.threads import sleeping_waits

    sleeping_waits()   # before any command imports torch (dflash_ray/threads.py: measured)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(_top_help(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"dflash-ray {version()}")
        return 0
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

    parser = _parser(cmd)
    if "-h" in argv or "--help" in argv:
        parser.epilog = _command_help(cmd)
    try:
        args = parser.parse_intermixed_args(argv)
    except SystemExit as e:  # --help (0), or argparse's usage error (2), already printed
        return int(e.code or 0)
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
    if cmd == "config" and args.cfg is None:
        return config_command(args)
    from dflash_ray.config import compose_config, to_yaml

    overrides = list(args.overrides)
    if cmd == "plot" and args.run_dir and "=" in args.run_dir:
        overrides.insert(0, args.run_dir)
        args.run_dir = None
    if cmd == "push":  # export=DIR is push's argument, not a config key
        from dflash_ray.publish import take_export_override

        overrides, args.export = take_export_override(overrides)
    if cmd == "compare":  # KEY=V1,V2 (and keys swept with it) are compare's; the base config is the rest
        from dflash_ray.compare import take_sweeps

        args.sweeps, overrides = take_sweeps(args.sweep, overrides)
        args.overrides = overrides
    if cmd == "tune":   # the search space's dimensions are tune's; the base config is the rest
        from dflash_ray.search_space import parse_space

        args.dims, overrides = parse_space(overrides)
        args.overrides = overrides
        for flag in ("samples", "grace", "max_concurrent", "report_every"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise UserError(f"tune: --{flag.replace('_', '-')} {value}: must be 1 or more")
    cfg = compose_config(overrides)
    if args.cfg == "job":
        print(to_yaml(cfg), end="")
        return 0
    from dflash_ray.paths import resolve_model_paths

    # hub ids -> their local snapshot (downloaded where the hub is reachable); GGUF files -> converted once
    resolve_model_paths(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    handler = {"regenerate": regenerate_command, "prepare": prepare_command, "plan": plan_command,
               "train": train_command, "compare": compare_command, "compare-orders": compare_orders_command,
               "tune": tune_command,
               "eval": eval_command,
               "export": export_command, "push": push_command, "plot": plot_command}[cmd]
    return handler(cfg, args)


# ----------------------------------------------------------------------------- data
def regenerate_command(cfg, args) -> int:
    """Conversations -> the same conversations with the target's own greedy answers (a Ray Data job on
    the configured cluster; resumable; failures counted by reason)."""
    from omegaconf import OmegaConf

    from dflash_ray.config import compute_dtype, require
    from dflash_ray.data.prepare import template_kwargs
    from dflash_ray.runtime.cluster import ray_cluster
    from dflash_ray.runtime.jobs.regenerate import engine_options, regenerate

    source, tokenizer = require(cfg, "data.input"), require(cfg, "data.tokenizer")
    target, output = require(cfg, "model.target_path"), require(cfg, "regenerate.output")
    if not (Path(target) / "config.json").exists():
        raise UserError(f"{target}: not a Hugging Face model directory (no config.json) (config key 'model.target_path')")
    cluster = OmegaConf.to_object(cfg.cluster)
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    with ray_cluster(cluster, log=log):
        counts = regenerate(source, output, target_dir=target, tokenizer_dir=tokenizer, cluster=cluster,
                            max_new_tokens=cfg.regenerate.max_new_tokens, on_max_tokens=cfg.regenerate.on_max_tokens,
                            template_kwargs=template_kwargs(cfg), batch_size=cfg.regenerate.batch_size,
                            dtype=compute_dtype(cfg), engine=cfg.regenerate.engine, log=log,
                            **engine_options(cfg.regenerate))
    if args.json:
        print(json.dumps(counts, indent=2))
    return 0


def prepare_command(cfg, args) -> int:
    from dflash_ray.config import require
    from omegaconf import OmegaConf

    from dflash_ray.data.prepare import HELDOUT, options_from_config, prepare
    from dflash_ray.data.report import format_drops

    where = (require(cfg, "data.input"), require(cfg, "data.tokenizer"), require(cfg, "data.output"))
    options = options_from_config(cfg)
    if cfg.data.prepare_engine == "ray":
        from dflash_ray.runtime.cluster import ray_cluster
        from dflash_ray.runtime.jobs.prepare_on_ray import prepare_on_ray

        log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
        with ray_cluster(OmegaConf.to_object(cfg.cluster), log=log):
            summary = prepare_on_ray(*where, rows_per_task=cfg.data.prepare_rows_per_task, **options)
    else:
        summary = prepare(*where, progress=not args.json, **options)
    out = summary.as_dict()
    out["heldout"] = len(out["heldout"])   # the prompts are in <output>/heldout.jsonl: their count here
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        dropped = format_drops(out["dropped"], options["min_supervised"])
        untrusted = ", ".join(f"{k}: {v}" for k, v in out["untrusted_turns"].items()) or "none"
        print(f"prepared {out['samples']} samples from {out['conversations']} conversations, {out['tokens']} tokens "
              f"({out['supervised_tokens']} supervised) in {out['shards']} shards -> {Path(out['output'])}")
        print(f"one row per assistant turn (the template rewrites history): {out['per_turn_conversations']} "
              f"conversations; assistant turns left out (mask not trustworthy): {untrusted}")
        print(f"dropped: {dropped}; {summary.bad_rows.summary_line()}")
        if out["heldout"]:
            print(f"held out (data.heldout_fraction={cfg.data.heldout_fraction}, never trained): {out['heldout']} "
                  f"conversations' prompts -> {Path(out['output']) / HELDOUT} (the main job's held-out tau)")
    return 0


def plan_command(cfg, args) -> int:
    """The epoch plan of data.shards (sample_id and num_tokens only, unless --check), with the
    runtime's capacity model (best target/drafter split) for the configured cluster."""
    from dflash_ray.config import require
    from dflash_ray.data.plan import plan_from_config
    from dflash_ray.data.report import format_plan
    from dflash_ray.data.shards import check_shards, write_table_atomic
    from dflash_ray.sizing.capacity import capacity_report

    shape_from = target_shape_source(cfg)
    if args.check:
        check_shards(require(cfg, "data.shards"), cfg.data.vocab_size)
    plan = plan_from_config(cfg)
    summary = plan.summary()
    from dflash_ray.runtime.plan_sizing import (colocated_fits, feature_bytes_per_token, plan_feature_cache,
                                                plan_memory, plan_object_store)

    memory = plan_memory(cfg, plan)
    capacity = capacity_report(cfg, summary, feature_bytes_per_token(cfg), colocated_fits=colocated_fits(cfg, memory))
    store = plan_object_store(cfg, plan)
    if store:
        memory["object_store"] = store
        memory["text"] = memory["text"] + [store["text"]]
    cache = plan_feature_cache(cfg, plan)
    if cache:
        memory["feature_cache"] = cache
        memory["text"] = memory["text"] + [cache["text"]]
    if args.dump:
        write_table_atomic(plan.to_arrow().drop_columns(["num_tokens"]), args.dump)
    if args.json:
        print(json.dumps({**summary, **{k: v for k, v in capacity.items() if k != "text"},
                          "memory": {k: v for k, v in memory.items() if k != "text"},
                          "target_shape_from": shape_from}, indent=2))
    else:
        print(format_plan(summary))
        for text in [f"target shape: {shape_from}"] + capacity["text"] + memory["text"]:
            print(text)
        if args.dump:
            print(f"plan written to {args.dump}")
    return 0


def target_shape_source(cfg) -> str:
    """Where `plan` takes the target's shape from (data.plan.target_fields), in words. A one-line refusal
    where that would be no target's or another target's: model.target_path naming nothing this machine
    reads (a hub id resolves before this, or has failed with its own line), or left unset by a preset that
    carries no shape of its own."""
    from omegaconf import OmegaConf

    m = cfg.model
    if OmegaConf.is_missing(m, "target_path"):
        if not m.target_config:
            raise UserError("config key 'model.target_path' must be set (a Hugging Face directory or hub id): "
                            "plan takes the target's shape from its config.json")
        return (f"model.target_config of model={m.name} (its target's config.json values; "
                "model.target_path=DIR reads the target's own)")
    if m.target_path is not None:
        config_json = Path(m.target_path) / "config.json"
        if not config_json.is_file():
            raise UserError(f"config key 'model.target_path': {m.target_path} is not a directory with a "
                            "config.json (plan reads the target's shape there)")
        return str(config_json)
    from dflash_ray.run_layout import RunLayout

    built = RunLayout(cfg.run.dir).target / "config.json"
    if built.is_file():
        return f"{built} (the synthesised target)"
    return "model.target_config (the synthetic target a run builds from it)" if m.target_config else "unknown"


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
    from dflash_ray.runtime.record.phases import process_age_s
    from dflash_ray.train import main_job

    quiet = bool(args.json)
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if quiet else print
    run_spec, summary = main_job(cfg, progress=not quiet, log=log, plan_log=log, startup_s=process_age_s())
    if quiet:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    led = summary["ledger"]
    loss = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
    density = summary.get("block_tokens_per_token")
    print(f"trained {summary['steps']} steps: {summary['tokens']:,} context tokens at {summary['tokens_per_second']:,.0f}/s, "
          f"{summary.get('block_tokens_per_second', 0):,.0f} block tokens/s"
          + (f" ({density:.2f} per context token)" if density else "") + f"; final loss {loss}")
    print(f"ledger {'exactly-once' if led['ok'] else 'NOT OK: ' + json.dumps(led)}: every planned batch trained once; "
          f"failures survived: {summary['failures_survived']}")
    busy = summary.get("target_busy_by_bucket") or []
    if busy:
        print("target actors' busy time per batch by bucket: "
              + ", ".join(f"{r['bucket']}: {r['mean_busy_ms']:.1f} ms" for r in busy)
              + f" (max/min {summary['target_busy_max_over_min']:.2f})")
    fc = summary.get("feature_cache") or {}
    if fc.get("read_rows") or fc.get("written_samples"):
        print(f"feature cache: {fc.get('read_tokens', 0):,} tokens' features read back instead of computed "
              f"({fc.get('read_rows', 0):,} batches, {fc.get('read_s', 0.0):.1f} s), "
              f"{fc.get('written_samples', 0):,} samples written ({fc.get('written_bytes', 0) / 2**20:,.0f} MiB); "
              f"damaged entries recomputed: {fc.get('damaged', 0)}, failed writes: {fc.get('write_errors', 0)}")
    tau = summary.get("heldout_tau")
    if tau:
        a, b = tau["initial"], tau["trained"]
        print(f"held-out tau on {b['prompts']} prompts, block {run_spec.drafter.block_size}: {a['tau']:.2f} fresh -> "
              f"{b['tau']:.2f} trained ({target_time_words(b['target_time_speedup'])})")
        print(f"output equals the target's greedy output: "
              f"{'yes' if b['outputs_match_greedy'] and a['outputs_match_greedy'] else 'NO'}")
    print(f"export: {summary['export']}")
    if summary.get("ray_logs"):
        print(f"Ray's own logs: {summary['ray_logs']}")
    print(f"run directory: {run_spec.run_dir}")
    return 0


def compare_orders_command(cfg, args) -> int:
    """The same drafter trained once per interleave strategy with the same budget, side by side."""
    from dflash_ray.data.interleave import STRATEGIES
    from dflash_ray.compare import compare_orders

    strategies = list(STRATEGIES)
    if args.strategies is not None:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown or not strategies:
            raise UserError(f"--strategies: unknown {', '.join(repr(s) for s in unknown) or 'empty list'} "
                            f"(any of {', '.join(STRATEGIES)})")
    overrides = [o for o in args.overrides if not o.startswith(("run.name=", "data.interleave="))]
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    return _print_comparison(compare_orders(cfg, overrides, log=log, strategies=strategies), args.json)


def compare_command(cfg, args) -> int:
    """One config key's values trained side by side (compare-orders is compare data.interleave=...)."""
    from dflash_ray.compare import compare

    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    return _print_comparison(compare(cfg, args.sweeps, list(args.overrides), log=log), args.json)


def _print_comparison(result: dict, as_json: bool) -> int:
    from dflash_ray.compare import format_comparison, report_row

    if as_json:
        print(json.dumps({k: report_row(v) for k, v in result["rows"].items()}, indent=2))
    else:
        print(format_comparison(result["rows"], result["key"]))
        for p in result["pngs"]:
            print(p)
    return 0


def tune_command(cfg, args) -> int:
    """A sweep on Ray Tune over the search space (dflash_ray/sweep.py); resumes when rerun."""
    from dflash_ray.sweep import SweepOptions, format_rows, sweep

    opts = SweepOptions(samples=args.samples, metric=args.metric, scheduler=args.scheduler,
                        max_concurrent=args.max_concurrent, grace=args.grace, report_every=args.report_every)
    result = sweep(cfg, args.dims, list(args.overrides), opts,
                   log=(lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print)
    print(json.dumps(result, indent=2) if args.json else format_rows(result, args.dims))
    if result["unfinished"]:
        return 130   # interrupted (Ctrl-C): the shell's code for it
    return 0 if result["best"] is not None else 1


def export_command(cfg, args) -> int:
    """Export the latest checkpoint of a run (local or remote storage) to <run.dir>/export."""
    from dflash_ray.run_layout import RunLayout
    from dflash_ray.runtime.record.summary import model_card_facts
    from dflash_ray.runtime.spec import resolve_spec
    from dflash_ray.runtime.checkpoints import RunCheckpoints

    # the checkpoint and the drafter's shape only: the shards are not read (they may have changed or be gone)
    run_spec = resolve_spec(cfg, log=lambda *a, **k: None, inputs=False)
    summary = RunLayout(run_spec.run_dir).summary    # the run's facts for the model card, when it has them
    facts = model_card_facts(run_spec, json.loads(summary.read_text()) if summary.exists() else None)
    exported = RunCheckpoints(run_spec.experiment_dir).export_latest(run_spec, dtype=args.dtype, card=facts)
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


def config_command(args) -> int:
    """Every config key of the typed schema (or those under the prefixes given): type, default, meaning."""
    from dflash_ray.config import reference_lines, reference_markdown, schema_keys

    if args.markdown:
        print(reference_markdown(), end="")
        return 0
    prefixes = list(args.overrides) or [""]
    known = [k.key for k in schema_keys()]
    for prefix in prefixes:
        if prefix and not any(k == prefix or k.startswith(prefix.rstrip(".") + ".") for k in known):
            raise UserError(f"no config key under '{prefix}' (groups: "
                            f"{', '.join(sorted({k.split('.')[0] for k in known if '.' in k}))})")
    for prefix in prefixes:
        for line in reference_lines(prefix):
            print(_wrap(line, indent="").replace("\n", "\n    "))
    return 0


# ----------------------------------------------------------------------------- evaluation
def target_time_words(speedup: float) -> str:
    """The target's forward time with the drafter against plain greedy decoding's (greedy s / speculative s), in
    words that cannot be misread: "2.62x less target time", or "1.64x the target time (slower)" below 1."""
    if not speedup == speedup or speedup <= 0:   # nan: no target time measured
        return "target time not measured"
    if speedup >= 1:
        return f"{speedup:.2f}x less target time than plain greedy decoding"
    return f"{1 / speedup:.2f}x the target time of plain greedy decoding (slower)"


def format_eval(s: dict) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in enumerate(s["acceptance_histogram"]) if v)
    return "\n".join([
        f"drafter {s['drafter']} vs target {s['target']}: {s['num_prompts']} prompts, {s['new_tokens']} new tokens, block {s['block_size']}",
        f"  tau (mean accepted + 1 per cycle)       : {s['tau']:.3f}  (per cycle over all prompts: {s['tau_per_cycle']:.3f})",
        f"  acceptance lengths (length:cycles)      : {hist}",
        f"  target forwards, speculative vs greedy  : {s['target_forwards_speculative']} vs {s['target_forwards_greedy']}",
        f"  target seconds, speculative vs greedy   : {s['target_seconds_speculative']:.3f} vs {s['target_seconds_greedy']:.3f} "
        f"({target_time_words(s['target_time_speedup'])})",
        f"  output equals plain greedy decoding     : {'yes' if s['outputs_match_greedy'] else 'NO'}",
    ])


def eval_command(cfg, args) -> int:
    """Greedy speculative decoding of an exported drafter against its target: tau, its distribution,
    target time saved, and a check that the output equals plain greedy decoding (exit 1 if not, in fp32)."""
    from omegaconf import OmegaConf

    from dflash_ray.config import require
    from dflash_ray.data.prepare import template_kwargs
    from dflash_ray.data.prompts import find_tokenizer, read_prompts
    from dflash_ray.model.generation import declared_end_token_ids
    from dflash_ray.model.evaluate import evaluate_acceptance
    from dflash_ray.hf_config import text_config

    drafter_dir = require(cfg, "drafter")
    # the target: model.target_path, as everywhere else (`target=` is eval's shorter alias)
    target_key = "target" if cfg.target is not None else "model.target_path"
    if cfg.target is None and OmegaConf.select(cfg, "model.target_path", throw_on_missing=False) is None:
        raise UserError("config key 'model.target_path' must be set: the target's Hugging Face directory "
                        "(or target=DIR, its alias for eval)")
    target_dir = str(cfg.target if cfg.target is not None else cfg.model.target_path)
    for key, d in (("drafter", drafter_dir), (target_key, target_dir)):
        if not (Path(d) / "config.json").exists():
            raise UserError(f"{d}: no config.json (config key '{key}' must name a Hugging Face-format directory)")
    tcfg, dcfg = (json.loads((Path(d) / "config.json").read_text()) for d in (target_dir, drafter_dir))
    tcfg = text_config(tcfg)
    for key, want in (("hidden_size", tcfg.get("hidden_size")), ("num_target_layers", tcfg.get("num_hidden_layers"))):
        if dcfg.get(key) != want:
            raise UserError(f"{drafter_dir}: drafter {key} {dcfg.get(key)} does not fit target {target_dir} ({want})")
    tok = find_tokenizer(cfg.data.tokenizer, target_dir)
    prompts = read_prompts(require(cfg, "data.prompts"), tok, cfg.eval.max_prompts, template_kwargs(cfg))
    vocab = int(tcfg["vocab_size"])
    for i, p in enumerate(prompts):
        if not p or min(p) < 0 or max(p) >= vocab:
            raise UserError(f"{cfg.data.prompts}: prompt {i + 1}: needs 1+ token ids in [0, {vocab}), got {p[:8]}")
    stop = declared_end_token_ids(tok, target_dir)   # every end token the target declares, as regenerate stops
    from dflash_ray.data.report import Tracked   # progress per prompt on stderr (a bar, or a line every few s)

    prompts = Tracked(prompts, "eval", "prompts", enabled=not args.json)
    stats = evaluate_acceptance(drafter_dir, target_dir, prompts, cfg.eval.max_new_tokens, stop_token_ids=stop)
    stats.pop("greedy_reference")   # the outputs themselves: for reuse by a caller evaluating more drafters
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
