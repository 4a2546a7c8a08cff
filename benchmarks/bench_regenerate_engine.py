"""Regeneration's engines on the real model, the same conversations, alternating in one invocation:
  batched     generate() over batches of like-length prompts, each running to its longest row (in process)
  continuous  transformers' continuous batching, a finished row's slot refilled at once (in process)
  http        an OpenAI-compatible server: `transformers serve` on 127.0.0.1 over the same weights in the same
              dtype, started here, answering `--concurrency` requests in flight (the http engine in process)
  vllm        vLLM as a Ray Data LLM stage on this machine's GPU, through the job itself (a local Ray); only
              where vLLM is installed (a GPU machine), asked for with --engines
Prints, per engine, the wall time, conversations/s, generated tokens/s and the share of assistant turns equal to
the batched engine's (greedy: the same answer), and writes them as JSON.

    .venv/bin/python benchmarks/bench_regenerate_engine.py --conversations 240
    python benchmarks/bench_regenerate_engine.py --engines batched,vllm --device cuda --dtype bfloat16   # a GPU

The conversations are a smol_prompts world's (its corpus.jsonl: two-turn instructions), the target
SmolLM2-135M-Instruct as the `smollm2_135m` preset gives it, in the dtype the preset picks on this processor
(--dtype to force one). Useful tokens are those the engine generated for turns it kept or dropped, as each
engine counts them (the servers' own usage for http).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_dir: str, dtype: str, log: Path):
    """`transformers serve` over model_dir on a free port: (process, base URL) once /v1/models answers."""
    port = _free_port()
    exe = Path(sys.executable).parent / "transformers"
    proc = subprocess.Popen([str(exe), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", dtype, "--log-level", "warning"], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"transformers serve did not start: {log.read_text()[-2000:]}")
            time.sleep(1)


def vllm_job(cfg, rows: list[dict], dtype: str, max_new: int, on_max: str, template) -> tuple[list, dict]:
    """engine=vllm through the regeneration job on a local Ray (this machine's GPUs): (conversations, counts)."""
    import ray

    from dflash_ray.runtime.jobs.regenerate import regenerate

    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    src = work / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(k), "conversations": r["conversations"]}) + "\n"
                           for k, r in enumerate(rows)))
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    counts = regenerate(str(src), str(work / "out.jsonl"), target_dir=str(cfg.model.target_path),
                        tokenizer_dir=str(cfg.data.tokenizer or cfg.model.target_path), cluster=None,
                        max_new_tokens=max_new, batch_size=cfg.regenerate.batch_size, on_max_tokens=on_max,
                        template_kwargs=template, dtype=dtype, engine="vllm",
                        engine_kwargs={"dtype": dtype, "max_model_len": 4096}, log=lambda *a: None)
    by_id = {r["id"]: r["conversations"] for r in map(json.loads, (work / "out.jsonl").read_text().splitlines())}
    return [by_id.get(str(k)) for k in range(len(rows))], counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", help="conversations .jsonl (default: the smol_prompts preset's generated "
                                     "instructions, written here: the world's corpus.jsonl)")
    ap.add_argument("--conversations", type=int, default=240)
    ap.add_argument("--engines", default="batched,continuous,http")
    ap.add_argument("--batch-size", type=int, default=0, help="rows in flight (0: the preset's regenerate.batch_size)")
    ap.add_argument("--concurrency", type=int, default=8, help="http: requests in flight")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="float32 | bfloat16 (default: the preset's choice here)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    import torch

    from dflash_ray.config import compose_config, compute_dtype
    from dflash_ray.data.prepare import template_kwargs
    from dflash_ray.data.supervision import Rendering
    from dflash_ray.model.generation import Regenerator
    from dflash_ray.model.http_engine import HttpRegenerator
    from dflash_ray.paths import resolve_model_paths
    from dflash_ray.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    cfg = compose_config(["model=smollm2_135m", "data=smol_prompts", "run.root=/tmp/dflash-ray-bench-regen"])
    resolve_model_paths(cfg)
    if not args.corpus:
        from dflash_ray.demo.world import write_generated

        args.corpus = str(write_generated(cfg, Path(tempfile.mkdtemp()) / "corpus.jsonl", args.conversations,
                                          split="train"))
    rows = [json.loads(line) for line in Path(args.corpus).read_text().splitlines()[: args.conversations]]
    convs = [r["conversations"] for r in rows]
    dtype = args.dtype or compute_dtype(cfg) or "float32"
    target, tokdir = str(cfg.model.target_path), str(cfg.data.tokenizer or cfg.model.target_path)
    rendering = Rendering(load_tokenizer(tokdir), template_kwargs(cfg))
    batch = args.batch_size or cfg.regenerate.batch_size
    max_new, on_max = cfg.regenerate.max_new_tokens, cfg.regenerate.on_max_tokens
    engines = args.engines.split(",")
    server = None
    runners = {}
    for name in engines:
        if name in ("batched", "continuous"):
            regen = Regenerator(target, rendering, max_new_tokens=max_new, batch_size=batch, on_max_tokens=on_max,
                                dtype=getattr(torch, dtype), engine=name, device=args.device)
            runners[name] = regen
        elif name == "http":
            # started for its own runs only: its idle server process keeps a core busy (seen: ~95% of one core
            # with no request in flight), which would slow the engines measured beside it
            def http_run(c):
                nonlocal server
                server, url = serve(target, dtype, Path(tempfile.mkdtemp()) / "serve.log")
                try:
                    http = HttpRegenerator(target, rendering, url=url, max_new_tokens=max_new,
                                           on_max_tokens=on_max, concurrency=args.concurrency)
                    t0 = time.perf_counter()
                    out, counts = http(c)
                    return out, counts, time.perf_counter() - t0
                finally:
                    server.terminate()
                    server.wait(timeout=60)
                    server = None

            runners[name] = http_run
        elif name == "vllm":
            runners[name] = lambda c: vllm_job(cfg, rows, dtype, max_new, on_max, template_kwargs(cfg))
        else:
            raise SystemExit(f"--engines: {name!r} is not one of batched, continuous, http, vllm")
    runs = {name: [] for name in engines}
    outputs = {}
    try:
        for _ in range(args.repeats):
            for name in engines:
                t0 = time.perf_counter()
                out, counts, *timed = runners[name](convs)
                seconds = timed[0] if timed else time.perf_counter() - t0   # http: its server's start-up untimed
                runs[name].append({"seconds": seconds, "generated_tokens": counts.get("generated tokens", 0),
                                   "regenerated_turns": counts.get("regenerated turns", 0),
                                   "dropped_loops": counts.get("turns dropped: a greedy loop", 0),
                                   "kept_conversations": sum(c is not None for c in out),
                                   "counts": dict(counts)})
                outputs[name] = out
                print(f"{name:>10}: {seconds:.1f} s, {counts.get('generated tokens', 0)} tokens, "
                      f"{counts.get('regenerated turns', 0)} turns", flush=True)
    finally:
        if server is not None:
            server.terminate()
    base = outputs.get("batched")

    def turns(conv):
        return [m for m in conv or [] if m["role"] == "assistant"]

    def equal_share(other) -> tuple[int, int]:
        """(assistant turns of batched's that the other engine wrote the same at the same place, batched's turns)."""
        same = total = 0
        for a, b in zip(base, other):
            ta, tb = turns(a), turns(b)
            total += len(ta)
            same += sum(x == y for x, y in zip(ta, tb))
        return same, total

    print(f"\n{len(convs)} conversations (two turns each), {batch} rows in flight (http: {args.concurrency} requests), "
          f"dtype {dtype}, {args.threads} threads, device {args.device}\n")
    print("| engine | seconds (median) | conversations/s | generated tokens/s | turns kept | turns equal to batched |")
    print("|---|---|---|---|---|---|")
    table = {}
    for name, rs in runs.items():
        s = statistics.median(r["seconds"] for r in rs)
        r = rs[-1]
        same, total = equal_share(outputs[name]) if base is not None else (0, 0)
        table[name] = {"seconds": s, "tokens_per_s": r["generated_tokens"] / s, "equal_turns": same,
                       "batched_turns": total}
        print(f"| {name} | {s:.1f} | {len(convs) / s:.2f} | {r['generated_tokens'] / s:.0f} | "
              f"{r['regenerated_turns']} | {f'{same}/{total} ({same / max(total, 1):.0%})' if base else '-'} |")
    if "batched" in table:
        for name in table:
            if name != "batched":
                print(f"{name} / batched tokens/s: {table[name]['tokens_per_s'] / table['batched']['tokens_per_s']:.2f}")
    if args.json:
        sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
        from step_loop import provenance   # the commit, whether the tree had changes, the exact command

        Path(args.json).write_text(json.dumps({"provenance": provenance(), "args": vars(args), "dtype": dtype,
                                               "batch_size": batch, "runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
