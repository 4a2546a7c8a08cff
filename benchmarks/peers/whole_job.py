"""Side by side, the whole job as a user meets it, and the drafters' held-out tau at equal work: this project's
`dflash-ray train` from the conversations against SpecForge's offline path (a feature dump, then its own CLI,
`specforge train`, then `specforge export`), on SmolLM2-135M-Instruct's regenerated conversations.

    ./benchmarks/peers/setup.sh                                     # the peers' venv (.peers-venv/), once
    .venv/bin/python benchmarks/peers/whole_job.py                  # 3 alternated runs a side, 1 epoch (~2 h on 2 cores)
    .venv/bin/python benchmarks/peers/whole_job.py --repeats 1 --epochs 4   # one long run a side

Steps (the world is made once; every run is timed from nothing):
  world      the smollm2_135m + smol_prompts world: 1,200 generated instructions answered by the target itself
             (greedy, on a local Ray), 64 held-out prompts (other task kinds and topics), prepared shards. Every
             side trains on these conversations; regeneration is the same for all and timed against none.
  runs       --repeats rounds, each side once a round in turn (a noisy neighbour hits every side), round r with
             seed r on every side:
             ours       `dflash-ray train` on the regenerated conversations: prepare, plan, target actors, two
                        drafter workers, checkpoint, export (no held-out tau inside the job).
             specforge  its feature dump (this project's adapter, stopping after the last tap, no LM head: one
                        `.ckpt` a sample in SpecForge's offline format), `specforge train --config` (its CLI,
                        SPECFORGE_DEVICE=cpu, a world of one, NO_SHARD, SDPA, objective_chunk_blocks as asked),
                        `specforge export --to hf`.
             modelopt   its own feature dump (the same adapter, timed in its run), training through its Python
                        API with length-grouped batches (the HF Trainer's group_by_length), its exporter.
  tau        one evaluator for every drafter: the reference package's `DFlashDraftModel.from_pretrained` and
             `dflash_generate` (greedy), per prompt then over prompts as its benchmark prints it, on the
             world's held-out prompts; every output is checked against the target's plain greedy decoding.
Trained block tokens are counted from each side's output: ours from its summary, the peers' from the keep mask
of their own anchor sampler (harness.BlockCounter). The JSON records the commit and the exact command.

The same for both: the conversations and their token ids and loss masks (SpecForge's dump reads the world's
prepared shards: its path starts at the tokens), the target and taps (layers [1, 27]; their layer id k is
transformers' hidden_states[k + 1], as here), the drafter (2 layers, width 576, 9/3 heads, head_dim 64, MLP
1536, full attention), block 8, mask token 16, at most --anchors-per-row anchors a row (positions whose token
and next token are supervised), hard labels with decay gamma 4, AdamW at the preset's lr, weight decay 0, clip 1.0,
warmup 4% + cosine, --epochs passes, fp32 everywhere (the target's forwards too), the machine's two cores.
What differs and stays: rows per optimizer step (ours: batches of at most 1,024 context tokens and 1,024 block
tokens on each of two workers, a step's two batches from one length bucket so the workers wait for neither;
the peers: --rows-per-step rows a step, padded to the longest, in one process: by default the rows our plan
averages a step), the order of the rows, each side's anchor draws and initialisation.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
PEERS_BIN = REPO / ".peers-venv" / "bin"
OURS_BIN = REPO / ".venv" / "bin"
PRESET = ["model=smollm2_135m", "data=smol_prompts"]
HELDOUT = 64   # held-out prompts in the world: the evaluator's tau is over these
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_loop import preset_shape  # noqa: E402  (the preset's work, as the step loop takes it)


def world(root: Path) -> dict:
    """The conversations both sides train on, the held-out prompts, the prepared shards (made once)."""
    from omegaconf import OmegaConf

    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import make_demo_inputs
    from dflash_ray.paths import resolve_model_paths
    from dflash_ray.runtime.cluster import ray_cluster
    from dflash_ray.run_layout import RunLayout

    cfg = compose_config([*PRESET, f"run.root={root}", "run.name=world", f"data.synthetic.heldout_prompts={HELDOUT}"])
    resolve_model_paths(cfg)
    layout = RunLayout(Path(cfg.run.dir))
    if not (layout.heldout.exists() and Path(cfg.data.shards).exists()):
        t0 = time.monotonic()
        with ray_cluster(OmegaConf.to_object(cfg.cluster)):
            make_demo_inputs(cfg)
        print(f"world: made in {time.monotonic() - t0:.0f} s -> {layout.root}", flush=True)
    return {"regenerated": str(layout.regenerated), "heldout": str(layout.heldout), "shards": str(cfg.data.shards),
            "target": str(cfg.model.target_path)}


def timed(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run a command with its output in `log`; its wall seconds. A failure stops the benchmark, naming the log."""
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}).returncode
    if rc != 0:
        raise SystemExit(f"{cmd[0]} {cmd[1]} failed (exit {rc}): see {log}")
    return time.monotonic() - t0


