"""What moves held-out tau on the real model: one knob at a time, each variant trained in
one process from features computed once, its held-out acceptance measured as it trains, against context
tokens and against wall time.

    .venv/bin/python benchmarks/tau_knobs.py --world /tmp/dflash-ray-peers/whole_job/world --epochs 4 \
        --variants base,distill,lr=1e-3,layers=1

The work: SmolLM2-135M-Instruct's regenerated conversations (the world benchmarks/peers/whole_job.py makes:
its prepared shards), batched by the run's own plan (data/plan.py, the preset's buckets and 1,024-token
budget, a new order each epoch), trained by the run's own step (runtime/training/step.py train_step, one
worker: a step is --batches-per-step plan batches, as two workers make it), the preset's drafter, loss,
optimizer and schedule unless the variant says otherwise. The target's features (and top-k, for distill)
are computed once per world and dtype and kept in --cache.

Held-out acceptance (a proxy of `dflash-ray eval`'s tau, cheap enough to measure often): the world's
held-out prompts (other task kinds and topics) answered by the target greedily (--heldout-tokens new tokens,
as the evaluation generates), then every position of the answers as an anchor, teacher-forced: 1 + the mean
of leading slots equal to the target's greedy tokens. Under greedy verification the context is exactly
these tokens, so each anchor's accepted length is what speculative decoding would accept there; the real
evaluation visits only the anchors its accepted runs land on. Checked against the reference's
`dflash_generate` on the best variant at the end (--check-tau).

Variants (comma-separated; KEY=VALUE changes one knob of the base, the preset's):
  base            the preset: 2 layers, its lr, 128 anchors a 1,024-token batch, CE, 2 batches a step
  distill         train.loss=distill (top-8, pure); distill=0.5 mixes the hard label at weight 0.5
  lr=X            peak learning rate
  layers=N        drafter layers (the taps follow the tap rule)
  anchors=all     every valid anchor a row (the recipe's density), the batch cut at --max-block-tokens
  anchors=N       N anchors a 1,024-token batch
  step=N          plan batches per optimizer step
  warmup=X        warm-up share of the steps
  epochs=N        passes over the data (default --epochs)
  init=last       the drafter's layers start as the target's last N (attention, MLP, their norms) and its
                  final norm as the target's; the q/k norms (the target has none if it is a Llama) and the
                  projection of the taps stay fresh
  init=middle     the same from the N layers at the target's middle
  initlr=X        with init: the copied tensors learn at X times the peak learning rate (fresh ones at 1x)
  A+B             both knobs (e.g. anchors=all+epochs=1: the recipe's density at about the base's time)
`--top-k-mass N` prints instead how much of the target's next-token distribution its top k keep (distill's
choice of k). Prints one table (final proxy tau, tau at the shortest variant's training time, steps, context and block
tokens, seconds, final loss) and writes the curves as JSON (--json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def preset():
    from dflash_ray.config import compose_config
    from dflash_ray.paths import resolve_model_dir

    cfg = compose_config(["model=smollm2_135m", "data=smol_prompts"])
    return cfg, str(resolve_model_dir(cfg.model.target_path, "model.target_path", log=lambda *a: None))


def read_world(world: Path):
    import pyarrow.parquet as pq

    rows = {}
    for shard in sorted((world / "shards").glob("*.parquet")):
        for r in pq.read_table(shard, columns=["sample_id", "input_ids", "loss_mask"]).to_pylist():
            rows[int(r["sample_id"])] = (np.asarray(r["input_ids"], np.int64), np.asarray(r["loss_mask"], np.int8))
    prompts = [json.loads(line) for line in (world / "heldout.jsonl").read_text().splitlines() if line.strip()]
    return rows, prompts


def target_pass(target_dir, taps, rows: dict, dtype: str, top_k: int, cache: Path):
    """Each sample's features [n, taps*H] (in `dtype`) and the target's next-token top-k, computed once."""
    import torch

    from dflash_ray.model.target import load_feature_extractor

    path = cache / f"features-{dtype}-top{top_k}-{len(rows)}.pt"
    if path.exists():
        return torch.load(path)
    extract = load_feature_extractor(target_dir, taps, dtype=getattr(torch, dtype), top_k=top_k)
    out, order = {}, sorted(rows, key=lambda s: len(rows[s][0]))
    t0 = time.monotonic()
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j + 1 - i) * len(rows[order[j]][0]) <= 4096:
            j += 1
        batch = order[i:j]
        width = len(rows[batch[-1]][0])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attn = torch.zeros(len(batch), width, dtype=torch.long)
        for r, s in enumerate(batch):
            n = len(rows[s][0])
            ids[r, :n] = torch.from_numpy(rows[s][0])
            attn[r, :n] = 1
        feats, top_ids, top_p = extract.features_and_top_k(ids, attn)
        for r, s in enumerate(batch):
            n = len(rows[s][0])
            out[s] = (feats[r, :n].clone(), top_ids[r, :n].clone(), top_p[r, :n].clone())
        i = j
    print(f"target pass: {sum(len(r[0]) for r in rows.values()):,} tokens in {time.monotonic() - t0:.0f} s", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def heldout_answers(target_dir, prompts, new_tokens: int, eos: int, cache: Path):
    """The held-out prompts with the target's greedy answers (one sequence at a time: no padding), and the
    loss mask of the answers."""
    import torch

    from dflash_ray.model.target import load_target

    path = cache / f"heldout-{len(prompts)}-{new_tokens}.pt"
    if path.exists():
        return torch.load(path)
    target = load_target(target_dir)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            mask = torch.zeros(ids.shape[1], dtype=torch.int8)
            mask[len(p):] = 1
            out.append((ids[0], mask))
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def parse_variant(name: str, base: dict) -> dict:
    v = dict(base, name=name)
    for part in name.split("+"):
        set_knob(v, part)
    return v


def set_knob(v: dict, part: str) -> None:
    key, _, value = part.partition("=")
    if key == "base":
        pass
    elif key == "epochs":
        v["epochs"] = int(value)
    elif key == "distill":
        v.update(loss="distill", hard_weight=float(value or 0.0))
    elif key == "lr":
        v["lr"] = float(value)
    elif key == "layers":
        v["layers"] = int(value)
    elif key == "anchors":
        v["anchors_per_batch"] = None if value == "all" else int(value)
        if value == "all":
            v["num_anchors"] = 512
    elif key == "step":
        v["batches_per_step"] = int(value)
    elif key == "warmup":
        v["warmup"] = float(value)
    elif key == "init" and value in ("last", "middle"):
        v["init"] = value
    elif key == "initlr":
        v["init_lr_scale"] = float(value)
    else:
        raise SystemExit(f"unknown knob {part!r} (see --help)")


def copy_target_layers(drafter, target_dir, where: str) -> tuple[list[int], list]:
    """The drafter's N layers <- N consecutive target layers, the last N or the N at the middle (every tensor of
    the same name and shape: q/k/v/o, the MLP, the two layer norms), its final norm <- the target's. Returns the
    target layers copied and the drafter's tensors that were."""
    import torch

    from dflash_ray.model.target import load_target

    target = load_target(target_dir).model
    n, total = len(drafter.layers), len(target.layers)
    first = total - n if where == "last" else (total - n) // 2
    copied = []
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, target.layers[first:first + n]):
            src = theirs.state_dict()
            for name, p in mine.named_parameters():
                if name in src and src[name].shape == p.shape:
                    p.copy_(src[name])
                    copied.append(p)
                elif not name.endswith(("q_norm.weight", "k_norm.weight")):
                    raise SystemExit(f"init={where}: the target's layer has no {name} of shape {tuple(p.shape)}")
        drafter.norm.weight.copy_(target.norm.weight)
        copied.append(drafter.norm.weight)
    return list(range(first, first + n)), copied


