"""Regeneration: every assistant turn replaced by the target's own greedy answer, turn by turn on the
regenerated history; failures counted by reason. The expected answers come from an independent greedy
loop (`model.evaluate.greedy_generate`, one sequence, no padding, no cache sharing), not from the
batched `generate` the regenerator uses. Then the Ray Data job: the same output, resumable, with a bad
line counted."""
from __future__ import annotations

import json

import pytest
import torch
from helpers_data import make_tokenizer, write_jsonl
from helpers_model import TINY_QWEN3

from dflash_ray.tokenizer import load_tokenizer
from dflash_ray.model.evaluate import greedy_generate
from dflash_ray.model.generation import TRAINED_MARKER, Regenerator, train_causal_lm
from dflash_ray.model.target import build_synthetic_target, load_target

CONVS = [
    [{"role": "user", "content": "Recite the words from alpha for 5 words."},
     {"role": "assistant", "content": "alpha beta gamma delta epsilon"},
     {"role": "user", "content": "Repeat red blue 3 times."},
     {"role": "assistant", "content": "red blue red blue red blue"}],
    [{"role": "system", "content": "You are a precise assistant."},
     {"role": "user", "content": "Recite the words backwards from nu for 4 words."},
     {"role": "assistant", "content": "nu mu lambda kappa"}],
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    _, tokdir = make_tokenizer(root)
    tok = load_tokenizer(str(tokdir))
    target = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 2, "max_position_embeddings": 128},
                                    len(tok), str(root / "target"), seed=1)
    return root, str(tokdir), target, tok


def expected_regeneration(conv, tok, target_dir, max_new):
    """Turn by turn with a plain greedy loop: what the regenerated conversation must be."""
    model = load_target(target_dir)
    history = []
    for m in conv:
        if m["role"] != "assistant":
            history.append(m)
            continue
        prompt = tok.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False)
        out = greedy_generate(model, torch.tensor([prompt]), max_new)[0, len(prompt):].tolist()
        if tok.eos_token_id in out:
            out = out[:out.index(tok.eos_token_id)]
        history.append({"role": "assistant", "content": tok.decode(out)})
    return history


def test_regenerated_turns_equal_a_plain_greedy_loop_on_the_regenerated_history(world):
    root, tokdir, target, tok = world
    regen = Regenerator(target, tokdir, max_new_tokens=12, batch_size=2)
    out, counts = regen(CONVS)
    for got, conv in zip(out, CONVS):
        assert [m["role"] for m in got] == [m["role"] for m in conv]
        assert [m["content"] for m in got if m["role"] != "assistant"] == \
               [m["content"] for m in conv if m["role"] != "assistant"]
        assert got == expected_regeneration(conv, tok, target, 12)
    assert counts["regenerated turns"] == 3
    # a random target rarely says end-of-turn within 12 tokens: those turns are counted, and kept
    assert 0 <= counts["hit max_new_tokens"] <= 3


def test_failures_are_counted_by_reason_and_the_rest_goes_on(world):
    root, tokdir, target, tok = world
    too_long = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "x"}]
    bad = [[], [{"role": "user", "content": "no answer wanted"}], [{"role": "assistant", "content": None}],
           "not a list", too_long]
    out, counts = Regenerator(target, tokdir, max_new_tokens=4, batch_size=8)(CONVS[:1] + bad)
    assert out[0] is not None and all(o is None for o in out[1:])
    assert counts["empty or malformed conversation"] == 4
    assert counts["prompt longer than the target's context"] == 1     # max_position_embeddings 128
    assert counts["regenerated turns"] == 2


def test_train_causal_lm_lowers_the_loss_and_runs_once(world, tmp_path):
    root, tokdir, _, tok = world
    target = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 1}, len(tok), str(tmp_path / "t"), seed=0)
    seqs = [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in CONVS] * 4
    figures = train_causal_lm(target, seqs, steps=100, tokens_per_batch=256, pad_id=tok.pad_token_id)
    assert figures["final_loss"] < 0.5 * figures["first_loss"]
    assert (tmp_path / "t" / TRAINED_MARKER).exists()
    weights = (tmp_path / "t" / "model.safetensors").read_bytes()
    assert train_causal_lm(target, seqs, steps=100) == figures                      # cached: not trained again
    assert (tmp_path / "t" / "model.safetensors").read_bytes() == weights


def test_regenerate_job_on_ray_is_resumable_and_counts_bad_lines(world, ray_session, tmp_path):
    from types import SimpleNamespace

    from dflash_ray.runtime.jobs.regenerate import regenerate

    root, tokdir, target, tok = world
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "conversations": CONVS[0]}, "{not json",
                                              {"id": "b", "conversations": CONVS[1]},
                                              {"id": "c", "conversations": []}])
    out = tmp_path / "out.jsonl"
    cluster = SimpleNamespace(use_gpu=False, target_resource="target_slot", target_workers=1)
    counts = regenerate(str(src), str(out), target_dir=target, tokenizer_dir=tokdir, cluster=cluster,
                        max_new_tokens=12, batch_size=2, log=lambda *a: None)
    assert counts["written"] == 2 and counts["bad row: malformed_json"] == 1
    assert counts["bad row: empty_conversation"] == 1 and counts["regenerated turns"] == 3
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"0", "2"}                     # the conversations' ids: their rows in the input
    assert rows["0"]["conversations"] == expected_regeneration(CONVS[0], tok, target, 12)
    again = regenerate(str(src), str(out), target_dir=target, tokenizer_dir=tokdir, cluster=cluster,
                       max_new_tokens=12, batch_size=2, log=lambda *a: None)
    assert again["skipped: already in the output"] == 2 and again.get("written", 0) == 0
    assert len(out.read_text().splitlines()) == 2


def test_regenerate_command_names_what_is_missing_and_writes_the_output(world, ray_session, tmp_path, capsys):
    from dflash_ray.cli import main

    root, tokdir, target, tok = world
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "conversations": CONVS[1]}])
    assert main(["regenerate", f"data.input={src}", f"data.tokenizer={tokdir}", f"model.target_path={target}"]) == 2
    assert "config key 'regenerate.output' must be set" in capsys.readouterr().err
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", "--json", f"data.input={src}", f"data.tokenizer={tokdir}",
                 f"model.target_path={target}", f"regenerate.output={out}", "regenerate.max_new_tokens=6"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 1
    [row] = map(json.loads, out.read_text().splitlines())
    assert row["conversations"] == expected_regeneration(CONVS[1], tok, target, 6)
