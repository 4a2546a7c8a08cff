"""Conversation inputs in the formats users have -> one normalised shape for a Hugging Face chat template.
(Long on purpose: every format's reader sits beside the one shape they all produce.)

Inputs (`expand_inputs`): a file, a directory (its *.jsonl, *.json and *.parquet files, sorted by name, not
recursive; other files ignored), a glob pattern (matches sorted), a list of these (in the order given,
duplicates dropped), or a Hugging Face `datasets` directory written by `save_to_disk` (read with the
`datasets` package, which is optional).

Row shapes, detected per row under format="auto" (a forced format makes a row of another shape a bad row):
  "openai"         {"messages": [{"role", "content", ...}], "tools"?: [...]}   (OpenAI, UltraChat)
  "sharegpt"       {"conversations": [{"from", "value"}, ...], "system"?, "tools"?}
  "conversations"  {"conversations": [{"role", "content"}, ...]}               (this project's own)
A row with both keys is read through "messages".

Normalised messages are what chat templates (`apply_chat_template(messages, tools=tools)`) expect:
  role      system/user/assistant/tool, mapped from ROLE_MAP (case-insensitive; the ShareGPT names included)
  content   a string: text parts [{"type": "text", "text"}] joined; "" for an assistant tool-call turn whose
            content is null/missing. Any other non-string content is a bad row.
  tool_calls  assistant turns only: [{"type": "function", "function": {"name", "arguments": dict}, "id"?}],
            from OpenAI calls, flat {"name", "arguments"} calls, a legacy `function_call` object, or a
            ShareGPT "function_call" turn (its value the JSON call or list of calls). `arguments` given as a
            JSON string is parsed: templates such as Qwen3's render it with `| tojson`.
  reasoning_content, name, tool_call_id   kept when they are strings; other keys are dropped.
The row's `tools` (a list, or a JSON string of one, as LLaMA-Factory writes) is kept; [] becomes None.

Numbering: `row` is the 0-based index of a row within its file, for every format; for jsonl that is the
0-based line index with blank lines included. Messages name a row by `where`: "line N" as an editor counts
it (row + 1) for JSON lines, "row N (0-based)" in a parquet file, a JSON list or a datasets directory
(pyarrow's and Python's index). `id` is a running index over all
rows of all inputs in `expand_inputs` order: id = (rows in the earlier inputs, blank lines and bad rows
included) + row. It is unique, independent of on_bad_row, and stable while the inputs and their contents
are unchanged; for a single jsonl file it equals the 0-based line index (prepare's sample_id before).
`fields` (only when asked for, `keep_fields=True`: regenerate passes them through): the row's other keys,
its own "id" among them.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from dflash_ray.config import FORMATS, ON_BAD_ROW, DataConfig  # noqa: F401  (re-exported: the readers' choices)
from dflash_ray.errors import UserError

__all__ = ["FORMATS", "ON_BAD_ROW", "ROLE_MAP", "EMPTY_LINE", "BadRows", "Chunk", "Conversation", "expand_inputs",
           "count_rows", "iter_chunk", "iter_conversations", "normalise_row", "plan_chunks", "where"]

SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_EXAMPLES = 5
EMPTY_LINE = "empty_line"
ROW_KEYS = ("messages", "conversations", "tools", "system")  # what a conversation is read from
BATCH_ROWS = 1024  # parquet / datasets rows per batch: bounded memory, amortised conversion

# lower-cased role or ShareGPT `from` -> template role; one map, ShareGPT's names are a superset
ROLE_MAP = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool",
}
FUNCTION_CALL = "function_call"  # ShareGPT (LLaMA-Factory): an assistant turn whose value is the call(s) as JSON
SHAPES = {"openai": "'messages' of {role, content}", "sharegpt": "'conversations' of {from, value}",
          "conversations": "'conversations' of {role, content}"}


@dataclass(slots=True)
class Conversation:
    messages: list[dict]   # normalised, see the module docstring
    tools: list | None     # the row's tool definitions, for apply_chat_template(tools=...)
    source: str            # the input file (or datasets directory) it came from
    row: int               # 0-based row index within `source` (jsonl: line index, blank lines included)
    id: int                # running index over all inputs' rows: unique and stable sample id
    format: str            # the row shape: "openai", "sharegpt" or "conversations"
    fields: dict | None = None  # the row's other keys (keep_fields=True), e.g. its own "id"


@dataclass
class BadRows:
    """What iter_conversations passed over: counts by reason, the first MAX_EXAMPLES (path, row) and the first
    message per reason. Blank jsonl lines count as "empty_line" under either policy; every other reason is
    recorded only under on_bad_row="skip" (under "fail" the first bad row raises)."""
    counts: Counter = field(default_factory=Counter)
    first: dict = field(default_factory=dict)      # reason -> [(path, row), ...]
    messages: dict = field(default_factory=dict)   # reason -> "path: row N: what is wrong" (the first one)

    def add(self, reason: str, path: str, row: int, message: str | None = None) -> None:
        self.counts[reason] += 1
        examples = self.first.setdefault(reason, [])
        if len(examples) < MAX_EXAMPLES:
            examples.append((path, row))
        if message is not None and reason not in self.messages:
            self.messages[reason] = f"{path}: {where(path, row)}: {message}"

    def merge(self, other: "BadRows") -> None:
        """Add a later part's record (chunks merged in input order keep the earliest examples)."""
        self.counts.update(other.counts)
        for reason, examples in other.first.items():
            mine = self.first.setdefault(reason, [])
            mine += examples[: MAX_EXAMPLES - len(mine)]
        for reason, message in other.messages.items():
            self.messages.setdefault(reason, message)

    @property
    def bad_rows(self) -> int:
        return sum(n for reason, n in self.counts.items() if reason != EMPTY_LINE)

    def summary_line(self) -> str:
        """E.g. "skipped 3 bad rows (malformed_json 2: a.jsonl line 4, a.jsonl line 8; unknown_role 1: b.json row 0
        (0-based)); 2 empty lines" (one line)."""
        reasons = sorted(r for r in self.counts if r != EMPTY_LINE)
        line = "no bad rows" if not reasons else f"skipped {self.bad_rows} bad rows (" + "; ".join(
            f"{r} {self.counts[r]}: " + ", ".join(f"{p} {where(p, n)}" for p, n in self.first[r])
            for r in reasons) + ")"
        if self.counts[EMPTY_LINE]:
            line += f"; {self.counts[EMPTY_LINE]} empty lines"
        return line

    @classmethod
    def from_dict(cls, d: dict) -> "BadRows":
        """as_dict()'s inverse."""
        return cls(counts=Counter(d["counts"]), first={r: [tuple(x) for x in ex] for r, ex in d["first"].items()},
                   messages=dict(d["messages"]))

    def as_dict(self) -> dict:
        return {"bad_rows": self.bad_rows, "counts": dict(self.counts),
                "first": {r: [[p, n] for p, n in ex] for r, ex in self.first.items()},
                "messages": dict(self.messages)}


