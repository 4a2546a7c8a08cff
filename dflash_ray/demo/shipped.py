"""The demo world's tokenizer and trained target as the package ships them (dflash_ray/demo/shipped/), so the
embedded default's world is the same on every machine.

Why ship them: a target trained on each machine is that processor's. CPU kernels sum floats in different
orders (AVX2, AVX-512, AMX), so 1200 steps of training end at other weights, whose greedy answers, shards,
plan and steps differ (tried on another two-core CPU: 590 steps and held-out tau 3.12, against 568 and
4.28 here). The trained weights are files: trained once, shipped, every machine regenerates the corpus from
the same weights. Its greedy answers hold across processors when every greedy choice wins by a margin far
above float32's rounding: `build` measures the smallest margin over the whole regeneration and records it.

    scripts/build-demo-world.sh    # rebuild dflash_ray/demo/shipped/, run the default job on it, record its fingerprint

world.json records what the shipped files were made from (`made_from`: the seed, the corpus's settings, the
target's config and training, the chat template) and the corpus's sha256: a config whose world is made
from anything else (data.synthetic.num_conversations=400, another seed) trains its own target as before.
It also records the fingerprint of the world built from them through the product's own path (the
regenerated corpus and the plan: tests/test_demo_learns.py compares its build with it).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from dflash_ray.demo.world import SHIPPED, WORLD_JSON, made_from
from dflash_ray.machine_cache import file_digest


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def regenerated_fingerprint(regenerated: Path) -> str:
    """sha256 over the regenerated conversations by id (what the target answered; the file's own bytes
    could differ in key order or spacing without any token differing)."""
    rows = sorted((str(r["id"]), r["conversations"]) for r in map(json.loads, Path(regenerated).read_text().splitlines()))
    return _sha256_text(json.dumps(rows, sort_keys=True))


def greedy_margins(target_dir: Path, shards: Path) -> dict:
    """The smallest logit margin (top-1 minus top-2) of every supervised token in the shards (what the target
    chose when it regenerated the corpus), recomputed by teacher forcing in float64: how far each greedy
    choice is from a tie. float32's rounding moves these logits by ~1e-5; a margin far above that makes the
    same choice on any CPU."""
    import pyarrow.parquet as pq
    import torch

    from dflash_ray.data.shards import list_shards
    from dflash_ray.model.target import load_target

    model = load_target(str(target_dir), device="cpu", dtype=torch.float64)
    smallest, where, chosen, not_top1, below = float("inf"), None, 0, 0, {1e-3: 0, 1e-2: 0, 1e-1: 0}
    with torch.no_grad():
        for shard in list_shards(str(shards)):
            table = pq.read_table(shard, columns=["sample_id", "input_ids", "loss_mask"]).to_pylist()
            for row in table:
                ids = torch.tensor([row["input_ids"]])
                supervised = torch.tensor(row["loss_mask"], dtype=torch.bool)[1:]   # position t predicts t+1
                logits = model(input_ids=ids).logits[0, :-1][supervised]
                picked = logits.gather(-1, ids[0, 1:][supervised][:, None])[:, 0]
                top2 = logits.topk(2, dim=-1).values
                # negative: not the target's top-1: the template's end of turn after an answer cut at
                # regenerate.max_new_tokens (kept, regenerate.on_max_tokens=keep), not a greedy choice
                margin = picked - torch.where(picked == top2[:, 0], top2[:, 1], top2[:, 0])
                not_top1 += int((margin < 0).sum())
                margin = margin[margin >= 0]
                chosen += len(margin)
                for k in below:
                    below[k] += int((margin < k).sum())
                if len(margin) and float(margin.min()) < smallest:
                    smallest, where = float(margin.min()), row["sample_id"]
    return {"greedy_tokens": chosen, "not_top1": not_top1, "smallest_margin": smallest, "smallest_at": where,
            "below": {str(k): v for k, v in below.items()}}


def build(out: Path = SHIPPED, workdir: Path | None = None, overrides=(), log=print) -> dict:
    """Train the default config's demo target (as demo/world.py does) and write it, its tokenizer and
    world.json into `out`. The fingerprint (regenerated corpus, plan) is filled by `record_fingerprint`
    from a run of the default job, which regenerates on Ray as users do."""
    import tempfile

    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import _train_demo_target, ensure_corpus, ensure_target
    from dflash_ray.tokenizer import load_tokenizer

    work = Path(workdir or tempfile.mkdtemp(prefix="dflash-shipped-"))
    cfg = compose_config([f"run.root={work}", "run.name=build", *overrides])
    ensure_corpus(cfg, log=log)
    ensure_target(cfg, log=log)
    tok = load_tokenizer(cfg.data.tokenizer)
    _train_demo_target(cfg, tok, cfg.model.target_path, log)
    run = Path(cfg.run.dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shutil.copytree(run / "tokenizer", tmp / "tokenizer")
    shutil.copytree(run / "target", tmp / "target")
    from dflash_ray.model.generation import TRAINED_MARKER

    trained = json.loads((run / "target" / TRAINED_MARKER).read_text())
    record = {"made_from": made_from(cfg), "corpus_sha256": file_digest(run / "corpus.jsonl"),
              "target": {k: trained[k] for k in ("steps", "first_loss", "final_loss")}, "fingerprint": None}
    (tmp / WORLD_JSON).write_text(json.dumps(record, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    log(f"shipped world -> {out}")
    return record


def record_fingerprint(run_dir: Path, summary: dict, out: Path = SHIPPED, log=print) -> dict:
    """world.json's fingerprint from a default run that used the shipped files: the regenerated corpus,
    the plan's batches per epoch and steps, and the greedy margins of the regeneration."""
    record = json.loads((out / WORLD_JSON).read_text())
    run_dir = Path(run_dir)
    margins = greedy_margins(run_dir / "target", run_dir / "shards")
    record["fingerprint"] = {"regenerated_sha256": regenerated_fingerprint(run_dir / "regenerated.jsonl"),
                             "plan_epoch0": {k: summary["plan"][k] for k in ("batches", "tokens")},
                             "steps": summary["steps"], "greedy_margins": margins}
    (out / WORLD_JSON).write_text(json.dumps(record, indent=1) + "\n")
    log(f"fingerprint -> {out / WORLD_JSON}: {record['fingerprint']}")
    return record


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dflash_ray.demo.shipped", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides of the world built (default: none)")
    ap.add_argument("--out", default=str(SHIPPED), help="where to write the world (default: the package's)")
    ap.add_argument("--fingerprint", metavar="RUN_DIR",
                    help="record the fingerprint of a default run (dflash-ray train) made from the shipped files")
    args = ap.parse_args(argv)
    if args.fingerprint:
        run = Path(args.fingerprint)
        record_fingerprint(run, json.loads((run / "summary.json").read_text()), out=Path(args.out))
    else:
        build(out=Path(args.out), overrides=args.overrides)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
