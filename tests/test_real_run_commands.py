"""README's "A real run", steps 1 to 3 as the README writes them (read from its bash block), on a tiny
target served like Qwen3 (helpers_thinking: a thinking chat template, Qwen3's end tokens), with thinking
off (the README's $TEMPLATE) and on: every assistant turn `regenerate` writes is supervised by `prepare`,
and supervised as exactly what the target generates for that turn's prompt (found here by an independent
greedy loop, `model.evaluate.greedy_generate`, on the prompt the test renders itself). Nothing regenerated
is lost or left out as untrusted between the steps. A conversation with a tool call stops after the
target's own first tool call, counted. Step 3's plan holds every prepared sample once. (Step 4, the
training job, is the main job the runtime tests train; it is not run again on these shards here.)"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_data import write_jsonl
from helpers_thinking import build_thinking_target, conversations, tool_conversation

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = pytest.mark.slow
THINKING_ON = "data.chat_template_kwargs={enable_thinking: true}"
# The thinking target's training steps (helpers_thinking's default: 600). Measured (greedy answers of this
# file's conversations, thinking off and on, at 300, 350, ... 600 steps): every answer in its format from
# 300 steps and ended from 400, the tool call with thinking off from 450 on; 500 keeps a margin and saves
# a sixth of 600's time.
TARGET_STEPS = 500


def readme_commands() -> tuple[dict, dict]:
    """(shell variables, {command: its arguments}) of the bash block of README's "A real run"."""
    section = README.read_text()[README.read_text().index("### A real run"):]
    start = section.index("```bash") + len("```bash")
    block = section[start:section.index("```", start)].replace("\\\n", " ")
    env, commands = {}, {}
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 1 and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
            name, value = words[0].split("=", 1)
            env[name] = value
        elif words and words[0].endswith("dflash-ray"):
            commands[words[1]] = [env[w[1:]] if w.startswith("$") else w for w in words[2:]]
    return env, commands


def local(args: list[str], root: Path, model: str, template: str) -> list[str]:
    """The README's arguments on this machine: the tiny target for Qwen/Qwen3-8B, files under `root` for
    /data, the CPU cluster, and the thinking mode of this run."""
    out = []
    for a in args:
        a = a.replace("Qwen/Qwen3-8B", model).replace("/data/", f"{root}/")
        if a.startswith("data.chat_template_kwargs="):
            a = template
        out.append("cluster=local" if a.startswith("cluster=") else a)
    # the tiny target's answers are short: two blocks of 2 tokens. fp32: on a processor that computes bf16 fast the
    # run would choose bf16 (dflash_ray/processor.py), whose batched decoding rounds apart from the one-sequence
    # greedy loop this test compares with token for token
    return out + ["model.block_size=2", "model.compute_dtype=float32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_thinking_target(tmp_path_factory.mktemp("thinking"), steps=TARGET_STEPS)


def sharegpt_rows() -> list[dict]:
    rows = []
    for i, conv in enumerate(conversations(10, seed=5)):
        system = [m["content"] for m in conv if m["role"] == "system"]
        rows.append({"id": f"c{i}", "conversations": [{"from": "human" if m["role"] == "user" else "gpt",
                                                       "value": m["content"]} for m in conv if m["role"] != "system"],
                     **({"system": system[0]} if system else {})})
    messages, tools = tool_conversation()
    rows.append({"id": "tool", "messages": messages, "tools": tools})
    return rows


def supervised_runs(tok, row) -> list[str]:
    mask = np.asarray(row["loss_mask"], bool)
    idx = np.flatnonzero(mask)
    runs = np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1) if idx.size else []
    return [tok.decode(np.asarray(row["input_ids"])[r]) for r in runs]


