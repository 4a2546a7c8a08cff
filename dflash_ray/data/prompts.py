"""Prompts for `dflash-ray eval` and the main job's held-out tau: a jsonl file, one prompt a line, as a
conversation row in any shape `prepare` reads ({"conversations": [...]} as ShareGPT or role/content rows,
{"messages": [...]}, with "tools" and ShareGPT's "system"; turns after the last user turn are dropped and
the chat template's generation prompt is added), {"prompt": "text"}, {"input_ids": [...]} or a bare list of
token ids (heldout.jsonl). Text is rendered as prepare and regenerate render it (supervision.Rendering:
the same template arguments, tools and system prompt). No torch at import."""
from __future__ import annotations

import json
from pathlib import Path

from dflash_ray.errors import UserError


def find_tokenizer(*candidates):
    """The first candidate directory that holds a tokenizer.json, loaded; None if none does."""
    from dflash_ray.tokenizer import load_tokenizer

    for cand in candidates:
        if cand and (Path(cand) / "tokenizer.json").exists():
            return load_tokenizer(cand)
    return None


def read_prompts(path: str, tok, limit: int, template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of up to `limit` prompts, each rendered as the serving engine renders it (the chat template
    with `template_kwargs`, data.chat_template_kwargs). `path`: a local file or a URI pyarrow opens
    (file://, s3://, gs://)."""
    import io

    import pyarrow.fs as pafs

    from dflash_ray.data.formats import normalise_row
    from dflash_ray.data.shards import filesystem_of
    from dflash_ray.data.supervision import Rendering

    src = path
    fs, where = filesystem_of(str(path))
    if fs.get_file_info(where).type != pafs.FileType.File:
        raise UserError(f"{src}: prompts file does not exist")
    rendering = Rendering(tok, template_kwargs) if tok is not None else None
    prompts = []
    with fs.open_input_stream(where) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{src}: line {lineno}: malformed JSON ({e.msg})") from e
            ids = row if isinstance(row, list) else row.get("input_ids") if isinstance(row, dict) else None
            if isinstance(ids, list):                # {"input_ids": [...]} or a bare list (heldout.jsonl)
                if not all(isinstance(x, int) for x in ids):
                    raise UserError(f"{src}: line {lineno}: input_ids must be a list of integers")
                prompts.append(ids)
            elif isinstance(row, dict) and ("conversations" in row or "messages" in row or "prompt" in row):
                if "conversations" in row or "messages" in row:
                    try:
                        conv, tools = normalise_row(row, "auto")   # a prompt row's own shape, not data.format
                    except ValueError as e:
                        raise UserError(f"{src}: line {lineno}: {e}") from None
                else:
                    conv, tools = [{"role": "user", "content": str(row["prompt"])}], None
                users = [i for i, m in enumerate(conv) if m["role"] == "user"]
                if not users:
                    raise UserError(f"{src}: line {lineno}: no user turn to prompt with")
                if rendering is None:
                    raise UserError(f"{src}: line {lineno}: text prompts need a tokenizer (data.tokenizer=DIR)")
                try:
                    prompts.append(rendering.prompt_ids(conv[:users[-1] + 1], tools)[1])
                except Exception as e:  # the template's own errors (jinja2), e.g. "roles must alternate"
                    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise UserError(f"{src}: line {lineno}: chat template failed ({reason})") from None
            else:
                raise UserError(f"{src}: line {lineno}: expected 'conversations', 'messages', 'prompt' or 'input_ids'")
            if len(prompts) >= limit:
                break
    if not prompts:
        raise UserError(f"{src}: no prompts")
    return prompts