class _Bad(Exception):
    """A bad row: counted under `reason`; `detail` says what is wrong (the file and row are added later)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


_EMPTY = object()  # a blank jsonl line


# ---------------------------------------------------------------------------------------------- inputs

def _is_hf_dataset_dir(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _hf_input(p: Path) -> str:
    # checked up front, so a missing package fails before any row is read
    if importlib.util.find_spec("datasets") is None:
        raise UserError(f"{p}: a Hugging Face datasets directory (save_to_disk); reading it needs the datasets "
                        "package: pip install datasets")
    return str(p)


def _expand_one(spec: str) -> list[str]:
    p = Path(spec)
    if p.is_dir():
        if _is_hf_dataset_dir(p):  # before listing: its state.json / dataset_info.json are not data
            return [_hf_input(p)]
        files = sorted(str(c) for c in p.iterdir() if c.suffix.lower() in SUFFIXES and c.is_file())
        if not files:
            raise UserError(f"{p}: no .jsonl, .json or .parquet files in this directory")
        return files
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise UserError(f"{p}: unsupported input file type (expected .jsonl, .json or .parquet)")
        return [str(p)]
    if glob.has_magic(spec):
        out = []
        for m in sorted(glob.glob(spec, recursive=True)):
            mp = Path(m)
            if mp.is_file() and mp.suffix.lower() in SUFFIXES:
                out.append(m)
            elif mp.is_dir() and _is_hf_dataset_dir(mp):
                out.append(_hf_input(mp))
        if not out:
            raise UserError(f"{spec}: no .jsonl, .json or .parquet files match this pattern")
        return out
    raise UserError(f"{spec}: input does not exist")


def expand_inputs(spec: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """The input files (and datasets directories) named by `spec`, in the order their rows are numbered:
    a file; a directory's *.jsonl/*.json/*.parquet sorted by name (not recursive); a glob's matches sorted;
    a list of these in the order given, a path named twice kept once. UserError when nothing matches."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise UserError("data.input: no input given")
    out, seen = [], set()
    for s in specs:
        for p in _expand_one(os.fspath(s)):
            key = os.path.realpath(p)
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


