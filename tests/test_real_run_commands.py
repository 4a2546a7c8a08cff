"""README's "Your model, your data", steps 1 to 3 as the README writes them (read from its bash block), on a tiny
target served like Qwen3 (helpers_thinking: a thinking chat template, Qwen3's end tokens; trained once and
shipped in tests/assets/), with thinking off (the README's $TEMPLATE) and on. What `regenerate` writes is
checked against the regeneration's rules walked independently (helpers_thinking.expected_regeneration: each
turn the target's greedy answer, found by a one-sequence float64 loop on the prompt the test renders itself;
a turn that does not end, loops or calls a tool ends its conversation, counted), whichever way the target
answers; every kept turn is supervised by `prepare` as exactly what the target generated, its end token
included; nothing regenerated is lost or left out as untrusted between the steps. Step 3's plan holds every
prepared sample once. (Step 4, the training job, is the main job the runtime tests train; it is not run
again on these shards here.)

The shipped target's answers to these conversations are far from any tie (test_thinking_target), so float32
on any processor answers as float64 does; they call the tool, think when thinking is on and end in time, so
every rule checked here is exercised."""
from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_data import write_jsonl
from helpers_thinking import MAX_NEW_TOKENS, expected_regeneration, readme_conversations, shipped_thinking_target

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = [pytest.mark.slow, pytest.mark.rounding]
THINKING_ON = "data.chat_template_kwargs={enable_thinking: true}"
# the reasons regeneration counts that the rules walked here can give (model/generation.py)
REASONS = ("regenerated turns", "hit max_new_tokens", "turns dropped: hit max_new_tokens", "turns dropped: a greedy loop",
           "stopped at the target's first tool call", "stopped before recorded tool results (the target called no tool)",
           "assistant turns not reached (the conversation ended early)", "conversations left without an assistant turn")


def readme_commands() -> tuple[dict, dict]:
    """(shell variables, {command: its arguments}) of the bash block of README's "Your model, your data"."""
    section = README.read_text()[README.read_text().index("## Your model, your data"):]
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
    /data, the CPU cluster and its engine, and the thinking mode of this run."""
    out = []
    for a in args:
        a = a.replace("Qwen/Qwen3-8B", model).replace("/data/", f"{root}/")
        if a.startswith("data.chat_template_kwargs="):
            a = template
        if a in ("regenerate.engine=vllm", "regenerate.engine=sglang"):   # GPU engines; every engine keeps
            a = "regenerate.engine=batched"                               # the same rules (test_regenerate_engines)
        out.append("cluster=local" if a.startswith("cluster=") else a)
    # the tiny target's answers are short: two blocks of 2 tokens; its context 256 holds every prompt and a
    # turn at the cap. fp32: on a processor that computes bf16 fast the run would choose bf16
    # (dflash_ray/processor.py), whose rounding is far coarser than the shipped answers' margins
    return out + ["model.block_size=2", "model.compute_dtype=float32", f"regenerate.max_new_tokens={MAX_NEW_TOKENS}"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return shipped_thinking_target(tmp_path_factory.mktemp("thinking"))


def sharegpt_rows() -> list[dict]:
    """The README test's conversations as a user's file holds them: ShareGPT rows, the tool one as OpenAI messages."""
    rows = []
    for cid, conv, tools in readme_conversations():
        if tools:
            rows.append({"id": cid, "messages": conv, "tools": tools})
            continue
        system = [m["content"] for m in conv if m["role"] == "system"]
        rows.append({"id": cid, "conversations": [{"from": "human" if m["role"] == "user" else "gpt",
                                                   "value": m["content"]} for m in conv if m["role"] != "system"],
                     **({"system": system[0]} if system else {})})
    return rows


def supervised_runs(tok, row) -> list[str]:
    mask = np.asarray(row["loss_mask"], bool)
    idx = np.flatnonzero(mask)
    runs = np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1) if idx.size else []
    return [tok.decode(np.asarray(row["input_ids"])[r]) for r in runs]


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
    by_id = {r["id"]: (line, r) for line, r in enumerate(regenerated)}   # prepare's conversation id: the line
    assert len(by_id) == len(regenerated) and set(by_id) <= {r["id"] for r in sharegpt_rows()}   # ids pass through
    # step 2 leaves nothing out: no untrusted turn, no conversation without a trusted turn, none too short
    assert summary["untrusted_turns"] == {} and summary["dropped"] == {} and summary["bad_rows"]["bad_rows"] == 0
    assert summary["conversations"] == len(regenerated)
    tok = AutoTokenizer.from_pretrained(model)
    target = load_target(model, device="cpu", dtype=torch.float64)
    rows = sorted((r for shard in list_shards(tmp_path / "shards") for r in pq.read_table(shard).to_pylist()),
                  key=lambda r: r["sample_id"])
    want_counts, supervised = Counter(), 0
    for cid, messages, tools in readme_conversations():
        line, stored = by_id.get(cid, (None, None))
        answers = [m for m in stored["conversations"] if m["role"] == "assistant"] if stored else None
        kept, counts_here, generated, _ = expected_regeneration(target, tok, messages, tools, kwargs, answers)
        want_counts += counts_here
        if kept is None:                                 # left without an assistant turn: not written
            assert stored is None, (cid, stored)
            continue
        assert stored is not None, (cid, "missing from the output", kept)
        assert [m["role"] for m in stored["conversations"]] == [m["role"] for m in kept], cid
        assert [m["content"] for m in stored["conversations"] if m["role"] != "assistant"] == \
               [m["content"] for m in kept if m["role"] != "assistant"], cid
        # each kept turn supervised as exactly the ids the target generated, its end token included
        got = [t for r in rows if r["sample_id"] // 1024 == line for t in supervised_runs(tok, r)]
        want = [tok.decode(ids) for ids in generated]
        assert got == want, (cid, got, want)
        supervised += len(want)
        if thinking and not tools:
            assert all(w.startswith("<think>\n") and "</think>\n\n" in w for w in want), want
        elif not thinking:
            assert not any("<think>" in w for w in want), want
    assert {k: counts.get(k, 0) for k in REASONS} == {k: want_counts.get(k, 0) for k in REASONS}, counts
    assert sum(len(supervised_runs(tok, r)) for r in rows) == supervised == counts["regenerated turns"]

    # step 3, as the README writes it (on this machine's cluster): the plan holds every prepared sample once
    if not thinking:
        dump = tmp_path / "plan.parquet"
        assert main(["plan", "--json", f"--dump={dump}"] + local(commands["plan"], tmp_path, model, template)) == 0
        capsys.readouterr()
        planned = [i for ids in pq.read_table(dump).column("sample_ids").to_pylist() for i in ids]
        assert sorted(planned) == sorted(r["sample_id"] for r in rows)