def train_variant(v: dict, cfg, target_dir, rows, feats_by_layers, heldout_ctx, args):
    import contextlib

    import torch
    from transformers import AutoConfig

    from dflash_ray.data.plan import PlanSpec, build_plan
    from dflash_ray.model.drafter import DrafterConfig, build_drafter
    from dflash_ray.model.target import load_embed_and_head
    from dflash_ray.runtime.stream.rows import TrainRow, encode_features, encode_soft_labels
    from dflash_ray.runtime.training.model import LossModule, lr_lambda
    from dflash_ray.runtime.training.step import train_step

    import dataclasses

    feats = feats_by_layers[v["layers"]]
    # every valid anchor (anchors_per_batch None): the plan cuts each batch at the block-token bound instead
    spec = dataclasses.replace(PlanSpec.from_config(cfg), num_anchors=v["num_anchors"],
                               anchors_per_batch=v["anchors_per_batch"],
                               max_block_tokens_per_batch=None if v["anchors_per_batch"] else args.max_block_tokens)
    embed, head = load_embed_and_head(target_dir)
    dcfg = DrafterConfig(num_draft_layers=v["layers"], block_size=cfg.model.block_size, num_anchors=v["num_anchors"],
                         mask_token_id=cfg.model.mask_token_id, anchors_per_batch=spec.batch_anchor_cap())
    drafter = build_drafter(dcfg, AutoConfig.from_pretrained(target_dir), embed, head, seed=0)
    copied = []
    if v["init"]:
        layers, copied = copy_target_layers(drafter, target_dir, v["init"])
        print(f"  {v['name']}: drafter layers from the target's {layers}")
    ids_all = np.array(sorted(rows))
    lens = np.array([len(rows[s][0]) for s in ids_all])
    sup = np.array([int(rows[s][1].sum()) for s in ids_all])
    plans = [build_plan(ids_all, lens, spec, num_supervised=sup, seed=0, epoch=e) for e in range(v["epochs"])]
    per_step = v["batches_per_step"]
    total_steps = sum(-(-p.num_batches // per_step) for p in plans)
    copied_ids = {id(p) for p in copied}
    fresh = [p for p in drafter.trainable_parameters() if id(p) not in copied_ids]
    groups = [{"params": fresh, "lr": v["lr"]}]
    if copied:   # LambdaLR scales each group's own lr: the copied ones keep their ratio through the schedule
        groups.append({"params": [p for p in drafter.trainable_parameters() if id(p) in copied_ids],
                       "lr": v["lr"] * v["init_lr_scale"]})
    opt = torch.optim.AdamW(groups, lr=v["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, v["warmup"]))
    model = LossModule(drafter, v["hard_weight"])
    bf16 = args.dtype == "bfloat16"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    distill = v["loss"] == "distill"

    def row_of(plan, k, epoch):
        samples = plan.batch(k)
        n = [len(rows[s][0]) for s in samples]
        width = max(n)
        ids = np.zeros((len(samples), width), np.int32)
        mask = np.zeros((len(samples), width), np.int8)
        ctx = torch.zeros(len(samples), width, feats[samples[0]][0].shape[-1], dtype=feats[samples[0]][0].dtype)
        tid = torch.zeros(len(samples), width, args.top_k, dtype=torch.int32)
        tp = torch.zeros(len(samples), width, args.top_k)
        for r, s in enumerate(samples):
            ids[r, :n[r]], mask[r, :n[r]] = rows[s][0], rows[s][1]
            ctx[r, :n[r]] = feats[s][0]
            tid[r, :n[r]], tp[r, :n[r]] = feats[s][1], feats[s][2]
        enc, dtype = encode_features(ctx)
        return TrainRow(index=k, gen=0, epoch=epoch, position=k, epoch_batches=plan.num_batches, bucket=int(plan.bucket[k]),
                        num_tokens=int(sum(n)), input_ids=ids, loss_mask=mask, lengths=np.array(n, np.int32),
                        context=enc, context_dtype=dtype, soft_labels=encode_soft_labels(tid, tp) if distill else None)

    def heldout_tau():
        prefix = blocks = 0.0
        keep = drafter.num_anchors, drafter.anchors_per_batch
        drafter.num_anchors, drafter.anchors_per_batch = 1 << 20, None
        with torch.no_grad(), autocast():
            for ids, mask, ctx in heldout_ctx[v["layers"]]:
                out = drafter.training_loss(ids[None], mask[None].long(), ctx[None], torch.tensor([ids.shape[0]]),
                                            torch.Generator().manual_seed(0))
                prefix += float(out.prefix_correct.sum())
                blocks += float(out.num_blocks)
        drafter.num_anchors, drafter.anchors_per_batch = keep
        return 1.0 + prefix / max(blocks, 1.0)

    curve = [{"step": 0, "tokens": 0, "block_tokens": 0, "seconds": 0.0, "tau": heldout_tau()}]
    step = tokens = block_tokens = 0
    train_s, loss = 0.0, float("nan")
    for epoch, plan in enumerate(plans):
        for lo in range(0, plan.num_batches, per_step):
            batch_rows = [row_of(plan, k, epoch) for k in range(lo, min(lo + per_step, plan.num_batches))]
            t0 = time.perf_counter()
            r = train_step(model, drafter, opt, sched, batch_rows, rank=0, workers=1, batches_per_step=len(batch_rows),
                           seed=0, grad_clip=1.0, device=torch.device("cpu"), autocast=autocast)
            train_s += time.perf_counter() - t0
            step += 1
            tokens += r.tokens
            block_tokens += r.block_tokens
            loss = r.loss
            if step % args.eval_every == 0 or step == total_steps:
                curve.append({"step": step, "tokens": tokens, "block_tokens": block_tokens, "seconds": round(train_s, 1),
                              "tau": heldout_tau(), "loss": loss})
                print(f"  {v['name']}: step {step}/{total_steps} {train_s:.0f} s loss {loss:.3f} "
                      f"tau {curve[-1]['tau']:.3f}", flush=True)
    return {"variant": v, "steps": step, "tokens": tokens, "block_tokens": block_tokens, "seconds": train_s,
            "final_loss": loss, "tau": curve[-1]["tau"], "curve": curve, "drafter": drafter}


def tau_at(curve, seconds):
    """The proxy tau of the last evaluation at or before `seconds` of training."""
    return [c["tau"] for c in curve if c["seconds"] <= seconds + 1e-6][-1]


def top_k_mass(target_dir, rows: dict, ks, samples: int) -> list[dict]:
    """How much of the target's next-token distribution its top k keep, at the supervised positions of the
    first `samples` samples (position t predicts token t+1: counted where t+1 is supervised); float32."""
    import torch

    from dflash_ray.model.target import load_target

    target = load_target(target_dir)
    masses = []
    with torch.no_grad():
        for s in sorted(rows)[:samples]:
            ids, mask = rows[s]
            p = torch.softmax(target(torch.from_numpy(ids)[None]).logits[0].float(), -1)
            top = p.topk(max(ks), dim=-1).values.cumsum(-1)[:-1][torch.from_numpy(mask[1:].astype(bool))]
            masses.append(top)
    m = torch.cat(masses)
    return [{"k": k, "mean": float(m[:, k - 1].mean()), "median": float(m[:, k - 1].median()),
             "p10": float(m[:, k - 1].quantile(0.1)), "positions": int(m.shape[0])} for k in ks]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="/tmp/dflash-ray-peers/whole_job/world")
    ap.add_argument("--variants", default="base,distill")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=40, help="steps between held-out measurements")
    ap.add_argument("--heldout-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches-per-step", type=int, default=2)
    ap.add_argument("--max-block-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the processor's choice)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default="/tmp/dflash-ray-tau-knobs")
    ap.add_argument("--check-tau", type=int, default=0, help="held-out prompts for the reference's tau of the best")
    ap.add_argument("--max-samples", type=int, default=0, help="train on the first N samples only (a smoke run)")
    ap.add_argument("--max-prompts", type=int, default=0, help="held-out prompts measured (0: all)")
    ap.add_argument("--top-k-mass", type=int, default=0,
                    help="only print the mass the target's top k keep, over the first N samples' supervised positions")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch

    from dflash_ray.config import compute_dtype
    from dflash_ray.model.target import default_target_layer_ids

    torch.set_num_threads(args.threads)
    cfg, target_dir = preset()
    args.dtype = args.dtype or compute_dtype(cfg)
    cache = Path(args.cache)
    rows, prompts = read_world(Path(args.world))
    if args.max_samples:
        rows = {s: rows[s] for s in sorted(rows)[:args.max_samples]}
    if args.max_prompts:
        prompts = prompts[:args.max_prompts]
    if args.top_k_mass:
        ks = [1, 2, 4, 8, 16, 32, 64]
        table = top_k_mass(target_dir, rows, ks, args.top_k_mass)
        print(f"the target's next-token mass in its top k ({table[0]['positions']:,} supervised positions of "
              f"{args.top_k_mass} samples, float32)\n\n| k | mean | median | 10th percentile |\n|---|---|---|---|")
        for r in table:
            print(f"| {r['k']} | {r['mean']:.3f} | {r['median']:.3f} | {r['p10']:.3f} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "top_k_mass": table}, indent=1))
        return 0
    base = dict(loss="ce", hard_weight=0.0, lr=float(cfg.train.lr), layers=int(cfg.model.num_draft_layers),
                num_anchors=int(cfg.model.num_anchors), anchors_per_batch=cfg.model.anchors_per_batch,
                batches_per_step=args.batches_per_step, warmup=float(cfg.train.warmup_ratio), epochs=args.epochs,
                init=None, init_lr_scale=1.0)
    variants = [parse_variant(n.strip(), base) for n in args.variants.split(",")]
    from transformers import AutoConfig, AutoTokenizer

    tcfg = AutoConfig.from_pretrained(target_dir)
    eos = AutoTokenizer.from_pretrained(target_dir).eos_token_id
    answers = heldout_answers(target_dir, prompts, args.heldout_tokens, eos, cache)
    feats_by_layers, heldout_ctx = {}, {}
    for layers in sorted({v["layers"] for v in variants}):
        taps = default_target_layer_ids(tcfg.num_hidden_layers, layers)
        feats_by_layers[layers] = target_pass(target_dir, taps, rows, args.dtype, args.top_k, cache / f"taps{'-'.join(map(str, taps))}")
        held = {i: (a[0].numpy(), a[1].numpy()) for i, a in enumerate(answers)}
        hf = target_pass(target_dir, taps, held, args.dtype, args.top_k, cache / f"heldout-taps{'-'.join(map(str, taps))}")
        heldout_ctx[layers] = [(answers[i][0], answers[i][1], hf[i][0]) for i in range(len(answers))]
    results = []
    for v in variants:
        t0 = time.monotonic()
        results.append(train_variant(v, cfg, target_dir, rows, feats_by_layers, heldout_ctx, args))
        print(f"{v['name']}: {time.monotonic() - t0:.0f} s", flush=True)
    shortest = min(r["seconds"] for r in results)
    print(f"\nheld-out acceptance (proxy tau, {len(answers)} held-out prompts x {args.heldout_tokens} greedy tokens, every "
          f"answer position an anchor), {args.epochs} epochs (unless the variant says) of {sum(len(r[0]) for r in rows.values()):,} tokens, "
          f"{args.dtype}, {args.threads} threads\n")
    print(f"| variant | epochs | steps | context tokens | block tokens (per token) | training s | tau (proxy) | tau at {shortest:.0f} s "
          f"| final loss |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']['name']} | {r['variant']['epochs']} | {r['steps']} | {r['tokens']:,} | {r['block_tokens']:,} "
              f"({r['block_tokens'] / max(r['tokens'], 1):.2f}) | {r['seconds']:.0f} | {r['tau']:.3f} "
              f"| {tau_at(r['curve'], shortest):.3f} | {r['final_loss']:.3f} |")
    if args.check_tau:
        best = max(results, key=lambda r: r["tau"])
        check_reference_tau(best, target_dir, prompts[:args.check_tau], args, cache)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": [
            {k: v for k, v in r.items() if k != "drafter"} for r in results]}, indent=1))
    return 0


def check_reference_tau(result, target_dir, prompts, args, cache: Path):
    """The reference `dflash_generate`'s tau of the variant's drafter (exported), beside its proxy."""
    import time as _time

    import dflash.model as reference
    import torch

    from dflash_ray.model.export import export_drafter
    from dflash_ray.model.target import load_target

    out = cache / f"export-{result['variant']['name']}"
    export_drafter(result["drafter"], str(out))
    reference._cuda_time = _time.perf_counter   # it times with CUDA syncs otherwise
    model = reference.DFlashDraftModel.from_pretrained(str(out)).eval()
    target = load_target(target_dir)
    stop = [target.config.eos_token_id] if isinstance(target.config.eos_token_id, int) else target.config.eos_token_id
    taus = []
    for p in prompts:
        stats = reference.dflash_generate(model, target, torch.tensor([p]), args.heldout_tokens, stop, return_stats=True)
        taus.append(float(np.mean(stats.acceptance_lengths)))
    print(f"\nreference dflash_generate on {len(prompts)} held-out prompts, {result['variant']['name']}: tau "
          f"{np.mean(taus):.3f} (its proxy: {result['tau']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
