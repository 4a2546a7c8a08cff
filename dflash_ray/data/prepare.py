"""Conversations -> parquet shards (sample_id, input_ids, loss_mask, num_tokens, num_supervised).

Inputs: ShareGPT, OpenAI messages (tools, tool calls, reasoning) or this project's own rows, in jsonl,
json or parquet files, a directory or a glob (`formats.py`, detected per row or forced by data.format).
What is supervised: exactly what the target generates for each assistant turn at serving time, rendered
by the tokenizer's own chat template with the deployment's template arguments (`supervision.py`); a
template that rewrites history gives one row per assistant turn. Bad rows stop the run with one line
naming the file and row (data.on_bad_row=fail) or are skipped and counted by reason (skip).

Sample ids: conversation id x 1024 + the row's turn (0 for a whole-conversation row, k for the k-th
trusted assistant turn's own row), where the conversation id is its running row index over the inputs: stable
across reruns, unique, and id // 1024 names the input row.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray.atomic import atomic_dir
from dflash_ray.config import DataConfig
from dflash_ray.data.formats import BadRows, count_rows, expand_inputs, iter_chunk, iter_conversations, where
from dflash_ray.data.report import ProgressCount, format_drops
from dflash_ray.data.shards import PREPARED_SCHEMA
from dflash_ray.data.supervision import supervise
from dflash_ray.errors import UserError
from dflash_ray.tokenizer import load_tokenizer

TURN_STRIDE = 1024  # sample_id = conversation id x TURN_STRIDE + row turn


@dataclass
class PrepareSummary:
    conversations: int = 0
    samples: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    shards: int = 0
    per_turn_conversations: int = 0       # the template rewrote history: one row per assistant turn
    heldout: list = field(default_factory=list)   # held-out conversations' prompt rows (data.heldout_fraction)
    dropped: Counter = field(default_factory=Counter)
    untrusted_turns: Counter = field(default_factory=Counter)  # assistant turns left out, by reason
    bad_rows: BadRows = field(default_factory=BadRows)
    output: str = ""

    def merge(self, other: "PrepareSummary") -> None:
        """Add another part's counts (a chunk of the Ray Data prepare), in input order."""
        for name in ("conversations", "samples", "tokens", "supervised_tokens", "per_turn_conversations"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.heldout.extend(other.heldout)
        self.dropped.update(other.dropped)
        self.untrusted_turns.update(other.untrusted_turns)
        self.bad_rows.merge(other.bad_rows)

    @classmethod
    def from_dict(cls, d: dict) -> "PrepareSummary":
        """as_dict()'s inverse (the Ray Data prepare carries each chunk's counts as this JSON)."""
        return cls(conversations=d["conversations"], samples=d["samples"], tokens=d["tokens"],
                   supervised_tokens=d["supervised_tokens"], shards=d["shards"],
                   per_turn_conversations=d["per_turn_conversations"], heldout=list(d.get("heldout", [])),
                   dropped=Counter(d["dropped"]),
                   untrusted_turns=Counter(d["untrusted_turns"]), bad_rows=BadRows.from_dict(d["bad_rows"]),
                   output=d["output"])

    def as_dict(self) -> dict:
        return {"conversations": self.conversations, "samples": self.samples, "tokens": self.tokens,
                "supervised_tokens": self.supervised_tokens, "shards": self.shards,
                "per_turn_conversations": self.per_turn_conversations, "heldout": list(self.heldout),
                "dropped": dict(self.dropped),
                "untrusted_turns": dict(self.untrusted_turns), "bad_rows": self.bad_rows.as_dict(),
                "output": self.output}


def _check_output_dir(out: Path, src: Path) -> None:
    """prepare replaces its output directory whole: refuse one that holds anything it did not write."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"{out}: output exists and is not a directory")
    if src.resolve().is_relative_to(out.resolve()):
        raise UserError(f"{out}: output directory holds the input {src}; choose another data.output")
    foreign = sorted(p.name for p in out.iterdir() if not (p.name.startswith("part-") and p.suffix == ".parquet"))
    if foreign:
        raise UserError(f"{out}: output directory holds files prepare did not write ({foreign[0]}); "
                        "choose an empty or new data.output")


def template_kwargs(cfg) -> dict | None:
    """data.chat_template_kwargs as a plain dict (None when unset): the served template's arguments, which
    prepare, regenerate, eval and the held-out tau all render with."""
    from omegaconf import OmegaConf

    kwargs = cfg.data.chat_template_kwargs
    return OmegaConf.to_container(kwargs) if kwargs else None


def options_from_config(cfg) -> dict:
    """prepare()'s keyword arguments from the config (the command and the embedded default's data)."""
    d = cfg.data
    return dict(shard_size=d.shard_size, min_supervised=2 * cfg.model.block_size, vocab_size=d.vocab_size,
                format=d.format, on_bad_row=d.on_bad_row, turns=d.turns, template_kwargs=template_kwargs(cfg),
                heldout_fraction=d.heldout_fraction)


@dataclass(frozen=True)
class Options:
    """What prepare does with each conversation (the data.* config keys)."""
    shard_size: int = DataConfig.shard_size
    min_supervised: int = 0
    vocab_size: int | None = None
    format: str = DataConfig.format
    on_bad_row: str = DataConfig.on_bad_row
    turns: str = DataConfig.turns
    template_kwargs: dict | None = None
    heldout_fraction: float = 0.0


HELDOUT = "heldout.jsonl"   # beside the shards: the held-out conversations' prompts (read_prompts renders them)


def is_heldout(conversation_id: int, fraction: float) -> bool:
    """Whether a conversation (by its id: its running row index over the inputs) is in the held-out slice:
    a hash of the id below `fraction`, so the slice is the same on every prepare of the same inputs, on
    either engine, whatever the shard size, and no conversation is both trained and held out."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"dflash-heldout:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def heldout_row(conv) -> dict | None:
    """A held-out conversation's prompt: its turns up to its last user turn (and its tools), rendered at
    evaluation time by data/prompts.py as prepare renders training rows; None without a user turn."""
    users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
    if not users:
        return None
    return {"id": conv.id, "conversations": conv.messages[:users[-1] + 1], **({"tools": conv.tools} if conv.tools else {})}


