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

Engines (regenerate.engine): `batched` and `continuous` generate with transformers in the job's target actors
(above); `http` sends each turn to an OpenAI-compatible server the user runs (model/http_engine.py), from
actors that hold no model; `vllm` and `sglang` run the engine as a Ray Data LLM stage (ray.data.llm's
processors over the cluster's GPUs, regenerate.engine_kwargs passed through): the turns are walked on the
driver (model/generation.py TurnWalk), one pass over the conversations per turn depth, each pass sending the
conversations that still have a turn to generate, token ids in, token ids out; a conversation is written as
soon as it is finished. Every engine stops a turn at the target's end tokens and at regenerate.max_new_tokens,
finds greedy loops and stops at the first tool call by the same rules, so the engine changes the speed, never
what is supervised.

Failures are counted by reason and reported, never fatal to the job: a malformed line, a duplicate id, an
empty or malformed conversation, a prompt longer than the target's context, a turn that hit
`regenerate.max_new_tokens` (dropped with the rest of its conversation, or kept: regenerate.on_max_tokens),
a turn the template cannot render as generated, a conversation stopped at a tool call (model/generation.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from collections import Counter
from pathlib import Path

from dflash_ray.config import RegenerateConfig
from dflash_ray.errors import UserError
from dflash_ray.threads import threads_for, usable_cores


# the continuous engine's conversations per actor call, in batch_size units: rows in flight stay batch_size,
# and a call's last rows finish with its slots emptying (a larger block: fewer such tails, coarser progress)
CONTINUOUS_BLOCK = 4
HTTP_ACTORS = 4            # http: actors sending requests (each regenerate.concurrency in flight)
SERVER_GONE = "server gone"   # an actor's report that the http server could not be reached after its retries


class RegenerateActor:
    """Holds the target on its device; regenerates a batch of conversations."""

    def __init__(self, target_dir: str, tokenizer_dir: str, max_new_tokens: int, batch_size: int, use_gpu: bool,
                 on_max_tokens: str = RegenerateConfig.on_max_tokens, template_kwargs: dict | None = None,
                 gpu_share: float = 1.0, dtype: str | None = None, threads: int = 1,
                 engine: str = RegenerateConfig.engine, sampling: dict | None = None,
                 http: dict | None = None):
        import torch

        from dflash_ray.data.supervision import Rendering
        from dflash_ray.runtime.cluster import cap_gpu_memory
        from dflash_ray.tokenizer import load_tokenizer

        rendering = Rendering(load_tokenizer(tokenizer_dir), template_kwargs)
        if engine == "http":      # no model here: the server's
            from dflash_ray.model.http_engine import HttpRegenerator

            self.regen = HttpRegenerator(target_dir, rendering, max_new_tokens=max_new_tokens,
                                         on_max_tokens=on_max_tokens, sampling=sampling, **(http or {}))
            return
        from dflash_ray.model.generation import Regenerator

        if use_gpu:
            cap_gpu_memory(gpu_share)
        else:
            torch.set_num_threads(max(1, threads))
        self.regen = Regenerator(target_dir, rendering,
                                 max_new_tokens=max_new_tokens, batch_size=batch_size, on_max_tokens=on_max_tokens,
                                 device="cuda" if use_gpu else "cpu", dtype=getattr(torch, dtype) if dtype else None,
                                 engine=engine, sampling=sampling)

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        from dflash_ray.model.http_engine import ServerGone

        rows = [json.loads(r) for r in batch["row"]]
        try:
            out, counts = self.regen([r["messages"] for r in rows], [r["tools"] for r in rows])
        except ServerGone as e:   # the driver writes what came before this block and says so in one line
            return {"line": np.array([""] * len(rows), dtype=object),
                    "counts": np.array([json.dumps({SERVER_GONE: str(e)})] + [""] * (len(rows) - 1), dtype=object)}
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


def engine_options(r) -> dict:
    """regenerate()'s engine arguments from the config's `regenerate` group (one place for the CLI and the demo):
    the sampling, the http engine's server and requests, the vllm and sglang engines' own arguments. One line
    for the http engine without a server to send to."""
    if r.engine == "http" and not r.url:
        raise UserError("config key 'regenerate.url' must be set for regenerate.engine=http (the server's "
                        "OpenAI-compatible base URL, e.g. http://host:8000/v1)")
    return {"sampling": {"temperature": r.temperature, "top_p": r.top_p, "seed": r.seed},
            "http": {"url": r.url, "served_model": r.served_model, "api_key_env": r.api_key_env,
                     "concurrency": r.concurrency, "max_retries": r.max_retries, "timeout_s": r.timeout_s}
            if r.engine == "http" else None,
            "engine_kwargs": dict(r.engine_kwargs or {})}


def served_model(http: dict) -> str:
    """The model the http engine's requests name: regenerate.served_model, else the first the server lists (one
    line when the server cannot be reached or lists none)."""
    from dflash_ray.model.http_engine import Completions, ServerGone

    try:
        return Completions(http["url"], model=http.get("served_model"),
                           api_key=os.environ.get(http.get("api_key_env") or "") or None,
                           max_retries=http.get("max_retries", RegenerateConfig.max_retries),
                           timeout_s=http.get("timeout_s", RegenerateConfig.timeout_s)).model
    except ServerGone as e:
        raise UserError(str(e)) from None


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
               template_kwargs: dict | None = None, dtype: str | None = None,
               engine: str = RegenerateConfig.engine, sampling: dict | None = None, http: dict | None = None,
               engine_kwargs: dict | None = None, stage=None, log=print) -> dict:
    """Run the job on the connected Ray cluster. Returns the counts by reason (and 'written', 'skipped:
    already in the output', 'actors'). `on_max_tokens`: regenerate.on_max_tokens (drop | keep). `dtype`:
    the target's (model.compute_dtype; None: bf16 on GPUs, fp32 on CPUs). `engine`: regenerate.engine; the
    continuous engine gets CONTINUOUS_BLOCK batches' worth of conversations a call, so its freed slots refill.
    `sampling`: regenerate.temperature / top_p / seed; `http`: the http engine's url, served_model,
    api_key_env, concurrency, max_retries, timeout_s; `engine_kwargs`: the vllm and sglang engines' own
    arguments (their replicas: engine_replicas); `stage`: the vllm and sglang engines' Ray Data stage (None: Ray Data
    LLM's processor, engine_stage())."""
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
    if todo and engine in ("vllm", "sglang"):
        if stage is None and importlib.util.find_spec(engine) is None:
            raise UserError(f"regenerate.engine={engine}: {engine} is not installed here: pip install "
                            f"'dflash-ray[{engine}]' on every node (docs/data.md, Engines)")
        replicas = 1 if stage else engine_replicas(engine, ray.cluster_resources().get("GPU", 0), engine_kwargs)
        engine_stage_regenerate(todo, out, counts, engine=engine, target_dir=target_dir, tokenizer_dir=tokenizer_dir,
                                max_new_tokens=max_new_tokens, batch_size=batch_size, on_max_tokens=on_max_tokens,
                                template_kwargs=template_kwargs, sampling=sampling, engine_kwargs=engine_kwargs,
                                concurrency=replicas, stage=stage, log=log)
    elif todo:
        if engine == "http":   # the server asked once, here: which model it serves, and whether it is there at all
            http = {**http, "served_model": served_model(http)}
        res = dict(num_gpus=cluster.target_gpus) if cluster.use_gpu and engine != "http" else dict(num_cpus=1)
        per_block = max(1, batch_size) * (CONTINUOUS_BLOCK if engine == "continuous" else 1)
        blocks = max(1, -(-len(todo) // per_block))
        gpus = ray.cluster_resources().get("GPU") if cluster.use_gpu else None
        counts["actors"] = actors = min(actor_pool_size(cluster, gpus) if engine != "http" else HTTP_ACTORS, blocks)
        if not cluster.use_gpu or engine == "http":   # an actor takes a CPU: never more than the cluster has
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
                                           engine=engine, sampling=sampling, http=http),
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
                            c = json.loads(c)
                            if SERVER_GONE in c:   # what came before is written; a rerun resumes
                                f.flush()
                                raise UserError(c[SERVER_GONE])
                            counts.update(c)
                    f.flush()
                    finished += len(batch["line"])
                    log(f"regenerate: {finished}/{len(todo)} conversations in {time.monotonic() - t0:.0f} s")
        finally:
            ctx.execution_options.preserve_order = preserve
            memory_check.detection_time_interval_s = interval
    summary = dict(sorted(counts.items()))
    log(f"regenerated {counts['written']} conversations -> {out} ({', '.join(f'{k}: {v}' for k, v in summary.items())})")
    return summary


# ----------------------------------------------------------------------------- vllm, sglang: Ray Data LLM stages
def engine_processor_config(engine: str, target_dir: str, *, batch_size: int, concurrency: int, engine_kwargs: dict | None):
    """The Ray Data LLM processor's config: the target as the engine loads it, token ids in and out (the
    prompts come rendered and tokenised by Rendering, the answers are decoded here from the ids); a row the
    engine fails is reported in the row (vLLM's should_continue_on_error) and counted, not the job's end."""
    from ray.data.llm import SGLangEngineProcessorConfig, vLLMEngineProcessorConfig

    common = dict(model_source=str(target_dir), batch_size=int(batch_size), concurrency=int(concurrency),
                  chat_template_stage=False, tokenize_stage=False, detokenize_stage=False)
    if engine == "vllm":
        return vLLMEngineProcessorConfig(engine_kwargs=dict(engine_kwargs or {}), should_continue_on_error=True,
                                         **common)
    # SGLang takes token ids only with its own tokenizer off
    return SGLangEngineProcessorConfig(engine_kwargs={"skip_tokenizer_init": True, **dict(engine_kwargs or {})},
                                       **common)


def engine_replicas(engine: str, gpus: float, engine_kwargs: dict | None) -> int:
    """The vllm and sglang engines' replicas: every GPU of the cluster serves, each replica on tensor x pipeline
    parallel GPUs (engine_kwargs' tensor_parallel_size, pipeline_parallel_size; SGLang's tp_size, pp_size).
    One line when the cluster has too few GPUs for one replica."""
    kw = dict(engine_kwargs or {})
    per = int(kw.get("tensor_parallel_size", kw.get("tp_size", 1))) * int(kw.get("pipeline_parallel_size",
                                                                              kw.get("pp_size", 1)))
    if int(gpus) < per:
        raise UserError(f"regenerate.engine={engine} serves on GPUs: the cluster has {int(gpus)}, one replica needs "
                        f"{per} (regenerate.engine_kwargs); regenerate.engine=batched runs on CPUs")
    return int(gpus) // per


def engine_sampling_params(engine: str, max_tokens: int, sampling: dict, ends: list[int]) -> dict:
    """One request's sampling parameters in the engine's own names (vLLM: max_tokens, seed; SGLang:
    max_new_tokens): greedy at temperature 0, every declared end token a stop, the loop stop applied after."""
    params = {"temperature": sampling["temperature"], "top_p": sampling["top_p"], "stop_token_ids": list(ends)}
    if engine == "vllm":
        params["max_tokens"] = int(max_tokens)
        if sampling["seed"] is not None:
            params["seed"] = sampling["seed"]
    else:
        params["max_new_tokens"] = int(max_tokens)
    return params


def engine_stage(engine: str, target_dir: str, *, batch_size: int, concurrency: int, engine_kwargs: dict | None,
                 sampling: dict, ends: list[int]):
    """Ray Data LLM's processor for `engine` as a stage: a dataset of {"i", "prompt", "ids", "max_tokens"} in,
    {"i", "max_tokens", "tokens", "error"} out (the generated ids as the engine returns them, an end token
    included; `error` the engine's message for a row it failed, else "")."""
    from ray.data.llm import build_processor

    processor = build_processor(
        engine_processor_config(engine, target_dir, batch_size=batch_size, concurrency=concurrency,
                                engine_kwargs=engine_kwargs),
        preprocess=lambda row: {"i": row["i"], "max_tokens": row["max_tokens"], "prompt": row["prompt"],
                                "tokenized_prompt": row["ids"],
                                "sampling_params": engine_sampling_params(engine, row["max_tokens"], sampling, ends)},
        postprocess=lambda row: {"i": row["i"], "max_tokens": row["max_tokens"],
                                 "tokens": list(row.get("generated_tokens") or []), "error": ""})
    return lambda ds: processor(ds)


def engine_answer(tokens: list[int], ends, max_tokens: int, capped_by: str, tok, loops) -> tuple[str, bool, str, int]:
    """An engine's generated ids as TurnWalk takes them: (text decoded from exactly the ids before the end token,
    stopped at an end token, what capped it, tokens generated); a greedy loop found after the fact, as the
    continuous engine does (model/generation.py first_loop)."""
    from dflash_ray.model.generation import first_loop

    tokens, ends = [int(t) for t in tokens], {int(t) for t in ends}
    stop = next((k for k, t in enumerate(tokens) if t in ends), None)
    body = tokens if stop is None else tokens[:stop]
    looped = first_loop(body, *loops) if loops else None
    if looped is not None:
        return "", False, "a greedy loop", len(body)
    return tok.decode(body), stop is not None, capped_by, len(tokens) if stop is None else stop + 1


def engine_stage_regenerate(todo: list[dict], out: Path, counts: Counter, *, engine: str, target_dir: str,
                            tokenizer_dir: str, max_new_tokens: int, batch_size: int, on_max_tokens: str,
                            template_kwargs: dict | None, sampling: dict | None, engine_kwargs: dict | None,
                            concurrency: int, stage=None, log=print) -> None:
    """The conversations walked on the driver, one pass of the engine's stage per turn depth over those still
    waiting on a turn; each conversation appended to `out` once it is finished (in the input's order among
    those finished by the same pass), so a rerun resumes from what is written."""
    import ray

    from dflash_ray.data.supervision import Rendering
    from dflash_ray.model.generation import (LOOP_MAX_PERIOD, LOOP_MIN_SPAN, TurnWalk, declared_end_token_ids,
                                             sampling_options)
    from dflash_ray.model.http_engine import _context_length
    from dflash_ray.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    rendering = Rendering(tok, template_kwargs)
    ends = declared_end_token_ids(tok, target_dir) or [tok.eos_token_id]
    sampling = sampling_options(sampling)
    loops = (LOOP_MIN_SPAN, LOOP_MAX_PERIOD) if on_max_tokens == "drop" else None
    max_context = _context_length(target_dir)
    walk = TurnWalk(rendering, [r["messages"] for r in todo], [r["tools"] for r in todo], max_context=max_context,
                    on_max_tokens=on_max_tokens, end_texts=tuple(tok.decode([t]) for t in ends))
    stage = stage or engine_stage(engine, target_dir, batch_size=batch_size, concurrency=concurrency,
                                  engine_kwargs=engine_kwargs, sampling=sampling, ends=ends)
    written, depth, t0 = set(), 0, time.monotonic()
    counts["actors"] = concurrency
    with open(out, "a", encoding="utf-8") as f:
        while prompts := walk.prompts():
            depth += 1
            rows = [{"i": i, "prompt": walk.texts[i], "ids": ids, "max_tokens": min(max_new_tokens, max_context - len(ids))}
                    for i, ids in prompts.items()]
            for row in stage(ray.data.from_items(rows)).iter_rows():
                i = int(row["i"])
                if row.get("__inference_error__") or row.get("error"):   # (vLLM's failed rows skip the postprocess)
                    walk.answer(i, "", False, "error: the engine failed it")
                    continue
                capped_by = "max_new_tokens" if row["max_tokens"] == max_new_tokens else "the target's context"
                text, stopped, capped_by, generated = engine_answer(row["tokens"], ends, row["max_tokens"],
                                                                    capped_by, tok, loops)
                counts["generated tokens"] += generated
                walk.answer(i, text, stopped, capped_by)
            _write_finished(f, walk, todo, written, counts)
            log(f"regenerate: turn {depth}: {len(rows)} turns, {len(written)}/{len(todo)} conversations finished "
                f"in {time.monotonic() - t0:.0f} s")
        _write_finished(f, walk, todo, written, counts)   # those the last prompts() found without a turn left
    counts.update(walk.counts)


def _write_finished(f, walk, todo: list[dict], written: set, counts: Counter) -> None:
    for i in walk.finished():
        if i not in written:
            written.add(i)
            if walk.out[i] is not None:
                f.write(json.dumps(output_row(todo[i], walk.out[i]), ensure_ascii=False, default=str) + "\n")
                counts["written"] += 1
    f.flush()
