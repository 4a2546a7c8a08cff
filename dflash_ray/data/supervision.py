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

`Rendering` is the one rendering path: `prepare` supervises with it, `regenerate` renders its prompts with
it and stores each generated turn as the message whose supervision here is exactly the generated text
(`Rendering.assistant_message`), and `eval` / the held-out tau render their prompts with it
(`data/prompts.py`): the same template arguments, tools and system prompt everywhere.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dflash_ray.config import DataConfig

TURNS = ("all", "last")
# Where a generated answer calls a tool, by model family: Hermes / Qwen2.5 / Qwen3 (<tool_call>), Llama 3.1
# (<|python_tag|>), Mistral ([TOOL_CALLS]), Kimi K2, DeepSeek V3. Llama 3's bare-JSON calls carry no marker.
TOOL_CALL_MARKERS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|tool_calls_section_begin|>",
                     "<\uff5ctool\u2581calls\u2581begin\uff5c>")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


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


@dataclass(frozen=True)
class Turn:
    """Assistant turn i as it is supervised: `text` = render(messages[:i+1]), of which text[start:end] is
    what the target generates after its prompt text[:start] (its end-of-turn token included)."""
    text: str
    start: int
    end: int

    @property
    def prompt(self) -> str:
        return self.text[:self.start]

    @property
    def generated(self) -> str:
        return self.text[self.start:self.end]


class Rendering:
    """A conversation as the deployment renders it: the tokenizer's chat template with the deployment's
    template arguments (`data.chat_template_kwargs`, e.g. {enable_thinking: false}) and the row's tools;
    the system prompt is the conversation's first message (formats.py puts ShareGPT's `system` there)."""

    def __init__(self, tok, template_kwargs: dict | None = None):
        self.tok = tok
        self.kwargs = dict(template_kwargs or {})

    def render(self, messages: list[dict], tools=None, generation: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=generation, **self.kwargs)

    def prompt_ids(self, messages: list[dict], tools=None) -> tuple[str, list[int]]:
        """The prompt of the assistant turn that follows `messages` (the template's generation prompt
        added), as text and as the token ids a serving engine feeds the target."""
        text = self.render(messages, tools, generation=True)
        return text, self.tok(text, add_special_tokens=False)["input_ids"]

    def turn(self, messages: list[dict], i: int, tools=None) -> Turn | str:
        """Assistant turn i of `messages` as supervised, or the reason it cannot be trusted:
        'no_prompt_before_turn', 'prompt_not_a_prefix_of_turn' or 'empty_generation'."""
        if not i:
            return "no_prompt_before_turn"
        text = self.render(messages[: i + 1], tools)
        prompt = self.render(messages[:i], tools, generation=True)
        if not text.startswith(prompt):
            return "prompt_not_a_prefix_of_turn"
        end = _generated_end(text, len(prompt))
        if end <= len(prompt):
            return "empty_generation"
        return Turn(text, len(prompt), end)

    def assistant_message(self, history: list[dict], tools, generated: str, ends) -> dict | None:
        """The message to store for an assistant turn the target generated after `history`: the first of
        (its tool calls parsed, its reasoning split off as the template's own rule does, the text as is)
        whose supervision (`turn`) is exactly `generated` followed by one of `ends` (the texts of the end
        tokens the model declares). None when no form renders as generated: the template would make prepare
        train on other text than the target produced."""
        ends = tuple(ends)
        for m in _candidates(generated):
            t = self.turn(history + [m], len(history), tools)
            if isinstance(t, Turn) and t.generated.startswith(generated) and t.generated[len(generated):] in ends:
                return m
        return None

    @staticmethod
    def calls_a_tool(text: str) -> bool:
        """Whether a generated answer calls a tool (a TOOL_CALL_MARKERS marker after its reasoning)."""
        answer = text.split("</think>")[-1]
        return any(marker in answer for marker in TOOL_CALL_MARKERS)


def _candidates(text: str) -> list[dict]:
    """Assistant messages that may render as `text`, the structured forms first."""
    parts = [(None, text)]
    if "</think>" in text:  # Qwen3's template's own split of a content that holds its reasoning
        parts.insert(0, (text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n"),
                         text.split("</think>")[-1].lstrip("\n")))
    out = []
    for reasoning, content in parts:
        base = {"role": "assistant"}
        calls = _hermes_tool_calls(content)
        if calls:
            out.append({**base, "content": content[:content.index("<tool_call>")].rstrip("\n"), "tool_calls": calls,
                        **({"reasoning_content": reasoning} if reasoning is not None else {})})
        out.append({**base, "content": content, **({"reasoning_content": reasoning} if reasoning is not None else {})})
    return out


def _hermes_tool_calls(content: str) -> list[dict] | None:
    """`<tool_call>{"name", "arguments"}</tool_call>` blocks as formats.py's tool_calls; None unless every
    block parses."""
    calls = []
    for body in _HERMES_CALL.findall(content):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
            return None
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}})
    return calls or None


def _generated_end(text: str, start: int) -> int:
    end = len(text)
    while end > start and text[end - 1].isspace():  # the turn ends at its end-of-turn token
        end -= 1
    return end


def supervise(tok, messages: list[dict], tools=None, *, template_kwargs: dict | None = None,
              turns: str = DataConfig.turns) -> Supervision:
    """The training rows of one conversation (see the module docstring). Raises whatever the template
    raises (e.g. jinja2's "roles must alternate"): the caller reports it as a bad row."""
    rendering = Rendering(tok, template_kwargs)
    out = Supervision()
    spans = []  # (turn index, rendered turn text, start, end) of every trusted assistant turn
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        t = rendering.turn(messages, i, tools)
        if isinstance(t, str):
            out.skipped_turns[t] += 1
            continue
        spans.append((i, t.text, t.start, t.end))
    if not spans:
        return out
    if turns == "last":
        spans = spans[-1:]
    whole = rendering.render(messages, tools)
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