def rows_table(rows: dict) -> pa.Table:
    return pa.table({
        "sample_id": pa.array(rows["sample_id"], type=pa.int64()),
        "input_ids": pa.array(rows["input_ids"], type=pa.list_(pa.int32())),
        "loss_mask": pa.array(rows["loss_mask"], type=pa.list_(pa.int8())),
        "num_tokens": pa.array(rows["num_tokens"], type=pa.int32()),
        "num_supervised": pa.array(rows["num_supervised"], type=pa.int32()),
    }, schema=PREPARED_SCHEMA)


def add_conversation(tok, conv, opts: Options, summary: PrepareSummary, rows: dict) -> None:
    """The training rows of one conversation appended to `rows` (columns of PREPARED_SCHEMA), its drops,
    untrusted turns and bad rows counted in `summary`. The one place both prepare paths decide."""
    def bad(reason: str, detail: str):
        if opts.on_bad_row == "fail":
            raise UserError(f"{conv.source}: {where(conv.source, conv.row)}: {detail}")
        summary.bad_rows.add(reason, conv.source, conv.row, detail)

    summary.conversations += 1
    if is_heldout(conv.id, opts.heldout_fraction):   # never trained: its prompt is evaluated instead
        row = heldout_row(conv)
        if row is not None:
            summary.heldout.append(row)
        else:
            summary.dropped["heldout_without_user_turn"] += 1
        return
    if not any(m["role"] == "assistant" for m in conv.messages):
        summary.dropped["no_assistant_turn"] += 1
        return
    try:
        sup = supervise(tok, conv.messages, conv.tools, template_kwargs=opts.template_kwargs, turns=opts.turns)
    except Exception as e:  # the template's own errors (jinja2), e.g. "roles must alternate"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        bad("chat_template_failed", f"chat template failed ({reason})")
        return
    summary.untrusted_turns.update(sup.skipped_turns)
    summary.per_turn_conversations += int(sup.per_turn)
    if not sup.rows:
        summary.dropped["no_trusted_assistant_turn"] += 1
        return
    if opts.vocab_size is not None:  # before any row is kept: a bad conversation is left out whole
        top = max(int(row.ids.max()) for row in sup.rows if row.ids.size) if any(r.ids.size for r in sup.rows) else -1
        if top >= opts.vocab_size:
            bad("token_out_of_vocabulary", f"token id {top} >= vocab size {opts.vocab_size}")
            return
    for row in sup.rows:
        if row.turn >= TURN_STRIDE:
            summary.dropped["assistant_turns_over_1023"] += 1
            continue
        supervised = int(row.mask.sum())
        if supervised < opts.min_supervised:
            summary.dropped["too_few_supervised_tokens"] += 1
            continue
        rows["sample_id"].append(conv.id * TURN_STRIDE + row.turn)
        rows["input_ids"].append(row.ids)
        rows["loss_mask"].append(row.mask)
        rows["num_tokens"].append(int(row.ids.size))
        rows["num_supervised"].append(supervised)
        summary.samples += 1
        summary.tokens += int(row.ids.size)
        summary.supervised_tokens += supervised