# --------------------------------------------------------------------------------------------- readers

def where(path: str, row: int) -> str:
    """Row `row` (0-based) of `path` as a message names it: "line N" as an editor counts lines (row + 1) in
    JSON lines (.jsonl, or a .json file holding JSON lines), else "row N (0-based)" (parquet, a JSON list,
    a datasets directory: the index pyarrow and Python give it)."""
    return f"line {row + 1}" if _json_lines(path) else f"row {row} (0-based)"


def _json_lines(path: str) -> bool:
    """Whether `path` is read line by line: a .jsonl file, or a .json file whose first line is a whole JSON
    object with more after it (what _read_json reads as JSON lines)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return True
    if suffix != ".json" or os.path.isdir(path):
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline().removeprefix(b"\xef\xbb\xbf").strip()
            more = any(line.strip() for line in iter(f.readline, b""))
        return first.startswith(b"{") and more and isinstance(json.loads(first), dict)
    except (OSError, ValueError):
        return False


def _parse_line(raw: bytes, row: int):
    try:
        line = raw.decode("utf-8-sig" if row == 0 else "utf-8")  # a BOM may lead the file
    except UnicodeDecodeError as e:
        return _Bad("not_utf8", f"not UTF-8 ({e.reason} at byte {e.start})")
    if not line or line.isspace():
        return _EMPTY
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:  # e.colno would count past the line's own newline: use the offset
        where = "the end of the line" if e.pos >= len(line.rstrip()) else f"column {e.pos + 1}"
        return _Bad("malformed_json", f"malformed JSON ({e.msg} at {where})")


def _read_jsonl(path: str) -> Iterator[tuple[int, object]]:
    with open(path, "rb") as f:  # bytes: a bad line is one bad row, not a decode error for the file
        for row, raw in enumerate(f):
            yield row, _parse_line(raw, row)


def _read_json(path: str) -> Iterator[tuple[int, object]]:
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):
            # JSON lines under a .json name (datasets' to_json writes these): one row per line
            yield from _read_jsonl(path)
            return
        raise UserError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(obj, dict):
        if "messages" in obj or "conversations" in obj:  # a file holding a single row
            obj = [obj]
        else:
            lists = [k for k, v in obj.items() if isinstance(v, list)]
            if len(lists) != 1:
                raise UserError(f"{path}: expected a list of rows, or an object with one list of rows "
                                f"(found {len(lists)} list-valued keys: {', '.join(lists) or 'none'})")
            obj = obj[lists[0]]
    if not isinstance(obj, list):
        raise UserError(f"{path}: expected a list of rows, found a JSON {type(obj).__name__}")
    yield from enumerate(obj)


def _read_parquet(path: str, row_groups: tuple = (), first_row: int = 0,
                  all_columns: bool = False) -> Iterator[tuple[int, object]]:
    """Rows of a parquet file (of `row_groups` only when given: a chunk, whose first row is `first_row`);
    only the columns a conversation is read from unless `all_columns`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
    except Exception as e:
        raise UserError(f"{path}: not a readable parquet file ({_first_line(e)})") from e
    if "messages" not in names and "conversations" not in names:
        raise UserError(f"{path}: no 'messages' or 'conversations' column (columns: {', '.join(names)})")
    columns = None if all_columns else [c for c in ROW_KEYS if c in names]  # skip the rest
    batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=columns, row_groups=list(row_groups) or None)
    row = first_row
    while True:
        try:
            batch = next(batches, None)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise UserError(f"{path}: unreadable parquet data after row {row} ({_first_line(e)})") from e
        if batch is None:
            return
        for r in batch.to_pylist():
            yield row, r
            row += 1


