"""`dflash-ray regenerate`: the same conversations, with every assistant turn replaced by the target's own
greedy answer, as a Ray Data job.

    conversations in any format prepare reads (bad rows counted by reason; ids already in the output skipped: resumable)
      -> ray.data.from_items(one row per conversation)
      -> .map_batches(RegenerateActor) actor pool    on GPUs one actor per target_gpus share of every GPU the
                                                     cluster has (regeneration is the cluster's only job);
                                                     on CPUs cluster.target_workers (a custom resource);
                                                     batched greedy generation with a KV cache
      -> appended to the output .jsonl in the input's order (Ray Data's preserve_order: `prepare` numbers
         conversations by their place in the file, so completion order must not reach the sample ids),
         ready for `prepare`

Rendered as `prepare` renders (data/supervision.py's Rendering: data.chat_template_kwargs, the row's tools
and system prompt), so each regenerated turn is supervised in `prepare` exactly as it was generated, when
both steps get the same data.chat_template_kwargs.

Rows keep their own "id" and other fields; a row without an id gets "sha1:<12 hex>" of its normalised
conversation and tools (stable when rows are inserted or edited). A rerun skips the ids already in the
output; a torn last line (a run killed mid-write) is cut off first, and its conversation redone.

Failures are counted by reason and reported, never fatal to the job: a malformed line, a duplicate id, an
empty or malformed conversation, a prompt longer than the target's context, a turn that hit
`regenerate.max_new_tokens` (dropped with the rest of its conversation, or kept: regenerate.on_max_tokens),
a turn the template cannot render as generated, a conversation stopped at a tool call (model/generation.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from pathlib import Path

from dflash_ray.errors import UserError
from dflash_ray.threads import threads_for, usable_cores


# the continuous engine's conversations per actor call, in batch_size units: rows in flight stay batch_size,
# and a call's last rows finish with its slots emptying (a larger block: fewer such tails, coarser progress)
CONTINUOUS_BLOCK = 4


class RegenerateActor:
    """Holds the target on its device; regenerates a batch of conversations."""

    def __init__(self, target_dir: str, tokenizer_dir: str, max_new_tokens: int, batch_size: int, use_gpu: bool,
                 on_max_tokens: str = "drop", template_kwargs: dict | None = None, gpu_share: float = 1.0,
                 dtype: str | None = None, threads: int = 1, engine: str = "batched"):
        import torch

        from dflash_ray.data.supervision import Rendering
        from dflash_ray.model.generation import Regenerator
        from dflash_ray.runtime.cluster import cap_gpu_memory
        from dflash_ray.tokenizer import load_tokenizer

        if use_gpu:
            cap_gpu_memory(gpu_share)
        else:
            torch.set_num_threads(max(1, threads))
        self.regen = Regenerator(target_dir, Rendering(load_tokenizer(tokenizer_dir), template_kwargs),
                                 max_new_tokens=max_new_tokens, batch_size=batch_size, on_max_tokens=on_max_tokens,
                                 device="cuda" if use_gpu else "cpu", dtype=getattr(torch, dtype) if dtype else None,
                                 engine=engine)

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        rows = [json.loads(r) for r in batch["row"]]
        out, counts = self.regen([r["messages"] for r in rows], [r["tools"] for r in rows])
        lines = [json.dumps(output_row(r, c), ensure_ascii=False, default=str) if c is not None else ""
                 for r, c in zip(rows, out)]
        return {"line": np.array(lines, dtype=object),
                "counts": np.array([json.dumps(counts)] + [""] * (len(rows) - 1), dtype=object)}


def output_row(row: dict, conversation: list) -> dict:
    """The output line of a regenerated conversation: the input row's own fields, its id, the regenerated
    messages (this project's rows: role/content, reasoning_content, tool_calls) and its tools."""
    return {**row["fields"], "id": row["id"], "conversations": conversation,
            **({"tools": row["tools"]} if row["tools"] else {})}


def fingerprint(messages: list, tools) -> str:
    """The id of a row that has none: its normalised conversation and tools, hashed."""
    blob = json.dumps([messages, tools], sort_keys=True, ensure_ascii=False, default=str)
    return "sha1:" + hashlib.sha1(blob.encode("utf-8")).hexdigest()[:12]


def read_conversations(path: str) -> tuple[list[dict], Counter]:
    """The conversations of the input (any format `prepare` reads: ShareGPT, OpenAI messages, this
    project's rows; jsonl, json, parquet, a directory or a glob), normalised, each with its "id" (the row's
    own, else its fingerprint), its tools and the row's other fields; bad rows are counted by reason, not
    fatal (a second row with an id already seen counts as 'duplicate_id')."""
    from dflash_ray.data.formats import EMPTY_LINE, BadRows, iter_conversations

    report = BadRows()
    rows, seen = [], set()
    for c in iter_conversations(path, on_bad_row="skip", report=report, keep_fields=True):
        fields = dict(c.fields)
        own = fields.pop("id", None)
        if own is not None and (isinstance(own, bool) or not isinstance(own, (str, int))):
            report.add("bad_id", c.source, c.row, f"'id' is a {type(own).__name__}, not a string or an integer")
            continue
        rid = own if own is not None else fingerprint(c.messages, c.tools)
        if str(rid) in seen:
            report.add("duplicate_id", c.source, c.row, f"id {rid!r} already given to an earlier row")
            continue
        seen.add(str(rid))
        rows.append({"id": rid, "messages": c.messages, "tools": c.tools, "fields": fields})
    return rows, Counter({f"bad row: {reason}": n for reason, n in report.counts.items() if reason != EMPTY_LINE})


def read_done(out: Path) -> tuple[set[str], Counter]:
    """The ids already in the output (as strings), after repairing a torn last line: a line without its
    newline (a run killed mid-write) is cut off, its conversation to be redone; a last line that is a whole
    row but lacks the newline gets one. A malformed line before the last is not regenerate's: UserError."""
    done, counts = set(), Counter()
    if not out.exists():
        return done, counts
    tail_at, tail = 0, b""
    with open(out, "rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):                 # only the last line can lack its newline
                tail = line
                break
            tail_at += len(line)
            if not line.strip():
                continue
            rid = _row_id(line)
            if rid is None:
                raise UserError(f"{out}: line {n}: not a JSON row with an 'id' (regenerate did not write it); "
                                "fix or remove the line, or choose another regenerate.output")
            done.add(rid)
    if tail:
        rid = _row_id(tail)
        with open(out, "r+b") as f:
            if rid is None:
                f.truncate(tail_at)
                counts["torn last line cut off (its conversation redone)"] += 1
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
                done.add(rid)
            f.flush()
            os.fsync(f.fileno())
    return done, counts


def _row_id(line: bytes) -> str | None:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    rid = row.get("id") if isinstance(row, dict) else None
    return None if rid is None or isinstance(rid, (dict, list)) else str(rid)


def actor_pool_size(cluster, cluster_gpus: float | None = None) -> int:
    """Target actors of the regeneration. On GPUs: every GPU of the cluster generates, one actor per
    cluster.target_gpus share (`cluster_gpus`: Ray's count of the cluster's GPUs; None or 0: the configured
    split's, target_workers x target_gpus + drafter_workers x drafter_gpus). On CPUs: every core of this
    machine, one actor per cluster.cpu_threads.regenerate threads (regeneration runs alone: the demo's two
    cores regenerate twice as fast as the one target slot did; each conversation's answer does not depend
    on what shares its batch, so the output is the same)."""
    if not cluster.use_gpu:
        return max(1, usable_cores() // threads_for(getattr(cluster, "cpu_threads", None), "regenerate"))
    gpus = cluster_gpus or (cluster.target_workers * cluster.target_gpus + cluster.drafter_workers * cluster.drafter_gpus)
    return max(1, int(gpus / cluster.target_gpus + 1e-9))


def regenerate(input_path: str, output_path: str, *, target_dir: str, tokenizer_dir: str, cluster,
               max_new_tokens: int, batch_size: int, on_max_tokens: str,
               template_kwargs: dict | None = None, dtype: str | None = None, engine: str = "batched",
               log=print) -> dict:
    """Run the job on the connected Ray cluster. Returns the counts by reason (and 'written', 'skipped:
    already in the output', 'actors'). `on_max_tokens`: regenerate.on_max_tokens (drop | keep). `dtype`:
    the target's (model.compute_dtype; None: bf16 on GPUs, fp32 on CPUs). `engine`: regenerate.engine; the
    continuous engine gets CONTINUOUS_BLOCK batches' worth of conversations a call, so its freed slots refill."""
    import ray
    from ray.data import ActorPoolStrategy

    rows, counts = read_conversations(input_path)
    out = Path(output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done, repaired = read_done(out)
    counts.update(repaired)
    todo = [r for r in rows if str(r["id"]) not in done]
    counts["skipped: already in the output"] = len(rows) - len(todo)
    gone = len(done - {str(r["id"]) for r in rows})
    if gone:
        counts["in the output but no longer in the input"] = gone
    if todo:
        res = dict(num_gpus=cluster.target_gpus) if cluster.use_gpu else dict(num_cpus=1)
        per_block = max(1, batch_size) * (CONTINUOUS_BLOCK if engine == "continuous" else 1)
        blocks = max(1, -(-len(todo) // per_block))
        gpus = ray.cluster_resources().get("GPU") if cluster.use_gpu else None
        counts["actors"] = actors = min(actor_pool_size(cluster, gpus), blocks)
        if not cluster.use_gpu:   # an actor takes a CPU: never more actors than the cluster has CPUs for
            actors = counts["actors"] = min(actors, max(1, int(ray.cluster_resources().get("CPU", 1))))
        # the output in the input's order whatever order the actor's batches finish in (a run of the demo world
        # wrote batch 32-63 before 0-31 and trained on other sample ids than the run before it)
        ctx = ray.data.DataContext.get_current()
        preserve, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
        # an actor holds the target and its decoding caches by design (4.6 GiB for SmolLM2 at 64 rows): Ray
        # Data's high-memory detector said so in a 10-line warning every 30 s, 72 times in one regeneration
        memory_check = ctx.issue_detectors_config.high_memory_detector_config
        interval, memory_check.detection_time_interval_s = memory_check.detection_time_interval_s, -1
        try:
            ds = ray.data.from_items([{"row": json.dumps(r, ensure_ascii=False, default=str)} for r in todo],
                                     override_num_blocks=blocks)
            ds = ds.map_batches(
                RegenerateActor, batch_size=per_block, compute=ActorPoolStrategy(size=actors),
                fn_constructor_kwargs=dict(target_dir=str(target_dir), tokenizer_dir=str(tokenizer_dir),
                                           max_new_tokens=max_new_tokens, batch_size=batch_size, use_gpu=cluster.use_gpu,
                                           on_max_tokens=on_max_tokens, template_kwargs=template_kwargs,
                                           gpu_share=cluster.target_gpus if cluster.use_gpu else 1.0, dtype=dtype,
                                           threads=threads_for(getattr(cluster, "cpu_threads", None), "regenerate"),
                                           engine=engine),
                **res)
            t0, finished = time.monotonic(), 0
            with open(out, "a", encoding="utf-8") as f:
                for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                    for line in batch["line"]:
                        if line:
                            f.write(line + "\n")
                            counts["written"] += 1
                    for c in batch["counts"]:
                        if c:
                            counts.update(json.loads(c))
                    f.flush()
                    finished += len(batch["line"])
                    log(f"regenerate: {finished}/{len(todo)} conversations in {time.monotonic() - t0:.0f} s")
        finally:
            ctx.execution_options.preserve_order = preserve
            memory_check.detection_time_interval_s = interval
    summary = dict(sorted(counts.items()))
    log(f"regenerated {counts['written']} conversations -> {out} ({', '.join(f'{k}: {v}' for k, v in summary.items())})")
    return summary
