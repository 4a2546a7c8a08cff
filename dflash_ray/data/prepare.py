"""conversations.jsonl -> parquet shards (sample_id, input_ids, loss_mask, num_tokens, num_supervised).

The loss mask comes from the tokenizer's own chat template: an assistant turn's span is the text that
rendering conversation[:i+1] adds to rendering conversation[:i] with the generation prompt (so the
turn's end-of-turn token is supervised too); characters map to tokens through the fast tokenizer's
offsets. Templates without that prefix property (e.g. ones that rewrite earlier turns) fall back to the
assistant content located in the full rendering.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray.atomic import atomic_dir
from dflash_ray.data.shards import PREPARED_SCHEMA
from dflash_ray.errors import UserError

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PrepareSummary:
    samples: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    shards: int = 0
    dropped: Counter = field(default_factory=Counter)
    output: str = ""

    def as_dict(self) -> dict:
        return {"samples": self.samples, "tokens": self.tokens, "supervised_tokens": self.supervised_tokens,
                "shards": self.shards, "dropped": dict(self.dropped), "output": self.output}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{p}: tokenizer directory does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except Exception as e:
        raise UserError(f"{p}: cannot load tokenizer ({str(e).splitlines()[0]})") from e
    if not getattr(tok, "is_fast", False):
        raise UserError(f"{p}: a fast tokenizer (tokenizer.json) is needed for token offsets")
    if not tok.chat_template:
        raise UserError(f"{p}: tokenizer has no chat_template")
    return tok


def _read_conversation(path: Path, lineno: int, line: str) -> list[dict]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {lineno}: malformed JSON ({e.msg})") from e
    conv = obj.get("conversations") if isinstance(obj, dict) else None
    if not isinstance(conv, list):
        raise UserError(f"{path}: line {lineno}: missing 'conversations' list")
    for m in conv:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"{path}: line {lineno}: each message needs a role ({'/'.join(ROLES)}) and string content")
    return conv


def assistant_spans(tok, conv: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of the assistant turns in it."""
    full = tok.apply_chat_template(conv, tokenize=False)
    spans, cursor = [], 0
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True) if i else None
        upto = tok.apply_chat_template(conv[:i + 1], tokenize=False)
        if before is not None and full.startswith(upto) and upto.startswith(before):
            end = len(upto)
            while end > len(before) and upto[end - 1].isspace():  # the turn ends at its end-of-turn token
                end -= 1
            spans.append((len(before), end))
            cursor = len(upto)
        else:
            at = full.find(m["content"], cursor)
            if at >= 0:
                spans.append((at, at + len(m["content"])))
                cursor = at + len(m["content"])
    return full, spans


def tokenize_with_mask(tok, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(ids.size, dtype=np.int8)
    for s, e in spans:
        mask[(starts >= s) & (starts < e)] = 1
    return ids, mask


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


def prepare(input_path: str, tokenizer_path: str, output: str, *, shard_size: int = 10000,
            min_supervised: int = 0, vocab_size: int | None = None, progress: bool = True) -> PrepareSummary:
    from tqdm import tqdm

    src = Path(input_path)
    if not src.is_file():
        raise UserError(f"{src}: input file does not exist")
    _check_output_dir(Path(output), src)
    tok = load_tokenizer(tokenizer_path)
    if shard_size < 1:
        raise UserError("config key 'data.shard_size': must be >= 1")
    summary = PrepareSummary(output=str(output))
    rows: dict[str, list] = {name: [] for name in PREPARED_SCHEMA.names}

    def flush(dest: Path):
        if not rows["sample_id"]:
            return
        table = pa.table({
            "sample_id": pa.array(rows["sample_id"], type=pa.int64()),
            "input_ids": pa.array(rows["input_ids"], type=pa.list_(pa.int32())),
            "loss_mask": pa.array(rows["loss_mask"], type=pa.list_(pa.int8())),
            "num_tokens": pa.array(rows["num_tokens"], type=pa.int32()),
            "num_supervised": pa.array(rows["num_supervised"], type=pa.int32()),
        }, schema=PREPARED_SCHEMA)
        pq.write_table(table, dest / f"part-{summary.shards:05d}.parquet")
        summary.shards += 1
        for v in rows.values():
            v.clear()

    with atomic_dir(output) as dest, open(src, "rb") as f:
        for lineno, raw in enumerate(tqdm(f, desc="prepare", unit=" conv", disable=None if progress else True,
                                          file=sys.stderr), start=1):  # disable=None: bar only on a terminal
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{src}: line {lineno}: not UTF-8 ({e.reason} at byte {e.start})") from e
            if not line.strip():
                summary.dropped["empty_line"] += 1
                continue
            conv = _read_conversation(src, lineno, line)
            if not any(m["role"] == "assistant" for m in conv):
                summary.dropped["no_assistant_turn"] += 1
                continue
            try:
                text, spans = assistant_spans(tok, conv)
            except Exception as e:  # the template's own errors (jinja2), e.g. "roles must alternate"
                raise UserError(f"{src}: line {lineno}: chat template failed ({str(e).splitlines()[0]})") from e
            ids, mask = tokenize_with_mask(tok, text, spans)
            if vocab_size is not None and ids.size and ids.max() >= vocab_size:
                raise UserError(f"{src}: line {lineno}: token id {int(ids.max())} >= vocab size {vocab_size}")
            if int(mask.sum()) < min_supervised:
                summary.dropped["too_few_supervised_tokens"] += 1
                continue
            rows["sample_id"].append(lineno - 1)  # the line's index: unique and stable
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
            rows["num_tokens"].append(int(ids.size))
            rows["num_supervised"].append(int(mask.sum()))
            summary.samples += 1
            summary.tokens += int(ids.size)
            summary.supervised_tokens += int(mask.sum())
            if len(rows["sample_id"]) >= shard_size:
                flush(dest)
        flush(dest)
        if summary.samples == 0:
            raise UserError(f"{src}: no usable conversations (dropped: {dict(summary.dropped) or 'none'})")
    return summary