def _read_hf_dataset(path: str) -> Iterator[tuple[int, object]]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise UserError(f"{path}: cannot load the datasets directory ({_first_line(e)})") from e
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        split = "train" if "train" in ds else (splits[0] if len(splits) == 1 else None)
        if split is None:
            raise UserError(f"{path}: datasets directory with splits {', '.join(splits)}; "
                            "name one split's subdirectory as the input")
        ds = ds[split]
    row = 0
    for batch in ds.iter(batch_size=BATCH_ROWS):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            yield row, dict(zip(keys, values))
            row += 1


def _read(path: str, all_columns: bool = False) -> Iterator[tuple[int, object]]:
    if os.path.isdir(path):
        return _read_hf_dataset(path)
    suffix = Path(path).suffix.lower()
    return (_read_jsonl(path) if suffix == ".jsonl" else _read_json(path) if suffix == ".json"
            else _read_parquet(path, all_columns=all_columns))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ------------------------------------------------------------------------------------------ normalising

def _what(m: dict, key: str) -> str:
    v = m.get(key)
    return "missing" if key not in m else "null" if v is None else f"a {type(v).__name__}"


def _join_parts(parts: list, i: int) -> str:
    texts = []
    for p in parts:
        if isinstance(p, str):
            texts.append(p)
            continue
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind not in ("text", None):
            raise _Bad("non_text_content", f"message {i}: non-text content (part of type {kind!r})")
        if not isinstance(p.get("text"), str):
            raise _Bad("bad_content", f"message {i}: a text part without a string 'text'")
        texts.append(p["text"])
    return "".join(texts)  # parts are consecutive pieces of one text (OpenAI semantics)


def _arguments(a, i: int, j: int) -> dict:
    if a is None or a == "":
        return {}
    if isinstance(a, str):
        try:
            a = json.loads(a)
        except json.JSONDecodeError as e:
            raise _Bad("bad_tool_calls",
                       f"message {i}: tool call {j}: arguments are not valid JSON ({e.msg})") from None
    if not isinstance(a, dict):
        raise _Bad("bad_tool_calls", f"message {i}: tool call {j}: arguments are not a JSON object")
    return a


