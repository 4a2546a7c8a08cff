"""A tiny target served like Qwen3: test_data_supervision's QWEN3_STYLE chat template (thinking on unless
enable_thinking=false, reasoning dropped from earlier turns, tools and <tool_call> blocks), Qwen3's end
tokens (eos <|im_end|>; the generation_config lists <|im_end|> and <|endoftext|>, which is also the pad
token), trained for a few hundred steps until it answers in that format: a think block when thinking is on,
the answer, <|im_end|>; a <tool_call> when the system turn lists tools. The tokenizer lives in the model
directory, as a hub snapshot's does.

The trained target ships with the tests (tests/assets/thinking_target/), as the demo world's target ships
with the package: a target trained on each machine is that processor's (its float sums round otherwise, so
its weights and answers differ; on a 2-core Xeon the tool conversation's first answer ran past the context).
`shipped.json` there records what it was made from (RECIPE) and its files' sha256. Rebuild it after changing
RECIPE, the conversations or the template:

    .venv/bin/python tests/helpers_thinking.py     # trains it (~1 min), checks it, writes tests/assets/thinking_target/

`check_shipped` (test_thinking_target.py) holds the asset to its record and checks, in float64, that its
greedy answers to the test's conversations are far from a tie: then float32 on any processor picks the same.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
from helpers_data import make_tokenizer
from helpers_model import TINY_QWEN3
from test_data_supervision import QWEN3_STYLE

REASONING = "let me see"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
ADD_CALL = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
ASSET = Path(__file__).resolve().parent / "assets" / "thinking_target"
RECORD = "shipped.json"
# What the shipped target is made from: a change here (or to the template) needs a rebuild.
RECIPE = {"format": 1,
          "config": {**TINY_QWEN3, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
                     "num_hidden_layers": 4, "max_position_embeddings": 256},
          "init_seed": 0, "plain_conversations": [160, 11], "tool_conversations": [120, 12],
          # 500 steps: every test answer in its format from 300 and ended from 400, the tool call with thinking
          # off from 450 on. Seed 2: the first whose greedy answers to the test's conversations are all at least
          # MIN_MARGIN from a tie (seeds 0, 1 and 3 each had a choice within 3e-4)
          "train": {"steps": 500, "lr": 3e-3, "tokens_per_batch": 2048, "seed": 2},
          "reasoning": REASONING,
          "chat_template_sha256": hashlib.sha256(QWEN3_STYLE.encode()).hexdigest()}
MAX_NEW_TOKENS = 96          # the regeneration's cap in the tests: every prompt + 96 stays inside the 256 context
# The smallest float64 margin (top-1 logit minus top-2) a shipped greedy choice may have. float32 moves this
# target's logits (up to ~14) by at most 2e-5 from float64's (measured over the test's conversations, with
# AVX-512 kernels and with ATen's scalar ones): a choice 50x that far from a tie is the same on every processor.
MIN_MARGIN = 1e-3
# regeneration's greedy-loop rule (model/generation.py), restated from its spec for the independent walk
LOOP_MIN_SPAN, LOOP_MAX_PERIOD = 32, 64


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


def readme_conversations() -> list[tuple[str, list[dict], list | None]]:
    """(id, messages, tools) of the conversations the README test regenerates: ten plain ones, then the tool one."""
    tool, tools = tool_conversation()
    return [(f"c{i}", conv, None) for i, conv in enumerate(conversations(10, seed=5))] + [("tool", tool, tools)]


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


def build_thinking_target(root: Path) -> str:
    """Train the target of RECIPE into root/model (weights, generation_config, tokenizer with QWEN3_STYLE)."""
    from transformers import AutoTokenizer

    from dflash_ray.model.generation import train_causal_lm
    from dflash_ray.model.target import build_synthetic_target

    _, tokdir = make_tokenizer(root / "tok")
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    tok.chat_template = QWEN3_STYLE
    model = root / "model"
    build_synthetic_target(RECIPE["config"], len(tok), str(model), seed=RECIPE["init_seed"])
    tok.save_pretrained(str(model))
    plain = [(c, None) for c in conversations(*RECIPE["plain_conversations"])]
    # with tools listed, the first answer calls add
    tools = [([next(m for m in c if m["role"] == "user"), {"role": "assistant", "content": "", "tool_calls": ADD_CALL}],
              TOOLS) for c in conversations(*RECIPE["tool_conversations"])]
    train_causal_lm(str(model), _sequences(tok, plain + tools), pad_id=tok.pad_token_id, log=lambda *a: None,
                    **RECIPE["train"])
    ends = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ends, "pad_token_id": ends[1]}))
    return str(model)


def _files(root: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())
            if p.is_file() and p.name != RECORD}


def shipped_thinking_target(root: Path) -> str:
    """A copy of the shipped target in `root` (tests write nothing into the asset)."""
    shutil.copytree(ASSET, root / "model")
    return str(root / "model")


# -- the regeneration's rules, walked independently of dflash_ray.model.generation ---------------------------

def _loops_at(ids: list[int]) -> int | None:
    """The first length t at which the generated ids' tail of n = max(3p, 32) ids repeats with a period
    p <= 64 (the spec of regeneration's greedy-loop stop), or None: checked naively, prefix by prefix."""
    for t in range(1, len(ids) + 1):
        for p in range(1, LOOP_MAX_PERIOD + 1):
            n = max(3 * p, LOOP_MIN_SPAN)
            if n > t:
                break
            tail = ids[t - n:t]
            if tail[p:] == tail[:-p]:
                return t
    return None


def greedy_answer(model, tok, messages, tools, kwargs, max_new: int = MAX_NEW_TOKENS):
    """(generated ids through the first end token or the cap, ended, the smallest top-1 minus top-2 logit
    margin of the choices): one sequence, no cache, the prompt rendered here from the chat template."""
    import torch

    ends = set(model.generation_config.eos_token_id)
    prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) + max_new <= model.config.max_position_embeddings, "the context would cap the answer"
    new, margin = [], float("inf")
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1].double()
            top2 = logits.topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
            new.append(int(logits.argmax()))
            if new[-1] in ends:
                break
    return new, bool(new and new[-1] in ends), margin


