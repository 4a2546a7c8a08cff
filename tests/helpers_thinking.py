"""A tiny target served like Qwen3: test_data_supervision's QWEN3_STYLE chat template (thinking on unless
enable_thinking=false, reasoning dropped from earlier turns, tools and <tool_call> blocks), Qwen3's end
tokens (eos <|im_end|>; the generation_config lists <|im_end|> and <|endoftext|>, which is also the pad
token), trained for a few hundred steps until it answers in that format: a think block when thinking is on,
the answer, <|im_end|>; a <tool_call> when the system turn lists tools. The tokenizer lives in the model
directory, as a hub snapshot's does."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from helpers_data import make_tokenizer
from helpers_model import TINY_QWEN3
from test_data_supervision import QWEN3_STYLE

REASONING = "let me see"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
ADD_CALL = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]


def conversations(n: int, seed: int) -> list[list[dict]]:
    """Short conversations of the synthetic tasks (1 or 2 user turns, a system prompt in some)."""
    from dflash_ray.data.synthetic import _task

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": "You are a precise assistant."}] if rng.random() < 0.3 else []
        for _ in range(1 if rng.random() < 0.5 else 2):
            user, answer = _task(rng, int(rng.integers(3, 7)))
            conv += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        out.append(conv)
    return out


def tool_conversation() -> tuple[list[dict], list]:
    """A recorded conversation with a tool call, its result, the answer and another user turn."""
    return ([{"role": "user", "content": "Add 2 and 3."},
             {"role": "assistant", "content": "", "tool_calls": ADD_CALL},
             {"role": "tool", "content": "5"},
             {"role": "assistant", "content": "5"},
             {"role": "user", "content": "Repeat red blue 2 times."},
             {"role": "assistant", "content": "red blue red blue"}], TOOLS)


def _sequences(tok, convs) -> list[list[int]]:
    """Every assistant turn as served, with thinking on (a think block) and off (an empty one in the prompt)."""
    seqs = []
    for conv, tools in convs:
        for i, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            # thinking off renders a finished turn as an empty think block would: thinking on has to be the
            # likelier continuation of an open "<think>\n" for the target to think when it is on
            for kwargs, reasoning in [({}, REASONING)] * 3 + [({"enable_thinking": False}, None)]:
                turn = dict(m, **({"reasoning_content": reasoning} if reasoning else {}))
                seqs.append(tok.apply_chat_template(conv[:i] + [turn], tools=tools, tokenize=True,
                                                    return_dict=False, **kwargs))
    return seqs


def build_thinking_target(root: Path, steps: int = 600) -> str:
    """The model directory (weights, generation_config, tokenizer with QWEN3_STYLE)."""
    from transformers import AutoTokenizer

    from dflash_ray.model.generation import train_causal_lm
    from dflash_ray.model.target import build_synthetic_target

    _, tokdir = make_tokenizer(root / "tok")
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    tok.chat_template = QWEN3_STYLE
    model = root / "model"
    build_synthetic_target({**TINY_QWEN3, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
                            "num_hidden_layers": 4, "max_position_embeddings": 256}, len(tok), str(model), seed=0)
    tok.save_pretrained(str(model))
    plain = [(c, None) for c in conversations(160, seed=11)]
    # with tools listed, the first answer calls add
    tools = [([next(m for m in c if m["role"] == "user"), {"role": "assistant", "content": "", "tool_calls": ADD_CALL}],
              TOOLS) for c in conversations(120, seed=12)]
    train_causal_lm(str(model), _sequences(tok, plain + tools), steps=steps, lr=3e-3, tokens_per_batch=2048,
                    pad_id=tok.pad_token_id, seed=0, log=lambda *a: None)
    ends = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ends, "pad_token_id": ends[1]}))
    return str(model)
