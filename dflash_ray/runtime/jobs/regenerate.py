"""`dflash-ray regenerate`: the same conversations, with every assistant turn replaced by the target's own
greedy answer, as a Ray Data job.

    conversations in any format prepare reads (bad rows counted by reason; ids already in the output skipped: resumable)
      -> ray.data.from_items(one row per conversation)
      -> .map_batches(RegenerateActor) actor pool    one actor per target GPU (a custom resource on CPU
                                                     machines), batched greedy generation with a KV cache
      -> appended to the output .jsonl as batches finish, ready for `prepare`

Failures are counted by reason and reported, never fatal to the job: a malformed line, an empty or
malformed conversation, a prompt longer than the target's context (those conversations are left out),
a generation that hit `regenerate.max_new_tokens` (kept, without an end-of-turn token).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path



class RegenerateActor:
    """Holds the target on its device; regenerates a batch of conversations."""

    def __init__(self, target_dir: str, tokenizer_dir: str, max_new_tokens: int, batch_size: int, use_gpu: bool):
        import torch

        from dflash_ray.model.generation import Regenerator

        if not use_gpu:
            torch.set_num_threads(1)
        self.regen = Regenerator(target_dir, tokenizer_dir, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                 device="cuda" if use_gpu else "cpu")

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        rows = [json.loads(r) for r in batch["row"]]
        out, counts = self.regen([r.get("conversations") for r in rows])
        lines = [json.dumps({**r, "conversations": c}) if c is not None else "" for r, c in zip(rows, out)]
        return {"line": np.array(lines, dtype=object),
                "counts": np.array([json.dumps(counts)] + [""] * (len(rows) - 1), dtype=object)}


def read_conversations(path: str) -> tuple[list[dict], Counter]:
    """The conversations of the input (any format `prepare` reads: ShareGPT, OpenAI messages, this
    project's rows; jsonl, json, parquet, a directory or a glob), normalised to this project's rows with
    their conversation id (the running row index) as "id"; bad rows are counted by reason, not fatal."""
    from dflash_ray.data.formats import EMPTY_LINE, BadRows, iter_conversations

    report = BadRows()
    rows = [{"id": str(c.id), "conversations": c.messages, **({"tools": c.tools} if c.tools else {})}
            for c in iter_conversations(path, on_bad_row="skip", report=report)]
    return rows, Counter({f"bad row: {reason}": n for reason, n in report.counts.items() if reason != EMPTY_LINE})


def regenerate(input_path: str, output_path: str, *, target_dir: str, tokenizer_dir: str, cluster,
               max_new_tokens: int, batch_size: int, log=print) -> dict:
    """Run the job on the connected Ray cluster. Returns the counts by reason (and 'written', 'skipped:
    already in the output')."""
    import ray
    from ray.data import ActorPoolStrategy

    rows, counts = read_conversations(input_path)
    out = Path(output_path)
    done = set()
    if out.exists():
        with open(out) as f:
            for line in f:
                try:
                    done.add(str(json.loads(line)["id"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    pass  # a torn last line of an interrupted run: that conversation is redone
    todo = [r for r in rows if r["id"] not in done]
    counts["skipped: already in the output"] = len(rows) - len(todo)
    out.parent.mkdir(parents=True, exist_ok=True)
    if todo:
        res = (dict(num_gpus=cluster.target_gpus) if cluster.use_gpu
               else dict(num_cpus=0.5, resources={cluster.target_resource: 1}))
        per_block = max(1, batch_size)
        ds = ray.data.from_items([{"row": json.dumps(r)} for r in todo],
                                 override_num_blocks=max(1, -(-len(todo) // per_block)))
        ds = ds.map_batches(
            RegenerateActor, batch_size=per_block, compute=ActorPoolStrategy(size=cluster.target_workers),
            fn_constructor_kwargs=dict(target_dir=str(target_dir), tokenizer_dir=str(tokenizer_dir),
                                       max_new_tokens=max_new_tokens, batch_size=batch_size, use_gpu=cluster.use_gpu),
            **res)
        with open(out, "a") as f:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for line in batch["line"]:
                    if line:
                        f.write(line + "\n")
                        counts["written"] += 1
                for c in batch["counts"]:
                    if c:
                        counts.update(json.loads(c))
                f.flush()
    summary = dict(sorted(counts.items()))
    log(f"regenerated {counts['written']} conversations -> {out} ({', '.join(f'{k}: {v}' for k, v in summary.items())})")
    return summary