def expected_regeneration(model, tok, messages, tools, kwargs, answers=None):
    """What regeneration must make of one conversation by its rules (module doc of model/generation.py), with
    the default on_max_tokens=drop: (the kept messages or None, counts by reason, the answers' ids, the smallest
    margin). `answers`: the assistant messages regeneration stored, used as the history of later turns (each turn
    is generated from the regenerated history; stored messages are checked against the generated text elsewhere);
    None: the texts generated here."""
    history, counts, generated, margin = [], Counter(), [], float("inf")
    rest = list(messages)
    while True:
        turn = next((k for k, m in enumerate(rest) if m["role"] == "assistant"), None)
        if turn is None:
            return history + rest, counts, generated, margin
        history += rest[:turn]
        rest = rest[turn + 1:]
        ids, ended, m = greedy_answer(model, tok, history, tools, kwargs)
        margin = min(margin, m)
        looped = _loops_at(ids)
        reason = ("turns dropped: a greedy loop" if looped is not None and (not ended or looped <= len(ids) - 1)
                  else None if ended else "turns dropped: hit max_new_tokens")
        if reason:
            counts[reason] += 1
            if reason.endswith("max_new_tokens"):
                counts["hit max_new_tokens"] += 1
            break
        generated.append(ids)
        k = len(generated) - 1
        text = tok.decode(ids[:-1])
        history.append(answers[k] if answers is not None and k < len(answers) else {"role": "assistant", "content": text})
        counts["regenerated turns"] += 1
        if "<tool_call>" in text.split("</think>")[-1]:
            counts["stopped at the target's first tool call"] += 1
            break
        if rest and rest[0]["role"] == "tool":
            counts["stopped before recorded tool results (the target called no tool)"] += 1
            break
    # the conversation ended early: cut after its last kept assistant turn, the rest's assistant turns counted
    counts["assistant turns not reached (the conversation ended early)"] += sum(m["role"] == "assistant" for m in rest)
    last = max((k for k, m in enumerate(history) if m["role"] == "assistant"), default=None)
    if last is None:
        counts["conversations left without an assistant turn"] += 1
        return None, counts, generated, margin
    return history[:last + 1], counts, generated, margin


def check_shipped(asset: Path = ASSET) -> dict:
    """The shipped target against its record (recipe and files), and its float64 greedy regeneration of the
    test's conversations, thinking off and on: every choice at least MIN_MARGIN from a tie, and the answers
    exercise the rules the README test checks (the tool conversation's first answer calls the tool, every
    plain turn ends). Returns the figures; raises AssertionError naming what does not hold."""
    import torch
    from transformers import AutoTokenizer

    from dflash_ray.model.target import load_target

    record = json.loads((asset / RECORD).read_text())
    assert record["recipe"] == json.loads(json.dumps(RECIPE)), (
        "the shipped thinking target was made from another recipe: rebuild it (python tests/helpers_thinking.py)")
    assert record["files"] == _files(asset), "the shipped thinking target's files are not the recorded ones"
    tok = AutoTokenizer.from_pretrained(str(asset))
    model = load_target(str(asset), device="cpu", dtype=torch.float64)
    figures = {}
    for mode, kwargs in (("thinking-off", {"enable_thinking": False}), ("thinking-on", {})):
        margin, counts = float("inf"), Counter()
        for cid, messages, tools in readme_conversations():
            kept, c, _, m = expected_regeneration(model, tok, messages, tools, kwargs)
            margin, counts = min(margin, m), counts + c
            if cid == "tool":
                assert c["stopped at the target's first tool call"] == 1, (mode, "the tool conversation", kept)
        assert margin >= MIN_MARGIN, (mode, "a greedy choice nearer a tie than", MIN_MARGIN, margin)
        plain_turns = sum(m["role"] == "assistant" for _, conv, _ in readme_conversations()[:-1] for m in conv)
        assert counts["regenerated turns"] == plain_turns + 1, (mode, "a plain turn did not end", dict(counts))
        figures[mode] = {"smallest_margin": margin, "counts": dict(counts)}
    return figures


def main() -> int:
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="thinking-target-"))
    model = Path(build_thinking_target(work))
    for p in model.iterdir():   # the trainer's marker stays out: the record says what the target was made from
        if p.name.startswith("dflash_demo_training"):
            training = json.loads(p.read_text())
            p.unlink()
    tmp = ASSET.with_name(ASSET.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp)
    (tmp / RECORD).write_text(json.dumps({"recipe": RECIPE, "training": training, "files": _files(tmp)}, indent=1) + "\n")
    figures = check_shipped(tmp)
    record = json.loads((tmp / RECORD).read_text())
    (tmp / RECORD).write_text(json.dumps({**record, "float64_regeneration": figures}, indent=1) + "\n")
    shutil.rmtree(ASSET, ignore_errors=True)
    tmp.replace(ASSET)
    print(json.dumps(figures, indent=1))
    print(f"shipped -> {ASSET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
