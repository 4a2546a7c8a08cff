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
ratio (ray / plain) of at least 0.8.
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


def plain_loop(spec, steps: int, threads: int) -> dict:
    import numpy as np
    import torch

    from dflash_ray.data.shards import read_all
    from dflash_ray.model.target import load_feature_extractor
    from dflash_ray.runtime.feed import FILLER, Cursor, build_feed
    from dflash_ray.runtime.loop import batch_seed, build_model, make_optimizer
    from dflash_ray.runtime.pipeline import TokenStore
    from dflash_ray.runtime.spec import build_plan_for

    torch.set_num_threads(threads)
    store = TokenStore.from_table(read_all(spec.shards, spec.vocab_size))
    feed = build_feed(lambda e: build_plan_for(spec.plan_cfg, e), Cursor(), spec.world, spec.epochs, steps)
    target = load_feature_extractor(spec.target_path, spec.target_layer_ids)
    drafter = build_model(spec, torch.device("cpu"))
    opt, sched = make_optimizer(spec, drafter, feed.schedule_steps)
    params = drafter.trainable_parameters()
    rows = feed.table.to_pylist()
    times, tokens, losses = [], [], []
    for s in range(feed.steps):
        t0 = time.perf_counter()
        loss_sum, weight_sum, step_tokens = 0.0, 0.0, 0
        for row in rows[s * spec.world:(s + 1) * spec.world]:
            if row["position"] == FILLER:
                continue
            lengths = np.asarray(row["lengths"])
            ids, mask = store.batch(np.asarray(row["sample_ids"]), lengths, spec.pad_token_id)
            ids_t = torch.from_numpy(ids.astype(np.int64))
            mask_t = torch.from_numpy(mask.astype(np.int64))
            len_t = torch.from_numpy(lengths)
            attn = (torch.arange(ids_t.shape[1])[None] < len_t[:, None]).long()
            context = target(ids_t, attn)
            g = torch.Generator().manual_seed(batch_seed(spec.seed, row["epoch"], row["position"]))
            out = drafter.training_loss(ids_t, mask_t, context, len_t, g)
            out.loss_sum.backward()
            loss_sum += float(out.loss_sum.detach())
            weight_sum += float(out.weight_sum)
            step_tokens += int(row["num_tokens"])
        for p in params:
            if p.grad is not None:
                p.grad.div_(weight_sum)
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        tokens.append(step_tokens)
        losses.append(loss_sum / weight_sum)
    steady = sum(tokens[1:]) / sum(times[1:]) if len(times) > 1 else float("nan")
    return {"steps": feed.steps, "tokens": sum(tokens), "tokens_per_second": steady,
            "wall_seconds": sum(times), "final_loss": losses[-1], "threads": threads}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps on each side")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the plain loop")
    ap.add_argument("--run-root", default=None, help="where the benchmark's run directories go (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from dflash_ray.config import compose_config
    from dflash_ray.runtime.capacity import best_split
    from dflash_ray.runtime.driver import main_job
    from dflash_ray.runtime.spec import resolve_spec

    root = Path(args.run_root or tempfile.mkdtemp(prefix="dflash-bench-"))
    base = [f"run.root={root}", "run.name=bench", f"train.max_steps={args.steps}",
            f"train.checkpoint_every={args.steps}", *args.overrides]
    quiet = lambda *a, **k: None  # noqa: E731
    spec = resolve_spec(compose_config(base), log=quiet)
    plain = plain_loop(spec, args.steps, args.threads)
    print(f"plain single-process loop: {plain['tokens_per_second']:.0f} tokens/s "
          f"({plain['steps']} steps, {plain['threads']} threads)", flush=True)

    # the Ray run trains the same batches (its own run directory, same data and target)
    ray_cfg = compose_config(base + ["run.name=bench_ray", f"data.input={spec.run_dir}/corpus.jsonl",
                                     f"data.tokenizer={spec.tokenizer}", f"data.shards={spec.shards}",
                                     f"model.target_path={spec.target_path}"])
    t0 = time.time()
    ray_spec, summary = main_job(ray_cfg, progress=False, log=quiet, plan_log=quiet)
    ray_wall = time.time() - t0
    ratio = summary["tokens_per_second"] / plain["tokens_per_second"]
    m = summary["measured"]
    n_dev = spec.target_workers + spec.drafter_workers
    cap = best_split(max(n_dev, 2), m["target_tokens_per_second_per_actor"], m["drafter_tokens_per_second_per_worker"])
    result = {"plain": plain, "ray": {"steps": summary["steps"], "tokens": summary["tokens"],
                                      "tokens_per_second": summary["tokens_per_second"],
                                      "job_wall_seconds": ray_wall, "final_loss": summary["final_loss"],
                                      "target_actors": summary["target_actors"], "measured": m,
                                      "max_batches_in_flight": summary["max_batches_in_flight"]},
              "ratio": ratio, "goal": 0.8, "capacity": cap,
              "config": {"drafter_workers": spec.drafter_workers, "target_workers": spec.target_workers,
                         "grad_accum": spec.grad_accum, "cpus": os.cpu_count()}}
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    print(f"ray pipeline:              {summary['tokens_per_second']:.0f} tokens/s "
          f"({summary['steps']} steps, {spec.drafter_workers} drafter workers, {spec.target_workers} target "
          f"actor(s); job wall time incl. start-up {ray_wall:.0f}s)")
    print(f"ratio ray / plain:         {ratio:.2f}  (goal >= 0.8)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
