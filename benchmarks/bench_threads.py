"""How many torch threads each kind of process should use on a small CPU machine, and how idle threads should
wait: each kind's real work, timed at 1 thread, 2 spinning threads (OMP_WAIT_POLICY=ACTIVE, GNU OpenMP's
default) and 2 sleeping threads (PASSIVE), on a quiet machine and beside one CPU-bound process this script
starts and stops itself (a busy loop). dflash_ray/threads.py's defaults come from this table.

    python benchmarks/bench_threads.py              # the table (about 4 minutes on two cores)
    python benchmarks/bench_threads.py --repeat 3   # more timed units per cell

Each cell is a fresh process (OpenMP reads its wait policy once, at load) that builds its inputs, runs one
untimed unit, then times --repeat units; the figure is milliseconds per unit (lower is better). The kinds,
with the demo world's shapes (dflash_ray/conf/model/tiny.yaml: a 6-layer, 64-wide target, vocabulary 512):

    driver      the demo target's training: one AdamW step on a 4,096-token batch (16 x 256)
    regenerate  generate(): 32 prompts of 40 tokens, 64 new tokens each (greedy, KV cache)
    target      a target actor's feature forward: one plan batch (8 x 128 tokens), layers tapped
    trainer     a drafter training step (2 layers, block 8, 64 anchors) on one plan batch of features
    evaluate    speculative decoding of one prompt (64 new tokens) with a fresh drafter, plus greedy decoding

The last column says which setting was fastest in the worse of the two loads (the busy one, in practice).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

KINDS = ("driver", "regenerate", "target", "trainer", "evaluate")
SETTINGS = (("1", "PASSIVE"), ("2", "ACTIVE"), ("2", "PASSIVE"))   # (threads, OMP_WAIT_POLICY)
TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
              tie_word_embeddings=True)
VOCAB = 512


def one(kind: str, threads: int, repeat: int, workdir: str) -> float:
    """Milliseconds per unit of `kind` in this process (its thread count set here)."""
    import torch

    torch.set_num_threads(threads)
    from dflash_ray.model.target import build_synthetic_target

    target_dir = os.path.join(workdir, "target")
    if not os.path.exists(os.path.join(target_dir, "config.json")):
        build_synthetic_target(TARGET, VOCAB, target_dir, seed=0)
    g = torch.Generator().manual_seed(0)
    unit = UNITS[kind](target_dir, g)
    unit()
    t0 = time.perf_counter()
    for _ in range(repeat):
        unit()
    return (time.perf_counter() - t0) / repeat * 1000


def _driver(target_dir, g):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (16, 256), generator=g)

    def unit():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return unit


def _regenerate(target_dir, g):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.randint(1, VOCAB, (32, 40), generator=g)

    def unit():
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                           do_sample=False, pad_token_id=0)
    return unit


def _drafter(target_dir):
    from dflash_ray.model.drafter import DrafterConfig, build_drafter
    from dflash_ray.model.target import load_target

    target = load_target(target_dir)
    cfg = DrafterConfig(num_draft_layers=2, block_size=8, num_anchors=64, mask_token_id=VOCAB - 1)
    drafter = build_drafter(cfg, target.config, target.model.embed_tokens.weight, target.lm_head.weight, seed=0)
    return target, drafter


def _target(target_dir, g):
    import torch

    from dflash_ray.model.target import load_feature_extractor

    _, drafter = _drafter(target_dir)
    extractor = load_feature_extractor(target_dir, list(drafter.target_layer_ids))
    ids = torch.randint(0, VOCAB, (8, 128), generator=g)

    def unit():
        extractor(ids, torch.ones_like(ids))
    return unit


def _trainer(target_dir, g):
    import torch

    _, drafter = _drafter(target_dir)
    drafter.train()
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-3)
    rows, width = 8, 128
    features = drafter.config.hidden_size * len(drafter.target_layer_ids)
    ids = torch.randint(0, VOCAB - 1, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[:, :32] = False
    context = torch.randn(rows, width, features, generator=g)
    lengths = torch.full((rows,), width)

    def unit():
        out = drafter.training_loss(ids, mask, context, lengths, torch.Generator().manual_seed(1))
        (out.loss_sum / out.weight_sum.clamp_min(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return unit


def _evaluate(target_dir, g):
    import torch

    from dflash_ray.model.evaluate import greedy_generate, speculative_generate

    target, drafter = _drafter(target_dir)
    target.eval()
    drafter.eval()
    ids = torch.randint(1, VOCAB - 1, (1, 40), generator=g)

    def unit():
        speculative_generate(drafter, target, ids, 64)
        greedy_generate(target, ids, 64)
    return unit


UNITS = {"driver": _driver, "regenerate": _regenerate, "target": _target, "trainer": _trainer,
         "evaluate": _evaluate}


def cell(kind: str, threads: str, policy: str, repeat: int, workdir: str) -> float:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, __file__, "--one", kind, threads, "--repeat", str(repeat),
                          "--workdir", workdir], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{kind} at {threads} threads ({policy}) failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--one", nargs=2, metavar=("KIND", "THREADS"), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    if a.one:
        print(one(a.one[0], int(a.one[1]), a.repeat, a.workdir))
        return
    figures = {}
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as workdir:
        for load in ("quiet", "busy"):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                for kind in KINDS:
                    for threads, policy in SETTINGS:
                        figures[(kind, load, threads, policy)] = cell(kind, threads, policy, a.repeat, workdir)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    heads = [f"{t}t {p.lower()}" for t, p in SETTINGS]
    print(f"\nms per unit, {os.cpu_count()} CPUs; quiet | beside one busy process\n")
    print(f"{'kind':<11} " + " ".join(f"{h:>16}" for h in heads) + "   best when busy")
    for kind in KINDS:
        row = []
        for threads, policy in SETTINGS:
            q, b = figures[(kind, "quiet", threads, policy)], figures[(kind, "busy", threads, policy)]
            row.append(f"{q:7.0f} | {b:6.0f}")
        best = min(SETTINGS, key=lambda s: (max(figures[(kind, "busy", *s)], figures[(kind, "quiet", *s)]),
                                            figures[(kind, "quiet", *s)]))
        print(f"{kind:<11} " + " ".join(f"{r:>16}" for r in row) + f"   {best[0]}t {best[1].lower()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"kind": k, "load": l, "threads": int(t), "wait": p, "ms": round(v, 2)}
                       for (k, l, t, p), v in figures.items()], f, indent=1)


if __name__ == "__main__":
    main()