def run_ours(root: Path, w: dict, args, name: str = "ours", extra: tuple = (), seed: int = 0) -> dict:
    """`dflash-ray train` on the regenerated conversations: prepare, plan, train, checkpoint, export."""
    run, cache = root / name, root / f"{name}-features"
    for d in (run, cache):   # a rerun of the same run.name would resume, and a warm cache would skip the target
        shutil.rmtree(d, ignore_errors=True)
    cmd = [str(OURS_BIN / "dflash-ray"), "train", *PRESET, f"data.input={w['regenerated']}", f"run.root={root}",
           f"run.name={name}", "model.compute_dtype=float32", "model.anchors_per_batch=null",
           f"model.num_anchors={args.anchors_per_row}", f"model.max_block_tokens_per_batch={args.block_tokens_per_batch}",
           f"train.epochs={args.epochs}", "train.heldout_every=0",
           f"train.feature_cache_dir={cache}", f"seed={seed}", *extra]
    seconds = timed(cmd, root / f"{name}.log", {"RAY_AUTH_MODE": "disabled"})
    s = json.loads((run / "summary.json").read_text())
    return {"trainer": "dflash-ray", "seed": seed, "seconds": seconds, "steps": s["steps"], "context_tokens": s["tokens"],
            "block_tokens": s["block_tokens"], "final_loss": s["final_loss"], "drafter": s["export"],
            "phases": {p["phase"]: p["seconds"] for p in s.get("phases", []) if "phase" in p},
            "features": s.get("features"), "feature_cache": s.get("feature_cache"),
            "offline_features": s.get("offline_features"),
            "target_tokens": sum(t["tokens"] for t in (s.get("target_actors") or {}).values()),
            "command": " ".join(cmd)}


