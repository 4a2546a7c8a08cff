"""Ray pipeline vs a plain single-process loop, on the same batches (the CPU default unless overridden).

    .venv/bin/python benchmarks/bench_pipeline.py [--steps N] [overrides...]

Both sides train the same plan batches with the same math: the first N optimizer steps of epoch 0, each
W = drafter_workers x grad_accum consecutive plan batches; per batch the target's tapped-layer features
and the drafter's loss, backward; per step one AdamW update normalised by the step's weight sum.

* plain: one process, no Ray: join tokens -> target forward -> drafter step, one batch after another.
* ray:   the main job (Ray Data stream -> TargetForward actor(s) -> TorchTrainer workers, DDP over gloo),
         started in-process with a local Ray exactly as `dflash-ray train` does.

Tokens/s is steady state on both sides: real (unpadded) tokens of steps 2..N over their wall time (the
first step carries process start-up and, for Ray, the pipeline's warm-up); the Ray job's whole wall time
is printed too. Then the capacity model with the rates this run measured. The goal on 2 cores is a
ratio (ray / plain) of at least 0.8 (`--check`: exit 1 below it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
GOAL = 0.8   # Ray pipeline tokens/s over the plain loop's


def plain_setup(run_spec, steps: int):
    """What a Ray-free loop over the run's batches needs (this file's plain loop, bench_load's calibration):
    the token store, the feed of `steps` steps and its rows, the target, the run's drafter and optimizer."""
    from types import SimpleNamespace

    import torch

    from dflash_ray.data.shards import read_all
    from dflash_ray.model.target import load_feature_extractor
    from dflash_ray.runtime.stream.feed import Cursor, build_feed
    from dflash_ray.runtime.training.model import LossModule, build_run_drafter, make_optimizer
    from dflash_ray.runtime.stream.token_store import TokenStore

    feed = build_feed(run_spec.build_plan, Cursor(), run_spec.batches_per_step, run_spec.train.epochs, steps)
    drafter = build_run_drafter(run_spec, torch.device("cpu"))
    opt, sched = make_optimizer(run_spec.train, drafter, feed.schedule_steps)
    return SimpleNamespace(
        store=TokenStore.from_table(read_all(run_spec.shards, run_spec.vocab_size)), feed=feed,
        rows=feed.table.to_pylist(), drafter=drafter, model=LossModule(drafter), opt=opt, sched=sched,
        target=load_feature_extractor(run_spec.target_path, list(run_spec.drafter.target_layer_ids)))


def plain_row(p, run_spec, row):
    """One feed row as a trainer receives it (tokens joined, the target's features), and the CPU seconds
    (this thread's) of its target forward."""
    import numpy as np

    from dflash_ray.runtime.stream.target_forward import target_context
    from dflash_ray.runtime.stream.rows import TrainRow, token_row

    lengths = np.asarray(row["lengths"])
    ids, mask = p.store.batch(np.asarray(row["sample_ids"]), lengths, run_spec.pad_token_id)
    c0 = time.thread_time()
    context, dtype, _ = target_context(p.target, ids, lengths, "cpu")
    target_cpu = time.thread_time() - c0
    cols = token_row(row, 0, ids, mask, lengths)
    return TrainRow.from_batch({**cols, "context": context[None], "context_dtype": np.array([dtype])}), target_cpu