def served_answer(tok, target, messages, tools, kwargs) -> str:
    """What the target generates after `messages` when served: the prompt rendered here, greedy, up to
    and including the first end token its generation_config declares."""
    from dflash_ray.model.evaluate import greedy_generate

    ends = list(target.generation_config.eos_token_id)
    prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    new = greedy_generate(target, torch.tensor([ids]), 256 - len(ids) - 1, stop_token_ids=ends)[0, len(ids):].tolist()
    assert new[-1] in ends, "a kept turn must have ended"
    return tok.decode(new)


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_readme_steps_1_and_2_supervise_every_regenerated_turn_as_generated(model, thinking, ray_session,
                                                                             tmp_path, capsys):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from dflash_ray.cli import main
    from dflash_ray.data.shards import list_shards
    from dflash_ray.model.target import load_target

    env, commands = readme_commands()
    regenerate_args, prepare_args = commands["regenerate"], commands["prepare"]
    # the README renders both steps with the same template arguments, thinking off
    template = [a for a in regenerate_args if a.startswith("data.chat_template_kwargs=")]
    assert template == [a for a in prepare_args if a.startswith("data.chat_template_kwargs=")] == \
        ["data.chat_template_kwargs={enable_thinking:false}"]
    template = THINKING_ON if thinking else template[0]
    kwargs = {} if thinking else {"enable_thinking": False}

    write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt_rows())
    assert main(["regenerate", "--json"] + local(regenerate_args, tmp_path, model, template)) == 0
    counts = json.loads(capsys.readouterr().out)
    assert main(["prepare", "--json"] + local(prepare_args, tmp_path, model, template)) == 0
    summary = json.loads(capsys.readouterr().out)

    regenerated = [json.loads(line) for line in (tmp_path / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in regenerated) == sorted(r["id"] for r in sharegpt_rows())   # ids pass through
    turns = sum(m["role"] == "assistant" for r in regenerated for m in r["conversations"])
    source_turns = sum(m["from"] == "gpt" for r in sharegpt_rows()[:10] for m in r["conversations"])
    assert counts["regenerated turns"] == turns >= 0.8 * (source_turns + 1), counts   # most answers end in time
    # the tool conversation: the target's own first answer calls the tool; the rest is left out, counted
    tool = next(r for r in regenerated if r["id"] == "tool")
    assert [m["role"] for m in tool["conversations"]] == ["user", "assistant"]
    assert counts["stopped at the target's first tool call"] == 1
    assert counts["assistant turns not reached (the conversation ended early)"] == 2
    call = tool["conversations"][1]
    assert "tool_calls" in call or "<tool_call>" in call["content"]

    # step 2 leaves nothing out: no untrusted turn, no conversation without a trusted turn, none too short
    assert summary["untrusted_turns"] == {} and summary["dropped"] == {} and summary["bad_rows"]["bad_rows"] == 0
    assert summary["conversations"] == len(regenerated)
    tok = AutoTokenizer.from_pretrained(model)
    target = load_target(model)
    rows = sorted((r for shard in list_shards(tmp_path / "shards") for r in pq.read_table(shard).to_pylist()),
                  key=lambda r: r["sample_id"])
    for cid, conv in enumerate(regenerated):          # prepare's conversation id: the line of the file
        got = [t for r in rows if r["sample_id"] // 1024 == cid for t in supervised_runs(tok, r)]
        messages = conv["conversations"]
        want = [served_answer(tok, target, messages[:i], conv.get("tools"), kwargs)
                for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert got == want, (conv["id"], got, want)
        if thinking and conv["id"] != "tool":
            assert all(w.startswith("<think>\n") and "</think>\n\n" in w for w in want)
        elif not thinking:
            assert not any("<think>" in w for w in want)
    assert sum(len(supervised_runs(tok, r)) for r in rows) == turns

    # step 3, as the README writes it (on this machine's cluster): the plan holds every prepared sample once
    if not thinking:
        dump = tmp_path / "plan.parquet"
        assert main(["plan", "--json", f"--dump={dump}"] + local(commands["plan"], tmp_path, model, template)) == 0
        capsys.readouterr()
        planned = [i for ids in pq.read_table(dump).column("sample_ids").to_pylist() for i in ids]
        assert sorted(planned) == sorted(r["sample_id"] for r in rows)