def prepare_chunk(tok, chunk, opts: Options) -> tuple[pa.Table, PrepareSummary]:
    """One chunk of the inputs (formats.plan_chunks) -> its rows and counts: a task of the Ray Data prepare."""
    summary = PrepareSummary()
    rows: dict[str, list] = {name: [] for name in PREPARED_SCHEMA.names}
    for conv in iter_chunk(chunk, format=opts.format, on_bad_row=opts.on_bad_row, report=summary.bad_rows):
        add_conversation(tok, conv, opts, summary, rows)
    return rows_table(rows), summary


def check_inputs(input_path, output: str, shard_size: int | None = None) -> list[str]:
    """The inputs, expanded, none of them inside the output directory. (shard_size: not checked here any
    more, config.py's MINIMUM has data.shard_size >= 1; the argument stays for runtime/jobs/prepare_on_ray.py.)"""
    inputs = expand_inputs(input_path)
    for src in inputs:
        _check_output_dir(Path(output), Path(src))
    return inputs


def no_samples(input_path, summary: PrepareSummary, min_supervised: int | None = None) -> UserError:
    dropped = format_drops(summary.dropped, min_supervised)
    return UserError(f"{input_path}: no usable conversations (dropped: {dropped}; {summary.bad_rows.summary_line()})")


def prepare(input_path, tokenizer_path: str, output: str, *, progress: bool = True, **options) -> PrepareSummary:
    """Single-process prepare: one pass over the inputs, shards of data.shard_size rows written as it goes
    (the Ray Data job is runtime/jobs/prepare_on_ray.py). `progress`: rows read of all the inputs' rows on
    stderr (a bar on a terminal, a line every few seconds in logs)."""
    opts = Options(**options)
    inputs = check_inputs(input_path, output)
    tok = load_tokenizer(tokenizer_path)
    summary = PrepareSummary(output=str(output))
    rows: dict[str, list] = {name: [] for name in PREPARED_SCHEMA.names}

    def flush(dest: Path):
        if rows["sample_id"]:
            pq.write_table(rows_table(rows), dest / f"part-{summary.shards:05d}.parquet")
            summary.shards += 1
            for v in rows.values():
                v.clear()

    conversations = iter_conversations(inputs, format=opts.format, on_bad_row=opts.on_bad_row,
                                       report=summary.bad_rows)
    total = count_rows(inputs) if progress else None
    with atomic_dir(output) as dest, ProgressCount(total, "prepare", "rows", enabled=progress) as bar:
        for conv in conversations:
            add_conversation(tok, conv, opts, summary, rows)
            bar.set(conv.id + 1)   # ids run over the inputs' rows, blank lines and bad rows included
            if len(rows["sample_id"]) >= opts.shard_size:
                flush(dest)
        bar.set(total or bar.n)
        flush(dest)
        if summary.samples == 0:
            raise no_samples(input_path, summary, opts.min_supervised)
        write_heldout(dest, summary)
    return summary


def write_heldout(dest, summary: PrepareSummary) -> None:
    """<output>/heldout.jsonl: the held-out conversations' prompts, in id order (none: no file)."""
    if summary.heldout:
        with open(Path(dest) / HELDOUT, "w") as f:
            for row in sorted(summary.heldout, key=lambda r: r["id"]):
                f.write(json.dumps(row) + "\n")
