"""The whole job through Ray on one GPU, against the runtime's own step without Ray at the same batches.

Run by benchmarks/gpu_ray_check.sh (which installs the air-gapped wheelhouse when Ray is missing and starts
Ray first) on a GPU machine; its CPU path (--cpu-small: a tiny target, a local CPU cluster) runs in the tests.

    world    a tokenizer (word-level, a few hundred tokens), a target with random weights built on the
             device (Qwen3-8B's shape on CUDA: nothing downloaded) and seed-shaped shards (the seed run's six
             buckets and its long tail, random tokens, 70% of each sample supervised), made here
    job      `python -m dflash_ray.train model=qwen3_8b data=sharegpt cluster=1gpu ...` on the running Ray:
             one epoch (an epoch end with filler rows), two stream segments (one segment change: actors and
             trainers restarted, the checkpoint restored), a full-size checkpoint at the boundary and the end
    bare     the runtime's own pieces without Ray, in this process, on the same plan batches the job trained
             at the same steps: the target's forward (`target_forward.target_context`: the attention mask, the bf16
             encoding and its device-to-host copy), the row as a trainer decodes it (host-to-device copy), and
             `step.train_step` on `model.build_model` (DDP world of one, fused AdamW, compiled layers)
    report   one JSON (gpu_ray_check.json) and a table: the job's steps (wait vs compute, compiled graphs,
             device peak vs the memory model), the segment change's cost, the checkpoints' costs (on the
             step's path and in the background), the object store, and the ratio that matters: the job's
             context tokens/s over a window of steps / the bare pieces' over the same batches (goal >= 0.85;
             on one GPU the bare pieces run one after the other, the job's target and drafter share the GPU)

    python benchmarks/gpu_ray_check.py --out DIR               # CUDA: Qwen3-8B shape
    python benchmarks/gpu_ray_check.py --out DIR --cpu-small   # CPU: tiny shapes (the tests)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_density import BOUNDS as SEED_BOUNDS, SEED_BATCHES  # noqa: E402  (the seed run's buckets)

RATIO_GOAL = 0.85
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1000000.0, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
            tie_word_embeddings=False)
GRAD_ACCUM = 2   # two plan batches a step: an epoch of an odd count ends with a filler row (its dtype path)


def make_tokenizer(out: Path, n_words: int = 300) -> Path:
    """A word-level tokenizer: special tokens, then t0..t{n-1}; saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, "<|unk|>": 2}
    vocab.update({f"t{i}": 3 + i for i in range(n_words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|unk|>")
    fast.save_pretrained(out)
    return out


def make_target(out: Path, shape: dict, cuda: bool) -> tuple[Path, float]:
    """A Qwen3 causal LM with random weights, built on the device (an 8B model initialises in seconds on a
    GPU, minutes on the CPU), saved in bf16 (CUDA) or fp32. Returns (dir, seconds)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    model = model.to(torch.bfloat16 if cuda else torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out, time.perf_counter() - t0


def seed_lengths(batches: int, bounds: list[int], budget: int, seed: int = 0) -> np.ndarray:
    """Sample lengths uniform inside each bucket, the buckets' token shares as in the seed epoch (its
    batches per bucket at one token budget: the long tail holds most tokens), about `batches` batches of
    `budget` tokens in all."""
    rng = np.random.default_rng(seed)
    lower = [min(64, bounds[0] // 2)] + bounds[:-1]
    share = np.array(SEED_BATCHES, float) / sum(SEED_BATCHES)
    out = []
    for s, lo, hi in zip(share, lower, bounds):
        n = max(2, int(round(s * batches * budget / ((lo + hi) / 2))))
        out.append(rng.integers(lo + 1, hi + 1, size=n))
    return np.concatenate(out)


def make_shards(out: Path, lengths: np.ndarray, first_word: int, words: int, seed: int = 0) -> int:
    """Shards in the prepared schema: random word tokens, the first 30% of each sample unsupervised."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = 2000
    for f, start in enumerate(range(0, lengths.size, per_file)):
        ls = lengths[start:start + per_file]
        ids = [rng.integers(first_word, first_word + words, size=int(n)).astype(np.int32) for n in ls]
        masks = []
        for n in ls:
            m = np.ones(int(n), np.int8)
            m[: int(n * 0.3)] = 0
            masks.append(m)
        pq.write_table(pa.table({
            "sample_id": pa.array(np.arange(start, start + ls.size, dtype=np.int64)),
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
            "num_tokens": pa.array(ls.astype(np.int32)),
            "num_supervised": pa.array([int(m.sum()) for m in masks], type=pa.int32()),
        }), out / f"part-{f:05d}.parquet")
    return int(lengths.sum())


def job_overrides(args, world: dict, run_root: Path, segment_blocks: int) -> list[str]:
    common = [f"run.root={run_root}", "run.name=ray_check", f"data.shards={world['shards']}",
              f"data.tokenizer={world['tokenizer']}", f"data.input={world['shards']}",
              f"model.target_path={world['target']}", "data.heldout_fraction=0", "train.epochs=1",
              f"train.stream_segment_blocks={segment_blocks}", "cluster.stream_block_mb=0",   # a batch a block
              f"train.grad_accum={GRAD_ACCUM}",
              "cluster.address=auto"] + (["train.compile=false"] if args.no_compile else [])
    if args.cpu_small:
        # one drafter worker, as cluster=1gpu has (steps of GRAD_ACCUM plan batches)
        return ["model=qwen3_8b", "data=sharegpt", "cluster=local", "cluster.drafter_workers=1", *common,
                f"data.bucket_boundaries=[{','.join(str(b) for b in world['bounds'])}]",
                f"data.max_tokens_per_batch={world['budget']}", f"model.max_block_tokens_per_batch={world['budget']}",
                "model.num_anchors=32", "model.block_size=4", "model.num_draft_layers=2",
                "model.target_layer_ids=[1,2]"]
    return ["model=qwen3_8b", "data=sharegpt", "cluster=1gpu", *common]


def run_job(overrides: list[str], out: Path, timeout: int) -> dict:
    """The main job as a user runs it, on the Ray the shell script started (cluster.address=auto)."""
    t0 = time.perf_counter()
    with open(out / "job.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "dflash_ray.train", *overrides], stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    run_dir = next(Path(o.split("=", 1)[1]) for o in overrides if o.startswith("run.root=")) / "ray_check"
    if proc.returncode != 0:
        tail = (out / "job.log").read_text()[-3000:]
        raise RuntimeError(f"the job failed (exit {proc.returncode}):\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"wall_seconds": wall, "summary": summary, "metrics": metrics, "run_dir": str(run_dir)}


def job_figures(job: dict, window: tuple[int, int], segment_steps: int) -> dict:
    """Per-step figures of the job: wait vs compute, compiled graphs, device peaks; tokens/s over the
    window of steps (wall clock between the steps' lines); the segment change's extra seconds."""
    lines = [m for m in job["metrics"] if "step" in m and "loss" in m]
    by_step = {m["step"]: m for m in lines}
    lo, hi = window
    span = [by_step[s] for s in range(lo, hi + 1) if s in by_step]
    secs = span[-1]["time"] - by_step[lo - 1]["time"] if (lo - 1) in by_step else sum(m["step_seconds"] for m in span)
    tokens = sum(m["tokens"] for m in span)
    step_s = np.array([m["step_seconds"] for m in lines])
    median = float(np.median(step_s))
    change = None
    if segment_steps and (segment_steps + 1) in by_step and segment_steps in by_step:
        change = by_step[segment_steps + 1]["time"] - by_step[segment_steps]["time"] - median
    waits = np.array([m.get("wait_seconds", 0.0) for m in span])    # the window: past the pipeline's start
    comp = np.array([m.get("compute_seconds", 0.0) for m in span])
    s = job["summary"]
    return {
        "steps": len(lines), "window": [lo, hi], "window_tokens": tokens, "window_seconds": secs,
        "tokens_per_second": tokens / secs if secs > 0 else None,
        "block_tokens_per_second": s.get("block_tokens_per_second"),
        "block_tokens_per_token": s.get("block_tokens_per_token"),
        "median_step_seconds": median, "wait_share": float(waits.sum() / max(1e-9, waits.sum() + comp.sum())),
        "compiled_graphs": max((m.get("compiled_graphs", 0) for m in lines), default=0),
        "compiled_graphs_after_step_10": sorted({m.get("compiled_graphs") for m in lines if m["step"] > 10} - {None}),
        "device_peak_gib": max((m.get("device_peak_gib", 0.0) for m in lines), default=0.0),
        "segment_change_extra_seconds": change, "segments": s.get("stream_segments"),
        "checkpoints": s.get("checkpoints"), "checkpoint_cost": s.get("checkpoint_cost"),
        "target_restarts": s.get("target_restarts"), "trainer_restarts": s.get("trainer_restarts"),
        "ledger_ok": (s.get("ledger") or {}).get("ok"), "job_wall_seconds": job["wall_seconds"],
    }


def bare_pieces(overrides: list[str], window: tuple[int, int], warmup: int) -> dict:
    """The runtime's pieces without Ray on the plan batches the job's steps lo..hi trained (one drafter
    worker: step s trains positions (s-1) x W .. s x W - 1 of epoch 0, W = GRAD_ACCUM), `warmup` steps
    before them untimed (the compile's first graphs): seconds of each piece."""
    import torch

    from dflash_ray.config import compose_config
    from dflash_ray.data.plan import plan_from_config
    from dflash_ray.data.shards import read_all
    from dflash_ray.model.target import load_feature_extractor
    from dflash_ray.runtime.spec import resolve_spec
    from dflash_ray.runtime.stream.target_forward import target_context
    from dflash_ray.runtime.stream.rows import TrainRow
    from dflash_ray.runtime.training.model import build_model
    from dflash_ray.runtime.training.step import train_step

    cfg = compose_config([o for o in overrides if not o.startswith("cluster.address")])
    spec = resolve_spec(cfg, log=lambda *a, **k: None, record=False)
    plan = plan_from_config(cfg, epoch=0)
    table = read_all(spec.shards)
    index = {int(s): i for i, s in enumerate(table.column("sample_id").to_numpy())}
    ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
    cuda = spec.cluster.use_gpu
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    extract = load_feature_extractor(spec.target_path, list(spec.drafter.target_layer_ids), device=device,
                                     dtype=getattr(torch, spec.compute_dtype))
    drafter, model, opt, sched = build_model(spec, device, 1, -(-plan.num_batches // GRAD_ACCUM))
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if spec.compute_dtype == "bfloat16" \
        else __import__("contextlib").nullcontext
    lo, hi = window
    timed = {"forward_and_encode": 0.0, "step": 0.0, "tokens": 0, "batches": 0}
    for step in range(max(1, lo - warmup), hi + 1):
        rows, forward = [], 0.0
        for k in range((step - 1) * GRAD_ACCUM, min(step * GRAD_ACCUM, plan.num_batches)):
            samples = plan.batch(k)
            lengths = plan.lengths[plan.offsets[k]:plan.offsets[k + 1]]
            width = int(plan.max_len[k])
            ids = np.full((len(samples), width), spec.pad_token_id, np.int32)
            mask = np.zeros((len(samples), width), np.int8)
            for r, (sid, n) in enumerate(zip(samples, lengths)):
                i = index[int(sid)]
                ids[r, :n] = ids_col[i].values.to_numpy()[:n]
                mask[r, :n] = mask_col[i].values.to_numpy()[:n]
            sync()
            t0 = time.perf_counter()
            feats, dtype, _ = target_context(extract, ids, lengths, device)   # its .cpu() waits for the GPU
            forward += time.perf_counter() - t0
            rows.append(TrainRow(index=k, gen=0, epoch=0, position=k, epoch_batches=plan.num_batches,
                                 bucket=int(plan.bucket[k]), num_tokens=int(lengths.sum()), input_ids=ids,
                                 loss_mask=mask, lengths=np.asarray(lengths, np.int32), context=feats,
                                 context_dtype=dtype))
        if len(rows) < GRAD_ACCUM:   # the epoch's last step: the job pads it with a filler; time what is real
            continue
        t1 = time.perf_counter()
        train_step(model, drafter, opt, sched, rows, rank=0, workers=1, batches_per_step=GRAD_ACCUM,
                   seed=spec.seed, grad_clip=spec.train.grad_clip, device=device, autocast=autocast)
        sync()
        if step >= lo:
            timed["forward_and_encode"] += forward
            timed["step"] += time.perf_counter() - t1
            timed["tokens"] += sum(r.num_tokens for r in rows)
            timed["batches"] += len(rows)
    total = timed["forward_and_encode"] + timed["step"]
    timed["tokens_per_second"] = timed["tokens"] / total if total > 0 else None
    timed["device_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return timed


def memory_model(overrides: list[str]) -> dict:
    from dflash_ray.runtime.plan_sizing import plan_memory
    from dflash_ray.config import compose_config
    from dflash_ray.data.plan import plan_from_config

    cfg = compose_config([o for o in overrides if not o.startswith("cluster.address")])
    m = plan_memory(cfg, plan_from_config(cfg, epoch=0))
    return {"drafter_step_gib": m["drafter"]["total"] / 2**30 if "drafter" in m else None,
            "target_actor_gib": m["target"]["total"] / 2**30 if "target" in m else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-small", action="store_true", help="tiny shapes on a local CPU cluster (the tests)")
    ap.add_argument("--batches", type=int, default=None, help="plan batches of the epoch (about: CUDA 80, CPU 24)")
    ap.add_argument("--job-timeout", type=int, default=420)
    ap.add_argument("--no-compile", action="store_true",
                    help="train.compile=false (a rerun's fallback when the drafter's compiles eat the 8 minutes)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("GPU_RAY_CHECK_WORK", out / "work"))
    cuda = not args.cpu_small
    batches = args.batches or (80 if cuda else 24)
    bounds = SEED_BOUNDS if cuda else [b // 16 for b in SEED_BOUNDS]
    budget = 16384 if cuda else 1024
    report: dict = {"device": "cuda" if cuda else "cpu", "goal_ratio": RATIO_GOAL}
    t0 = time.perf_counter()
    tok = make_tokenizer(work / "tokenizer")
    target, build_s = make_target(work / "target", QWEN3_8B if cuda else TINY, cuda)
    from dflash_ray.config import compose_config
    from dflash_ray.data.plan import plan_from_config

    world = {"tokenizer": str(tok), "target": str(target), "shards": str(work / "shards"), "bounds": bounds,
             "budget": budget}
    probe = [o for o in job_overrides(args, world, work / "runs", 0) if not o.startswith("cluster.address")]
    for seed in range(20):   # an odd number of batches: the epoch's last step holds a filler row
        lengths = seed_lengths(batches, bounds, budget, seed=seed)
        tokens = make_shards(work / "shards", lengths, first_word=3, words=300)
        n_batches = plan_from_config(compose_config(probe), epoch=0).num_batches
        if n_batches % GRAD_ACCUM:
            break
    report["world"] = {"seconds": time.perf_counter() - t0, "target_build_seconds": build_s,
                       "samples": int(lengths.size), "tokens": tokens}
    print(f"world: {lengths.size:,} samples, {tokens:,} tokens; target built in {build_s:.1f} s", flush=True)

    steps = -(-n_batches // GRAD_ACCUM)
    segment_steps = -(-steps // 2)   # two segments: the second one the shorter
    overrides = job_overrides(args, world, work / "runs", segment_steps * GRAD_ACCUM)   # blocks of one row
    report["plan_batches"] = n_batches
    report["filler_rows"] = steps * GRAD_ACCUM - n_batches
    lo = min(segment_steps, 10 if cuda else 4) + 1   # after the compile's first graphs
    window = (lo, max(lo, segment_steps))           # inside the first segment
    save = lambda: (out / "gpu_ray_check.json").write_text(json.dumps(report, indent=2, default=str))  # noqa: E731
    save()   # what is known so far: a time-out later still leaves it
    try:
        job = run_job(overrides, out, args.job_timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:   # the bare pieces still say what they can
        report["job_error"] = str(e)[-2000:]
        save()
        print(f"the job failed: {str(e)[-600:]}", flush=True)
        report["bare"] = bare_pieces(overrides, window, warmup=3)
        save()
        return 1
    figures = job_figures(job, window, segment_steps)
    report["job"] = figures
    save()
    print(f"job: {figures['steps']} steps in {figures['job_wall_seconds']:.1f} s", flush=True)
    report["memory_model"] = memory_model(overrides)
    bare = bare_pieces(overrides, window, warmup=3)
    report["bare"] = bare
    ratio = figures["tokens_per_second"] / bare["tokens_per_second"] if bare["tokens_per_second"] else None
    report["ratio"] = ratio
    save()
    ck = [c for c in (figures["checkpoints"] or []) if c.get("bytes")]
    print()
    print(f"{'what':46} {'figure':>14}")
    rows = [("plan batches (one epoch, two stream segments)", f"{n_batches} ({report['filler_rows']} filler)"),
            ("job steps / ledger exactly-once", f"{figures['steps']} / {figures['ledger_ok']}"),
            (f"job context tokens/s, steps {window[0]}-{window[1]}", f"{figures['tokens_per_second']:,.0f}"),
            ("bare pieces tokens/s, same batches", f"{bare['tokens_per_second']:,.0f}"),
            (f"ratio job / bare (goal >= {RATIO_GOAL})", f"{ratio:.3f}" if ratio else "n/a"),
            ("  bare: target forward + encode s", f"{bare['forward_and_encode']:.2f}"),
            ("  bare: drafter step s", f"{bare['step']:.2f}"),
            ("job block tokens/s (whole run)", f"{figures['block_tokens_per_second'] or 0:,.0f}"),
            ("block tokens per context token", f"{figures['block_tokens_per_token'] or 0:.2f}"),
            ("trainer wait share of step time (window)", f"{figures['wait_share']:.1%}"),
            ("compiled graphs (max; after step 10)", f"{figures['compiled_graphs']}; {figures['compiled_graphs_after_step_10']}"),
            ("segment change, extra seconds", f"{figures['segment_change_extra_seconds'] or 0:.1f}"),
            ("drafter device peak GiB (job / model)",
             f"{figures['device_peak_gib']:.2f} / {report['memory_model']['drafter_step_gib'] or 0:.2f}"),
            ("checkpoint GiB", f"{ck[-1]['bytes'] / 2**30:.2f}" if ck else "n/a"),
            ("checkpoint on the step's path s (max)", f"{max(c.get('seconds', 0) for c in ck):.2f}" if ck else "n/a"),
            ("checkpoint background write+upload s (max)",
             f"{max(c.get('upload_seconds') or 0 for c in ck):.2f}" if ck else "n/a")]
    for what, fig in rows:
        print(f"{what:46} {fig:>14}")
    ok = figures["ledger_ok"] and figures["steps"] == steps
    print(f"the job trained every batch once: {'PASS' if ok else 'FAIL'}")
    if cuda:
        print(f"ratio >= {RATIO_GOAL}: {'PASS' if ratio and ratio >= RATIO_GOAL else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