def plain_loop(run_spec, steps: int, threads: int) -> dict:
    """The same batches and the same step function (`train_step`) as the Ray workers, in one process."""
    import torch

    from dflash_ray.runtime.stream.rows import FILLER
    from dflash_ray.runtime.training.step import train_step

    torch.set_num_threads(threads)
    per_step = run_spec.batches_per_step
    p = plain_setup(run_spec, steps)
    feed, rows, drafter, model, opt, sched = p.feed, p.rows, p.drafter, p.model, p.opt, p.sched
    times, tokens, losses = [], [], []
    for s in range(feed.steps):
        t0 = time.perf_counter()
        batch = []
        for row in rows[s * per_step:(s + 1) * per_step]:
            if row["position"] == FILLER:
                continue  # the plain loop has no collective to keep in step
            batch.append(plain_row(p, run_spec, row)[0])
        result = train_step(model, drafter, opt, sched, batch, rank=0, workers=1, batches_per_step=len(batch),
                            seed=run_spec.seed, grad_clip=run_spec.train.grad_clip, device=torch.device("cpu"))
        times.append(time.perf_counter() - t0)
        tokens.append(result.tokens)
        losses.append(result.loss)
    steady = sum(tokens[1:]) / sum(times[1:]) if len(times) > 1 else float("nan")
    return {"steps": feed.steps, "tokens": sum(tokens), "tokens_per_second": steady,
            "wall_seconds": sum(times), "final_loss": losses[-1], "threads": threads}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps on each side")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the plain loop")
    ap.add_argument("--run-root", default=None, help="where the benchmark's run directories go (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 when the ratio misses the goal")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import make_demo_inputs, make_missing_inputs
    from dflash_ray.sizing.capacity import best_split
    from dflash_ray.runtime.spec import resolve_spec
    from dflash_ray.train import main_job

    root = Path(args.run_root or tempfile.mkdtemp(prefix="dflash-bench-"))
    base = [f"run.root={root}", "run.name=bench", f"train.max_steps={args.steps}",
            f"train.checkpoint_every={args.steps}", *args.overrides]
    quiet = lambda *a, **k: None  # noqa: E731
    cfg = compose_config(base)
    make_demo_inputs(cfg, log=quiet)
    make_missing_inputs(cfg, log=quiet)
    run_spec = resolve_spec(cfg, log=quiet)
    plain = plain_loop(run_spec, args.steps, args.threads)
    print(f"plain single-process loop: {plain['tokens_per_second']:.0f} tokens/s "
          f"({plain['steps']} steps, {plain['threads']} threads)", flush=True)

    # the Ray run trains the same batches (its own run directory, same data and target)
    ray_cfg = compose_config(base + ["run.name=bench_ray", f"data.input={run_spec.run_dir}/corpus.jsonl",
                                     f"data.tokenizer={run_spec.tokenizer}", f"data.shards={run_spec.shards}",
                                     f"model.target_path={run_spec.target_path}"])
    t0 = time.time()
    ray_spec, summary = main_job(ray_cfg, progress=False, log=quiet, plan_log=quiet)
    ray_wall = time.time() - t0
    ratio = summary["tokens_per_second"] / plain["tokens_per_second"]
    m = summary["measured"]
    n_dev = run_spec.cluster.target_workers + run_spec.cluster.drafter_workers
    cap = best_split(max(n_dev, 2), m["target_tokens_per_second_per_actor"], m["drafter_tokens_per_second_per_worker"])
    result = {"plain": plain, "ray": {"steps": summary["steps"], "tokens": summary["tokens"],
                                      "tokens_per_second": summary["tokens_per_second"],
                                      "job_wall_seconds": ray_wall, "final_loss": summary["final_loss"],
                                      "target_actors": summary["target_actors"], "measured": m,
                                      "max_batches_in_flight": summary["max_batches_in_flight"]},
              "ratio": ratio, "goal": GOAL, "pass": ratio >= GOAL, "capacity": cap,
              "config": {"drafter_workers": run_spec.cluster.drafter_workers, "target_workers": run_spec.cluster.target_workers,
                         "grad_accum": run_spec.train.grad_accum, "cpus": os.cpu_count()}}
    failed = 1 if (args.check and ratio < GOAL) else 0
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return failed
    print(f"ray pipeline:              {summary['tokens_per_second']:.0f} tokens/s "
          f"({summary['steps']} steps, {run_spec.cluster.drafter_workers} drafter workers, {run_spec.cluster.target_workers} target "
          f"actor(s); job wall time incl. start-up {ray_wall:.0f}s)")
    print(f"ratio ray / plain:         {ratio:.2f}  (goal >= {GOAL}: {'PASS' if ratio >= GOAL else 'FAIL'})")
    print(f"final loss: plain {plain['final_loss']:.4f}, ray {summary['final_loss']:.4f} (same batches)")
    print(f"measured per device: target {m['target_tokens_per_second_per_actor']:.0f} tokens/s per actor "
          f"(busy time), drafter {m['drafter_tokens_per_second_per_worker']:.0f} tokens/s per worker "
          f"(compute time); trainers waited for data {100 * (m['trainer_wait_fraction'] or 0):.0f}% of the time")
    b = cap["best"]
    print(f"capacity model for {max(n_dev, 2)} devices: best split {b['target']} target + {b['drafter']} "
          f"drafter -> {b['tokens_per_second']:.0f} tokens/s ({b['bottleneck']})")
    for s in cap["splits"]:
        print(f"  {s['target']} target + {s['drafter']} drafter: {s['tokens_per_second']:8.0f} tokens/s "
              f"({s['bottleneck']})")
    return failed


if __name__ == "__main__":
    sys.exit(main())