def dump_features(w: dict, out: Path, taps: list[int], max_batch_tokens: int = 8192) -> dict:
    """SpecForge's offline input, written by this project's adapter: one `torch.save` file a sample holding
    input_ids [S], loss_mask [S] and hidden_states [S, len(taps) * H] (transformers' hidden_states[k + 1] for
    their layer id k), from the world's shards; rows of like length batched, right-padded (causal: padding
    does not change the states before it), the target in fp32. The target's forward stops after the last
    tapped layer and one more (the last layer's state would be the final norm's) and skips the LM head, as a
    dump that needs only the taps can: what this project's target actors compute too."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    rows = []
    for shard in sorted(Path(w["shards"]).glob("*.parquet")):
        t = pq.read_table(shard, columns=["input_ids", "loss_mask"]).to_pydict()
        rows += list(zip(t["input_ids"], t["loss_mask"]))
    target = AutoModelForCausalLM.from_pretrained(w["target"], torch_dtype=torch.float32).eval()
    base = target.model
    base.layers = base.layers[:min(len(base.layers), max(taps) + 2)]
    out.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    tokens, i = 0, 0
    with torch.no_grad():
        while i < len(order):
            j = i + 1
            while j < len(order) and (j + 1 - i) * len(rows[order[j]][0]) <= max_batch_tokens:
                j += 1
            batch = order[i:j]
            longest = len(rows[batch[-1]][0])
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            att = torch.zeros(len(batch), longest, dtype=torch.long)
            for r, k in enumerate(batch):
                n = len(rows[k][0])
                ids[r, :n] = torch.tensor(rows[k][0])
                att[r, :n] = 1
            hs = base(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
            feats = torch.cat([hs[k + 1] for k in taps], dim=-1)
            for r, k in enumerate(batch):
                n = len(rows[k][0])
                torch.save({"input_ids": ids[r, :n].clone(), "loss_mask": torch.tensor(rows[k][1], dtype=torch.long),
                            "hidden_states": feats[r, :n].clone()}, out / f"{k:06d}.ckpt")
                tokens += n
            i = j
    # per sample, the positions whose token and next token are supervised: the anchors SpecForge may draw
    pairs = [sum(a and b for a, b in zip(m, m[1:])) for _, m in rows]
    return {"samples": len(rows), "tokens": tokens, "supervised_pairs": pairs}


def specforge_config(sf: Path, w: dict, shape: dict, args, rows_per_step: int, seed: int) -> Path:
    """The drafter's config (their DFlashDraftModel: the reference's layout) and the training YAML."""
    layers = shape["draft_layers"]
    draft = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": shape["hidden"],
             "intermediate_size": shape["intermediate"], "num_hidden_layers": layers,
             "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
             "head_dim": shape["head_dim"], "vocab_size": shape["vocab"], "rms_norm_eps": shape["rms_norm_eps"],
             "rope_theta": shape["rope_theta"],
             "rope_parameters": {"rope_theta": shape["rope_theta"], "rope_type": "default"}, "max_position_embeddings": shape["max_positions"],
             "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
             "layer_types": ["full_attention"] * layers, "use_sliding_window": False, "sliding_window": None,
             "block_size": shape["block"], "num_target_layers": shape["target_layers"],
             "dflash_config": {"target_layer_ids": shape["taps"], "mask_token_id": shape["mask_token_id"]},
             "torch_dtype": "float32"}
    (sf / "draft_config.json").write_text(json.dumps(draft, indent=1))
    import yaml
    cfg = {"model": {"target_model_path": w["target"], "draft_model_config": str(sf / "draft_config.json"),
                     "torch_dtype": "float32", "mask_token_id": shape["mask_token_id"]},
           "data": {"hidden_states_path": str(sf / "features"), "max_length": 2048,
                    "dataloader_num_workers": args.specforge_loader_workers},
           "training": {"strategy": "dflash", "num_epochs": args.epochs, "batch_size": rows_per_step,
                        "learning_rate": shape["lr"], "lr_scheduler": "cosine", "warmup_ratio": shape["warmup_ratio"],
                        "max_grad_norm": shape["grad_clip"], "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                        "num_anchors": args.anchors_per_row, "loss_decay_gamma": shape["loss_gamma"],
                        "objective_chunk_blocks": args.specforge_chunk_blocks, "log_interval": 10, "seed": seed},
           "output_dir": str(sf / "out"), "run_id": "specforge"}
    path = sf / "train.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_specforge(root: Path, w: dict, shape: dict, args, rows_per_step: int, name: str = "specforge",
                  seed: int = 0) -> dict:
    """Their path as its users take it: the feature dump (timed here, in this run), `specforge train` (their CLI,
    through benchmarks/peers/specforge_train.py, which counts the blocks their sampler keeps), `specforge export`."""
    sf = root / name
    shutil.rmtree(sf, ignore_errors=True)
    sf.mkdir(parents=True)
    t0 = time.monotonic()
    dumped = dump_features(w, sf / "features", shape["taps"])
    dump_s = time.monotonic() - t0
    print(f"{name}: dumped {dumped['samples']} samples, {dumped['tokens']:,} tokens in {dump_s:.0f} s", flush=True)
    config = specforge_config(sf, w, shape, args, rows_per_step, seed)
    env = {"SPECFORGE_DEVICE": "cpu"}
    log = root / f"{name}.log"
    train_s = timed([str(PEERS_BIN / "python"), str(Path(__file__).with_name("specforge_train.py")), "--config",
                     str(config)], log, env)
    counted = json.loads([line for line in log.read_text().splitlines() if line.startswith('{"blocks"')][-1])
    export = sf / "export"
    export_s = timed([str(PEERS_BIN / "specforge"), "export", "--to", "hf", "--checkpoint", str(sf / "out" / "specforge-latest"),
                      "--draft-config", str(sf / "draft_config.json"), "--output-dir", str(export)],
                     root / f"{name}_export.log", env)
    return {"trainer": "SpecForge 0.2.0", "seed": seed, "seconds": dump_s + train_s + export_s, "dump_seconds": dump_s,
            "train_seconds": train_s, "export_seconds": export_s, "context_tokens": dumped["tokens"] * args.epochs,
            "block_tokens": counted["blocks"] * shape["block"], "forwards": counted["forwards"], "drafter": str(export),
            "objective_chunk_blocks": args.specforge_chunk_blocks,
            "feature_bytes": sum(f.stat().st_size for f in (sf / "features").glob("*.ckpt")),
            "command": f"SPECFORGE_DEVICE=cpu specforge train --config {config}"}


def run_modelopt(root: Path, w: dict, shape: dict, args, rows_per_step: int, name: str = "modelopt",
                 seed: int = 0) -> dict:
    """Model Optimizer's DFlash drafter from a feature dump of its own (timed here: their offline input is the
    same tensors, `base_model_outputs["aux_hidden_states"]`, so the same adapter writes it), trained and
    exported by modelopt_train.py in the peers' venv (length-grouped batches, as the HF Trainer's
    group_by_length gives its users; blocks counted from their sampler)."""
    mo = root / name
    shutil.rmtree(mo, ignore_errors=True)
    mo.mkdir(parents=True)
    t0 = time.monotonic()
    dump_features(w, mo / "features", shape["taps"])
    dump_s = time.monotonic() - t0
    work = mo / "work.json"
    work.write_text(json.dumps({"shape": {**shape, "seed": seed}, "features": str(mo / "features"), "epochs": args.epochs,
                                "rows_per_step": rows_per_step, "export": str(mo / "export")}))
    log = root / f"{name}.log"
    train_s = timed([str(PEERS_BIN / "python"), str(Path(__file__).with_name("modelopt_train.py")), "--work", str(work)], log)
    r = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
    return {"trainer": "Model Optimizer 0.47.0", "seed": seed, "seconds": dump_s + train_s, "dump_seconds": dump_s,
            "train_seconds": train_s, "steps": r["steps"], "context_tokens": r["context_tokens"],
            "block_tokens": r["block_tokens"], "final_loss": r["final_loss"], "drafter": str(mo / "export"),
            "command": f".peers-venv/bin/python benchmarks/peers/modelopt_train.py --work {work}"}


def heldout_tau(drafters: dict, w: dict, max_prompts: int, max_new_tokens: int) -> dict:
    """The reference `dflash_generate` for every drafter on the same prompts; block_size=1 is its benchmark's
    baseline (plain greedy decoding), against which every output is checked."""
    import dflash.model as reference
    import torch

    from dflash_ray.data.prompts import find_tokenizer, read_prompts
    from dflash_ray.model.generation import declared_end_token_ids
    from dflash_ray.model.target import load_target

    reference._cuda_time = time.perf_counter   # it times with CUDA syncs otherwise
    tok = find_tokenizer(w["target"], w["target"])
    prompts = read_prompts(w["heldout"], tok, limit=max_prompts)
    stop = declared_end_token_ids(tok, w["target"])
    target = load_target(w["target"])
    out = {}
    with torch.no_grad():
        first = reference.DFlashDraftModel.from_pretrained(next(iter(drafters.values())), dtype=torch.float32).eval()
        greedy = [reference.dflash_generate(first, target, torch.tensor([p]), max_new_tokens, stop, block_size=1)
                  for p in prompts]
        for name, d in drafters.items():
            model = reference.DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
            per_prompt, match = [], 0
            for p, g in zip(prompts, greedy):
                r = reference.dflash_generate(model, target, torch.tensor([p]), max_new_tokens, stop, return_stats=True)
                per_prompt.append(statistics.mean(r.acceptance_lengths))
                match += int(torch.equal(r.output_ids, g))
            out[name] = {"tau": statistics.mean(per_prompt), "per_prompt": per_prompt, "prompts": len(prompts),
                         "outputs_match_greedy": match}
            print(f"tau {name}: {out[name]['tau']:.3f} ({match}/{len(prompts)} outputs equal to greedy)", flush=True)
    return out


def spread(values: list[float], fmt: str = ",.0f") -> str:
    """median (min..max) of a side's runs."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}..{max(values):{fmt}})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/dflash-ray-peers/whole_job")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs a side, alternating (ours, SpecForge, Model "
                    "Optimizer, ours, ...); run r trains with seed r on every side")
    ap.add_argument("--anchors-per-row", type=int, default=16)
    ap.add_argument("--block-tokens-per-batch", type=int, default=1024,
                    help="ours: the plan's drafter budget a batch (model.max_block_tokens_per_batch): short rows make "
                         "batches of fewer rows, so both workers of a step train about equal block tokens (the "
                         "trained tokens are the same: every row keeps its anchors)")
    ap.add_argument("--rows-per-step", type=int, default=0, help="the peers' rows a step (0: our plan's rows a step)")
    ap.add_argument("--specforge-chunk-blocks", type=int, default=0,
                    help="SpecForge's training.objective_chunk_blocks (0: the LM head's logits kept, not recomputed in "
                         "backward: its faster setting in the step loop, and it fits memory here; its default is 128)")
    ap.add_argument("--specforge-loader-workers", type=int, default=1)
    ap.add_argument("--max-prompts", type=int, default=HELDOUT)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the runs and the table as JSON")
    args = ap.parse_args(argv)
    if not (PEERS_BIN / "specforge").exists():
        print(f"no peers' venv at {PEERS_BIN.parent}: run ./benchmarks/peers/setup.sh first", file=sys.stderr)
        return 2
    from step_loop import provenance

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    w = world(root)
    shape = preset_shape(anchors_per_row=args.anchors_per_row, rows=0, seed=0)
    import pyarrow.parquet as pq
    samples = sum(pq.ParquetFile(f).metadata.num_rows for f in Path(w["shards"]).glob("*.parquet"))
    runs: dict[str, list[dict]] = {"dflash-ray": [], "SpecForge 0.2.0": [], "Model Optimizer 0.47.0": []}
    rows_per_step = args.rows_per_step
    for r in range(args.repeats):
        ours = run_ours(root, w, args, name=f"ours-{r}", seed=r)
        runs["dflash-ray"].append(ours)
        rows_per_step = rows_per_step or max(1, round(samples * args.epochs / ours["steps"]))
        print(f"run {r + 1} dflash-ray: {ours['seconds']:.0f} s, {ours['steps']} steps "
              f"({rows_per_step} rows a step on average, the peers' batch)", flush=True)
        theirs = run_specforge(root, w, shape, args, rows_per_step, name=f"specforge-{r}", seed=r)
        runs["SpecForge 0.2.0"].append(theirs)
        print(f"run {r + 1} SpecForge: {theirs['seconds']:.0f} s (dump {theirs['dump_seconds']:.0f} s)", flush=True)
        nvidia = run_modelopt(root, w, shape, args, rows_per_step, name=f"modelopt-{r}", seed=r)
        runs["Model Optimizer 0.47.0"].append(nvidia)
        print(f"run {r + 1} Model Optimizer: {nvidia['seconds']:.0f} s (dump {nvidia['dump_seconds']:.0f} s)", flush=True)
    drafters = {f"{side} #{i}": run["drafter"] for side, rs in runs.items() for i, run in enumerate(rs)}
    taus = heldout_tau(drafters, w, args.max_prompts, args.max_new_tokens)
    for side, rs in runs.items():
        for i, run in enumerate(rs):
            run["tau"] = taus[f"{side} #{i}"]
    print(f"\n{args.repeats} runs a side, alternating, {args.epochs} epoch(s) each, seeds 0..{args.repeats - 1}; "
          f"held-out tau by one evaluator (the reference dflash_generate) on {taus[next(iter(taus))]['prompts']} prompts; "
          "trained block tokens counted from each side's own output")
    print("\n| trainer | wall s (median, min..max) | trained block tokens | block tokens/s | context tokens "
          "| held-out tau (median, min..max) | outputs equal to greedy |\n|---|---|---|---|---|---|---|")
    for side, rs in runs.items():
        rates = [x["block_tokens"] / x["seconds"] for x in rs]
        print(f"| {side} | {spread([x['seconds'] for x in rs])} | {spread([x['block_tokens'] for x in rs])} "
              f"| {spread(rates)} | {spread([x['context_tokens'] for x in rs])} "
              f"| {spread([x['tau']['tau'] for x in rs], '.3f')} "
              f"| {sum(x['tau']['outputs_match_greedy'] for x in rs)}/{sum(x['tau']['prompts'] for x in rs)} |")
    ours_rates = [x["block_tokens"] / x["seconds"] for x in runs["dflash-ray"]]
    for side in list(runs)[1:]:
        rates = [x["block_tokens"] / x["seconds"] for x in runs[side]]
        print(f"dflash-ray / {side}, block tokens/s: {statistics.median(ours_rates) / statistics.median(rates):.2f}x "
              f"(every pairing of runs: {min(ours_rates) / max(rates):.2f}..{max(ours_rates) / min(rates):.2f}); "
              f"its feature dump {spread([x['dump_seconds'] for x in runs[side]])} s of its wall")
    print("dflash-ray's phases (run 1): " + ", ".join(f"{k} {v:.0f} s" for k, v in runs["dflash-ray"][0]["phases"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "args": vars(args),
                                               "rows_per_step": rows_per_step, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