def _tool_calls(calls, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise _Bad("bad_tool_calls", f"message {i}: tool_calls is not a list")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise _Bad("bad_tool_calls", f"message {i}: tool call {j} is not an object")
        if call.get("type") not in (None, "function"):
            raise _Bad("bad_tool_calls", f"message {i}: tool call {j} has type {call['type']!r} (only 'function')")
        fn = call.get("function")
        if fn is None:
            fn = call  # flat {"name", "arguments"} (Hermes style, ShareGPT function_call values)
        elif not isinstance(fn, dict):
            raise _Bad("bad_tool_calls", f"message {i}: tool call {j}: 'function' is not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _Bad("bad_tool_calls", f"message {i}: tool call {j} has no function name")
        c = {"type": "function", "function": {"name": name, "arguments": _arguments(fn.get("arguments"), i, j)}}
        if isinstance(call.get("id"), str):
            c["id"] = call["id"]
        out.append(c)
    return out


def _json_objects(v, reason: str, what: str):
    """A JSON string parsed and a single object wrapped in a list: how LLaMA-Factory-style rows store lists
    of objects (`what` begins the message when the string is not JSON)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise _Bad(reason, f"{what} not JSON ({e.msg})") from None
    return [v] if isinstance(v, dict) else v


def _function_call_value(v, i: int) -> list[dict]:
    v = _json_objects(v, "bad_tool_calls", f"message {i}: function_call value is")
    if not isinstance(v, list) or not v:
        raise _Bad("bad_tool_calls", f"message {i}: function_call value is not a call or a list of calls")
    return _tool_calls(v, i)


def _message(m, i: int, sharegpt: bool) -> dict:
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if not isinstance(m, dict):
        raise _Bad("bad_message", f"message {i} is not an object")
    raw = m.get(role_key)
    if not isinstance(raw, str):
        raise _Bad("bad_message", f"message {i}: '{role_key}' is {_what(m, role_key)}, not a role name")
    low = raw.lower()
    if sharegpt and low == FUNCTION_CALL:
        role, content, calls = "assistant", "", _function_call_value(m.get(content_key), i)
    else:
        role = ROLE_MAP.get(low)
        if role is None:
            raise _Bad("unknown_role", f"message {i}: unknown role {raw!r}")
        c = m.get(content_key)
        content = c if type(c) is str else _join_parts(c, i) if isinstance(c, list) else None
        tc = m.get("tool_calls")
        if tc is None and isinstance(m.get("function_call"), dict):  # OpenAI's legacy single call
            tc = [m["function_call"]]
        calls = None
        if tc is not None and tc != []:  # parquet gives [] / None where a row has no calls
            if role != "assistant":
                raise _Bad("bad_tool_calls", f"message {i}: tool_calls on a {role} turn")
            calls = _tool_calls(tc, i)
        if content is None:
            if not calls:
                raise _Bad("bad_content", f"message {i} ({role}): '{content_key}' is {_what(m, content_key)}, "
                                          "not a string")
            content = ""  # an assistant turn that only calls tools
    out = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = calls
    for k in ("reasoning_content", "name", "tool_call_id"):
        v = m.get(k)
        if v is not None:
            if not isinstance(v, str):
                raise _Bad("bad_message", f"message {i}: {k} is {_what(m, k)}, not a string")
            out[k] = v
    return out


def _tools(t) -> list | None:
    if t is None:
        return None
    if isinstance(t, str) and not t.strip():  # LLaMA-Factory stores tools as a JSON string
        return None
    t = _json_objects(t, "bad_tools", "'tools' is a string but")
    if not isinstance(t, list) or not all(isinstance(x, dict) for x in t):
        raise _Bad("bad_tools", "'tools' is not a list of objects")
    return t or None  # [] -> None: templates test `if tools`, and some render a tool preamble for []


def _detect(row: dict) -> tuple[str, str, object]:
    """(format, key, message list) of a row; _Bad when it holds no recognisable conversation."""
    if row.get("messages") is not None:
        return "openai", "messages", row["messages"]
    conv = row.get("conversations")
    if conv is None:
        keys = ", ".join(list(row)[:8]) or "none"
        raise _Bad("no_conversation", f"no 'messages' or 'conversations' list (keys: {keys})")
    first = conv[0] if isinstance(conv, list) and conv else None
    if isinstance(first, dict):
        if first.get("from") is not None:
            return "sharegpt", "conversations", conv
        if first.get("role") is None:
            raise _Bad("no_conversation", "message 0 has neither 'role' nor 'from'")
    return "conversations", "conversations", conv


def _normalise(row, format: str) -> tuple[str, list[dict], list | None]:
    """(format, messages, tools) of one parsed row; raises _Bad (reason, detail) for a bad row."""
    if not isinstance(row, dict):
        kind = "null" if row is None else type(row).__name__
        raise _Bad("not_an_object", f"row is a JSON {kind}, not an object")
    found, key, msgs = _detect(row)
    if not isinstance(msgs, list):
        raise _Bad("no_conversation", f"'{key}' is not a list")
    if not msgs:
        raise _Bad("empty_conversation", "empty conversation")
    if format != "auto" and found != format:
        raise _Bad("wrong_format", f"a {found} row ({SHAPES[found]}), but the format is set to {format}")
    sharegpt = found == "sharegpt"
    messages = [_message(m, i, sharegpt) for i, m in enumerate(msgs)]
    if sharegpt:
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise _Bad("bad_message", "'system' is not a string")
        if system and messages[0]["role"] != "system":  # LLaMA-Factory keeps the system prompt beside the turns
            messages.insert(0, {"role": "system", "content": system})
    return found, messages, _tools(row.get("tools"))


def normalise_row(row, format: str = DataConfig.format) -> tuple[list[dict], list | None]:
    """(messages, tools) of one parsed row, normalised as for prepare (ShareGPT's system prompt first, tools
    kept); ValueError saying what is wrong for a bad row."""
    try:
        _, messages, tools = _normalise(row, format)
    except _Bad as bad:
        raise ValueError(bad.detail) from None
    return messages, tools


def _check_choices(format: str, on_bad_row: str) -> None:
    if format not in FORMATS:
        raise UserError(f"data.format: unknown format {format!r} (one of {', '.join(FORMATS)})")
    if on_bad_row not in ON_BAD_ROW:
        raise UserError(f"data.on_bad_row: unknown policy {on_bad_row!r} (one of {', '.join(ON_BAD_ROW)})")


def _conversations(path: str, rows: Iterator[tuple[int, object]], base: int, format: str, on_bad_row: str,
                   report: BadRows, keep_fields: bool = False) -> Iterator[Conversation]:
    """The conversations of (row, parsed object) pairs of one file whose row 0 has id `base`."""
    for row, obj in rows:
        if obj is _EMPTY:
            report.counts[EMPTY_LINE] += 1
            continue
        try:
            if isinstance(obj, _Bad):
                raise obj
            found, messages, tools = _normalise(obj, format)
        except _Bad as bad:
            if on_bad_row == "fail":
                raise UserError(f"{path}: {where(path, row)}: {bad.detail}") from None
            report.add(bad.reason, path, row, bad.detail)
            continue
        fields = {k: v for k, v in obj.items() if k not in ROW_KEYS} if keep_fields else None
        yield Conversation(messages, tools, path, row, base + row, found, fields)


def iter_conversations(spec, format: str = DataConfig.format, on_bad_row: str = DataConfig.on_bad_row,
                       report: BadRows | None = None, keep_fields: bool = False) -> Iterator[Conversation]:
    """Every conversation of the inputs named by `spec` (see expand_inputs), normalised, in input order.

    A bad row raises UserError("<path>: line <n>: <what is wrong>") (`where`: "row <n> (0-based)" outside
    JSON lines) under on_bad_row="fail"; under "skip" it is
    recorded in `report` and passed over. Blank jsonl lines are counted in `report` as "empty_line".
    Problems with a whole file (missing, unreadable, no conversation column) always raise.
    Conversations without an assistant turn are yielded: the caller decides about those. keep_fields: each
    conversation's `fields` holds the row's other keys."""
    _check_choices(format, on_bad_row)
    report = BadRows() if report is None else report
    base = 0
    for path in expand_inputs(spec):
        last = [-1]

        def counted(rows):
            for row, obj in rows:
                last[0] = row
                yield row, obj

        yield from _conversations(path, counted(_read(path, keep_fields)), base, format, on_bad_row, report,
                                  keep_fields)
        base += last[0] + 1


# --------------------------------------------------------------------------------------------- chunks
@dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of one input file, for one task of a parallel prepare. `base`: the conversation id
    of the file's row 0 (ids equal iter_conversations' over the same inputs); `offset`: jsonl's byte offset of
    row `start`; `row_groups`: parquet's row groups holding the rows."""
    path: str
    start: int
    stop: int | None
    base: int
    offset: int = 0
    row_groups: tuple = ()


def _jsonl_chunks(path: str, base: int, every: int) -> tuple[list[Chunk], int]:
    starts, rows, pos, last = [(0, 0)], 0, 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            i = block.find(b"\n")
            while i >= 0:
                rows += 1
                if rows % every == 0:
                    starts.append((rows, pos + i + 1))
                i = block.find(b"\n", i + 1)
            pos += len(block)
            last = block[-1:]
    total = rows + (1 if pos and last != b"\n" else 0)   # a last line without its newline is a row too
    starts = [(r, o) for r, o in starts if r < total] or [(0, 0)]
    bounds = [r for r, _ in starts[1:]] + [total]
    return [Chunk(path, r, stop, base, offset=o) for (r, o), stop in zip(starts, bounds)], total


def _parquet_chunks(path: str, base: int, every: int) -> tuple[list[Chunk], int]:
    import pyarrow.parquet as pq

    try:
        md = pq.ParquetFile(path).metadata
    except Exception as e:
        raise UserError(f"{path}: not a readable parquet file ({_first_line(e)})") from e
    chunks, start, groups, rows = [], 0, [], 0
    for g in range(md.num_row_groups):
        groups.append(g)
        rows += md.row_group(g).num_rows
        if rows - start >= every or g == md.num_row_groups - 1:
            chunks.append(Chunk(path, start, rows, base, row_groups=tuple(groups)))
            start, groups = rows, []
    return chunks, rows


def plan_chunks(spec, rows_per_chunk: int) -> list[Chunk]:
    """The inputs cut into chunks of about `rows_per_chunk` rows (jsonl by lines, parquet by row groups; a
    .json file or a datasets directory is one chunk), with the ids iter_conversations gives their rows."""
    chunks, base = [], 0
    for path in expand_inputs(spec):
        suffix = Path(path).suffix.lower()
        if not os.path.isdir(path) and suffix == ".jsonl":
            got, total = _jsonl_chunks(path, base, max(1, int(rows_per_chunk)))
        elif not os.path.isdir(path) and suffix == ".parquet":
            got, total = _parquet_chunks(path, base, max(1, int(rows_per_chunk)))
        else:
            total = sum(1 for _ in _read(path))
            got = [Chunk(path, 0, None, base)]
        chunks += got
        base += total
    return chunks


def count_rows(spec) -> int:
    """Rows of the inputs, blank lines and bad rows included (the ids iter_conversations gives stay below it):
    a byte scan of jsonl files, parquet footers, other inputs read whole. A progress bar's total."""
    total = 0
    for path in expand_inputs(spec):
        suffix = Path(path).suffix.lower()
        if not os.path.isdir(path) and suffix in (".jsonl", ".parquet"):
            total += (_jsonl_chunks if suffix == ".jsonl" else _parquet_chunks)(path, 0, 1 << 62)[1]
        else:
            total += sum(1 for _ in _read(path))
    return total


def _read_chunk(chunk: Chunk) -> Iterator[tuple[int, object]]:
    path = chunk.path
    if chunk.row_groups:
        yield from _read_parquet(path, chunk.row_groups, chunk.start)
    elif chunk.stop is not None and Path(path).suffix.lower() == ".jsonl":
        with open(path, "rb") as f:
            f.seek(chunk.offset)
            for row in range(chunk.start, chunk.stop):
                yield row, _parse_line(f.readline(), row)
    else:
        yield from _read(path)


def iter_chunk(chunk: Chunk, format: str = DataConfig.format, on_bad_row: str = DataConfig.on_bad_row,
               report: BadRows | None = None) -> Iterator[Conversation]:
    """The conversations of one chunk: the same objects, ids and bad-row handling as iter_conversations."""
    _check_choices(format, on_bad_row)
    report = BadRows() if report is None else report
    yield from _conversations(chunk.path, _read_chunk(chunk), chunk.base, format, on_bad_row, report)
