"""Which tokens of a conversation the drafter learns: exactly what the target generates for each assistant
turn at serving time.

At serving time the target sees turn i's prompt — the conversation before it, rendered by the chat template
with the generation prompt (and the template arguments of the deployment, e.g. `enable_thinking`) — and
generates the rest of `render(messages[:i+1])`: reasoning, tool calls, the answer, the end-of-turn token.
So for every assistant turn i:

    prompt_i = render(messages[:i], add_generation_prompt=True)
    turn_i   = render(messages[:i+1])            must start with prompt_i, else the mask cannot be trusted
    supervised = turn_i[len(prompt_i):], up to and including the end-of-turn token (trailing whitespace
                 after it is the template's separator, not generated)

When rendering the whole conversation repeats every turn_i as a prefix (append-only templates, e.g.
ChatML), the conversation is one training row with every assistant turn supervised. Templates that
rewrite history (Qwen3 drops earlier turns' reasoning) render an earlier turn differently once later
turns exist; then each assistant turn becomes its own row — turn_i, supervised on its own generation, its
history as the target sees it then — or only the last turn's (`turns="last"`). A turn whose prompt is not
a prefix of its rendering (e.g. `enable_thinking=false` while the turn carries reasoning) is left out and
counted by reason, never silently masked wrong.

Rendered by hand rather than with transformers' `return_assistant_tokens_mask`: that mask needs
`{% generation %}` markers, which most published templates (Qwen3's, Llama 3's) lack, and it marks the
assistant text inside the whole-conversation rendering, which for history-rewriting templates is not what
the target generates at serving time.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

TURNS = ("all", "last")


@dataclass
class Row:
    ids: np.ndarray       # int32 token ids of the rendered text
    mask: np.ndarray      # int8, 1 on supervised tokens
    turn: int             # 0 for a whole-conversation row, else k for the k-th trusted assistant turn (1-based)


@dataclass
class Supervision:
    rows: list = field(default_factory=list)
    skipped_turns: Counter = field(default_factory=Counter)   # reason -> assistant turns left out
    per_turn: bool = False                                    # the template rewrote history


def _render(tok, messages, tools, kwargs, generation: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                   add_generation_prompt=generation, **kwargs)


def _generated_end(text: str, start: int) -> int:
    end = len(text)
    while end > start and text[end - 1].isspace():  # the turn ends at its end-of-turn token
        end -= 1
    return end


def supervise(tok, messages: list[dict], tools=None, *, template_kwargs: dict | None = None,
              turns: str = "all") -> Supervision:
    """The training rows of one conversation (see the module docstring). Raises whatever the template
    raises (e.g. jinja2's "roles must alternate"): the caller reports it as a bad row."""
    kwargs = dict(template_kwargs or {})
    out = Supervision()
    spans = []  # (turn index, rendered turn text, start, end) of every trusted assistant turn
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        turn_text = _render(tok, messages[: i + 1], tools, kwargs, generation=False)
        prompt = _render(tok, messages[:i], tools, kwargs, generation=True) if i else None
        if prompt is None or not turn_text.startswith(prompt):
            out.skipped_turns["no_prompt_before_turn" if prompt is None else "prompt_not_a_prefix_of_turn"] += 1
            continue
        end = _generated_end(turn_text, len(prompt))
        if end <= len(prompt):
            out.skipped_turns["empty_generation"] += 1
            continue
        spans.append((i, turn_text, len(prompt), end))
    if not spans:
        return out
    if turns == "last":
        spans = spans[-1:]
    whole = _render(tok, messages, tools, kwargs, generation=False)
    if all(whole.startswith(text) for _, text, _, _ in spans):
        ids, mask = tokenize_with_mask(tok, whole, [(s, e) for _, _, s, e in spans])
        out.rows.append(Row(ids, mask, 0))
        return out
    out.per_turn = True
    for k, (_, text, s, e) in enumerate(spans):
        ids, mask = tokenize_with_mask(tok, text, [(s, e)])
        out.rows.append(Row(ids, mask, k + 1))
    return out


def tokenize_with_mask(tok, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `text` cut at the spans' edges, each piece tokenized on its own, as serving tokenizes
    a prompt and then generates after it (a merge across a prompt/generation edge would be a token the
    target never produced), and a mask of 1 on the spans' tokens."""
    pieces, cursor = [], 0
    for s, e in sorted(spans):
        pieces += [(text[cursor:s], 0), (text[s:e], 1)]
        cursor = e
    pieces.append((text[cursor:], 0))
    ids, mask = [], []
    for piece, supervised in pieces:
        if piece:
            got = tok(piece, add_special_tokens=False)["input_ids"]
            ids += got
            mask += [supervised] * len(got)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8)
