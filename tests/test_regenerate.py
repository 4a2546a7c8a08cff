"""Regeneration: every assistant turn replaced by the target's own greedy answer, turn by turn on the
regenerated history; failures counted by reason; a turn that hits the cap dropped (default) or kept;
every end token the model declares stops a turn; the text decoded from exactly the generated ids. The
expected answers come from an independent greedy loop (`model.evaluate.greedy_generate`, one sequence, no
padding, no cache sharing), not from the batched `generate` the regenerator uses. Then the Ray Data job:
the same output, ids and fields passed through, resumable (after rows were inserted, after a torn last
line), with bad lines counted; and the size of its actor pool."""
from __future__ import annotations

import json

import pytest
import torch
from helpers_data import make_tokenizer, write_jsonl
from helpers_model import TINY_QWEN3

from dflash_ray.data.supervision import Rendering
from dflash_ray.tokenizer import load_tokenizer
from dflash_ray.model.evaluate import greedy_generate
from dflash_ray.model.generation import TRAINED_MARKER, Regenerator, train_causal_lm
from dflash_ray.model.target import build_synthetic_target, load_target

pytestmark = pytest.mark.rounding

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


def expected_regeneration(conv, tok, target_dir, max_new, ends=None):
    """Turn by turn with a plain greedy loop: what the regenerated conversation must be (turns that hit
    max_new kept)."""
    model = load_target(target_dir)
    ends = ends or [tok.eos_token_id]
    history = []
    for m in conv:
        if m["role"] != "assistant":
            history.append(m)
            continue
        prompt = tok.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False)
        out = greedy_generate(model, torch.tensor([prompt]), max_new)[0, len(prompt):].tolist()
        stop = next((k for k, t in enumerate(out) if t in ends), len(out))
        history.append({"role": "assistant", "content": tok.decode(out[:stop])})
    return history


def greedy_tokens(tok, target_dir, messages, n):
    prompt = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    return greedy_generate(load_target(target_dir), torch.tensor([prompt]), n)[0, len(prompt):].tolist()


@pytest.mark.parametrize("engine", ["batched", "continuous"])
def test_regenerated_turns_equal_a_plain_greedy_loop_on_the_regenerated_history(world, engine):
    root, tokdir, target, tok = world
    regen = Regenerator(target, Rendering(tok), max_new_tokens=12, batch_size=2, on_max_tokens="keep", engine=engine)
    out, counts = regen(CONVS)
    for got, conv in zip(out, CONVS):
        assert [m["role"] for m in got] == [m["role"] for m in conv]
        assert [m["content"] for m in got if m["role"] != "assistant"] == \
               [m["content"] for m in conv if m["role"] != "assistant"]
        assert got == expected_regeneration(conv, tok, target, 12)
    assert counts["regenerated turns"] == 3
    # a random target rarely says end-of-turn within 12 tokens: those turns are counted, and kept
    assert counts["hit max_new_tokens"] == counts["turns kept without an end token: hit max_new_tokens"]
    # the tokens generated: each turn's greedy ids through its end token, or the cap's 12
    generated = 0
    for conv, got in zip(CONVS, out):
        for k, m in enumerate(got):
            if m["role"] == "assistant":
                ids = greedy_tokens(tok, target, got[:k], 12)
                generated += ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else 12
    assert counts["generated tokens"] == generated


def test_a_turn_that_hits_the_cap_is_dropped_with_the_rest_of_its_conversation_counted(world):
    root, tokdir, target, tok = world
    first_answers = [greedy_tokens(tok, target, c[:c.index(next(m for m in c if m["role"] == "assistant"))], 4)
                     for c in CONVS]
    assert not any(tok.eos_token_id in a for a in first_answers)   # by the greedy loop: none ends within 4
    out, counts = Regenerator(target, Rendering(tok), max_new_tokens=4, batch_size=2)(CONVS)
    assert out == [None, None]
    assert counts["hit max_new_tokens"] == counts["turns dropped: hit max_new_tokens"] == 2
    assert counts["assistant turns not reached (the conversation ended early)"] == 1    # CONVS[0]'s second
    assert counts["conversations left without an assistant turn"] == 2 and counts["regenerated turns"] == 0


def test_failures_are_counted_by_reason_and_the_rest_goes_on(world):
    root, tokdir, target, tok = world
    too_long = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "x"}]
    bad = [[], [{"role": "user", "content": "no answer wanted"}], [{"role": "assistant", "content": None}],
           "not a list", too_long]
    out, counts = Regenerator(target, Rendering(tok), max_new_tokens=4, batch_size=8,
                              on_max_tokens="keep")(CONVS[:1] + bad)
    assert out[0] is not None and all(o is None for o in out[1:])
    assert counts["empty or malformed conversation"] == 4
    assert counts["prompt longer than the target's context"] == 1     # max_position_embeddings 128
    assert counts["regenerated turns"] == 2


def test_every_end_token_the_model_declares_stops_a_turn(world, tmp_path):
    """generation_config's eos (a list, as Qwen3's) ends a turn as the tokenizer's eos does: the answer is
    the tokens before it, the turn is not capped."""
    import shutil

    root, tokdir, target, tok = world
    conv = CONVS[1]
    greedy = greedy_tokens(tok, target, conv[:2], 12)
    k = next(k for k in range(2, 12) if greedy[k] not in greedy[:k])          # a token first seen at k >= 2
    assert tok.eos_token_id not in greedy[:k]
    declared = tmp_path / "target"
    shutil.copytree(target, declared)
    (declared / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, greedy[k]]}))
    out, counts = Regenerator(str(declared), Rendering(tok), max_new_tokens=12, batch_size=2)([conv])
    assert out[0][2] == {"role": "assistant", "content": tok.decode(greedy[:k])}
    assert counts["regenerated turns"] == 1 and counts["hit max_new_tokens"] == 0


def test_an_unfinished_answer_is_decoded_from_exactly_the_generated_ids(world, tmp_path):
    """A pad token may be a real token (Qwen3 pads with <|endoftext|>, one of its end tokens): nothing is
    stripped from what the target generated."""
    from transformers import AutoTokenizer

    root, tokdir, target, tok = world
    conv = CONVS[1]
    greedy = greedy_tokens(tok, target, conv[:2], 6)
    assert tok.eos_token_id not in greedy
    padded = AutoTokenizer.from_pretrained(tokdir)
    padded.pad_token = padded.convert_ids_to_tokens(greedy[1])               # a token the target generates
    padded.save_pretrained(str(tmp_path / "tok"))
    ptok = load_tokenizer(str(tmp_path / "tok"))
    assert ptok.pad_token_id == greedy[1]
    out, counts = Regenerator(target, Rendering(ptok), max_new_tokens=6, batch_size=2, on_max_tokens="keep")([conv])
    assert out[0][2]["content"] == ptok.decode(greedy) and counts["hit max_new_tokens"] == 1


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


def _cpu():
    from types import SimpleNamespace

    return SimpleNamespace(use_gpu=False, target_resource="target_slot", target_workers=1)


def _run(src, out, world, **kw):
    from dflash_ray.runtime.jobs.regenerate import regenerate

    root, tokdir, target, tok = world
    return regenerate(str(src), str(out), target_dir=target, tokenizer_dir=tokdir, cluster=_cpu(),
                      max_new_tokens=12, batch_size=2, on_max_tokens="keep", log=lambda *a: None, **kw)


def _rows(out):
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.slow   # a Ray Data regeneration job
def test_regenerate_job_on_ray_keeps_ids_and_fields_is_resumable_and_counts_bad_lines(world, ray_session, tmp_path):
    root, tokdir, target, tok = world
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "source": "forum", "conversations": CONVS[0]},
                                              "{not json",
                                              {"id": "b", "conversations": CONVS[1]},
                                              {"id": "c", "conversations": []},
                                              {"id": "a", "conversations": CONVS[1]}])
    out = tmp_path / "out.jsonl"
    counts = _run(src, out, world)
    assert counts["written"] == 2 and counts["bad row: malformed_json"] == 1 and counts["bad row: duplicate_id"] == 1
    assert counts["bad row: empty_conversation"] == 1 and counts["regenerated turns"] == 3
    rows = _rows(out)
    assert list(rows) == ["a", "b"]                                 # the input's own ids, in its order
    assert rows["a"] == {"id": "a", "source": "forum", "conversations": expected_regeneration(CONVS[0], tok, target, 12)}
    again = _run(src, out, world)
    assert again["skipped: already in the output"] == 2 and again.get("written", 0) == 0
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.slow   # a Ray Data regeneration job
def test_a_resume_repairs_a_torn_last_line_and_keys_on_ids_after_rows_were_inserted(world, ray_session, tmp_path):
    """Rows without ids get their content's fingerprint: a row inserted before them does not shift them.
    A run killed mid-write leaves half a line: the rerun cuts it off and redoes that conversation."""
    root, tokdir, target, tok = world
    convs = [CONVS[0], CONVS[1], [{"role": "user", "content": "Repeat red blue 3 times."},
                                  {"role": "assistant", "content": "red blue red blue red blue"}]]
    out = tmp_path / "out.jsonl"
    first = _run(write_jsonl(tmp_path / "in.jsonl", [{"conversations": c} for c in convs[:2]]), out, world)
    assert first["written"] == 2
    whole = out.read_bytes()
    last = whole.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    out.write_bytes(whole[:len(whole) - len(last) // 2 - 1])                  # killed halfway through the last line
    src = write_jsonl(tmp_path / "in.jsonl", [{"conversations": c} for c in [convs[2]] + convs[:2]])  # one inserted
    again = _run(src, out, world)
    assert again["torn last line cut off (its conversation redone)"] == 1
    assert again["skipped: already in the output"] == 1 and again["written"] == 2
    lines = out.read_text().splitlines()
    rows = [json.loads(line) for line in lines]                               # every line whole JSON again
    assert len(rows) == 3 and len({r["id"] for r in rows}) == 3
    assert sorted(json.dumps(r["conversations"]) for r in rows) == \
        sorted(json.dumps(expected_regeneration(c, tok, target, 12)) for c in convs)
    assert _run(src, out, world)["skipped: already in the output"] == 3


def test_regeneration_uses_every_gpu_of_the_cluster(monkeypatch):
    """On GPUs one actor per target_gpus share of every GPU (Ray's count, else the configured split's);
    on CPUs one per cluster.cpu_threads.regenerate threads of the machine's cores."""
    from types import SimpleNamespace

    from dflash_ray.runtime.jobs import regenerate
    from dflash_ray.runtime.jobs.regenerate import actor_pool_size

    def cluster(**kw):
        base = dict(use_gpu=True, target_workers=6, drafter_workers=2, target_gpus=1.0, drafter_gpus=1.0)
        return SimpleNamespace(**{**base, **kw})

    assert actor_pool_size(cluster()) == 8                                   # cluster=8gpu: 6 + 2 GPUs
    assert actor_pool_size(cluster(), cluster_gpus=8.0) == 8
    assert actor_pool_size(cluster(target_workers=12, drafter_workers=4), cluster_gpus=16.0) == 16  # multinode
    assert actor_pool_size(cluster(target_workers=1, drafter_workers=1, target_gpus=0.5, drafter_gpus=0.5),
                           cluster_gpus=1.0) == 2                            # cluster=1gpu: two halves of one
    monkeypatch.setattr(regenerate, "usable_cores", lambda: 4)
    assert actor_pool_size(cluster(use_gpu=False, target_workers=3)) == 4              # a thread each
    assert actor_pool_size(cluster(use_gpu=False, cpu_threads={"regenerate": 2})) == 2
    assert actor_pool_size(cluster(use_gpu=False, cpu_threads={"regenerate": 8})) == 1


@pytest.mark.slow   # a Ray Data regeneration job
def test_regenerate_command_names_what_is_missing_and_writes_the_output(world, ray_session, tmp_path, capsys):
    from dflash_ray.cli import main

    root, tokdir, target, tok = world
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "conversations": CONVS[1]}])
    assert main(["regenerate", f"data.input={src}", f"data.tokenizer={tokdir}", f"model.target_path={target}"]) == 2
    assert "config key 'regenerate.output' must be set" in capsys.readouterr().err
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", "--json", f"data.input={src}", f"data.tokenizer={tokdir}",
                 f"model.target_path={target}", f"regenerate.output={out}", "regenerate.max_new_tokens=6",
                 "regenerate.on_max_tokens=keep", "regenerate.engine=continuous"]) == 0   # through the job to the engine
    assert json.loads(capsys.readouterr().out)["written"] == 1
    [row] = map(json.loads, out.read_text().splitlines())
    assert row["conversations"] == expected_regeneration(CONVS[1], tok, target, 6)
    assert main(["regenerate", f"data.input={src}", f"data.tokenizer={tokdir}", f"model.target_path={target}",
                 f"regenerate.output={out}", "regenerate.on_max_tokens=cut"]) == 2
    assert "regenerate.on_max_tokens" in capsys.readouterr().err
    assert main(["regenerate", f"data.input={src}", f"data.tokenizer={tokdir}", f"model.target_path={target}",
                 f"regenerate.output={out}", "regenerate.engine=tgi"]) == 2
    assert "config key 'regenerate.engine': 'tgi' is not one of batched, continuous, http, vllm, sglang" in \
        capsys.readouterr().err
    assert main(["regenerate", f"data.input={src}", f"data.tokenizer={tokdir}", f"model.target_path={target}",
                 f"regenerate.output={out}", "regenerate.engine=http"]) == 2     # a server to send to, named
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config key 'regenerate.url' must be set for regenerate.engine=http" in err[0]


def test_read_done_cuts_a_torn_last_line_and_keeps_whole_rows(tmp_path):
    """Resume's rule without Ray (the job's own test above is slow): a last line without its newline that is
    not a whole row (a run killed mid-write) is cut off, byte for byte, and counted; its conversation is not
    done. A last line that is a whole row but lost its newline is kept and gets one. A bad line before the
    last is not regenerate's and is refused, naming the line."""
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.jobs.regenerate import read_done

    rows = [json.dumps({"id": i, "conversations": []}) + "\n" for i in ("a", "b", 7)]
    out = tmp_path / "out.jsonl"
    whole = "".join(rows)
    out.write_text(whole + rows[2][:9])                          # the fourth row torn after 9 bytes
    done, counts = read_done(out)
    assert done == {"a", "b", "7"}
    assert counts == {"torn last line cut off (its conversation redone)": 1}
    assert out.read_text() == whole                               # exactly the whole rows stay

    out.write_text(whole + json.dumps({"id": "d"}))               # whole, newline lost
    done, counts = read_done(out)
    assert done == {"a", "b", "7", "d"} and not counts
    assert out.read_text() == whole + json.dumps({"id": "d"}) + "\n"

    out.write_text(rows[0] + "{not json\n" + rows[1])
    with pytest.raises(UserError, match=r"out.jsonl: line 2: not a JSON row"):
        read_done(out)
    assert read_done(tmp_path / "absent.jsonl") == (set(), {})


def loop_length(tokens, min_span, max_period):
    """The spec, written out: the first length t at which tokens[:t] ends in a loop (its last n = max(3p,
    min_span) tokens periodic with a period p <= max_period), None if it never does."""
    for t in range(1, len(tokens) + 1):
        for p in range(1, max_period + 1):
            n = max(3 * p, min_span)
            if n <= t and all(tokens[t - n + i] == tokens[t - n + i + p] for i in range(n - p)):
                return t
    return None


def test_a_loop_found_after_the_fact_is_found_where_the_spec_finds_it():
    # the continuous engine takes no stopping criteria: it applies the same rule to each finished row
    import random

    from dflash_ray.model.generation import first_loop

    rnd = random.Random(0)
    for _ in range(200):
        unit = [rnd.randrange(10) for _ in range(rnd.randint(1, 9))]
        row = ([rnd.randrange(6) for _ in range(rnd.randint(0, 30))] + unit * rnd.randint(0, 8)
               + [rnd.randrange(4) for _ in range(rnd.randint(0, 6))])
        span, period = rnd.choice([(6, 8), (4, 3), (10, 2)])
        assert first_loop(row, span, period) == loop_length(row, span, period), (row, span, period)


@pytest.mark.parametrize("engine", ["batched", "continuous"])
def test_greedy_loops_stop_early_and_are_dropped_counted_every_kept_turn_is_greedy(world, tmp_path, engine):
    """With on_max_tokens=drop, a row whose tail loops stops there and its turn is dropped (counted, its
    tokens up to the loop counted); every other turn is what it was: the greedy answer through its end token,
    or dropped at the cap. The random target ends few turns, so it also declares the token its greedy answers
    use most as an end token (generation_config, as Qwen3 declares two): some turns end, some loop."""
    import shutil
    from collections import Counter as Count

    root, tokdir, target, tok = world
    span, period, cap = 6, 8, 40
    prompts = [[{"role": "user", "content": f"Recite {w} for {n} words."}]
               for w in ("alpha", "nu", "red", "kappa", "gamma", "omega") for n in (3, 7)]
    answers = [greedy_tokens(tok, target, p, cap) for p in prompts]
    loops = [loop_length(a, span, period) for a in answers]
    assert any(loops), "the random target should loop on some of these prompts"
    # the end token: the commonest one of the answers that does not appear before a loop's end in any
    seen = {t for a, n in zip(answers, loops) if n for t in a[:n]}
    frequent = Count(t for a in answers for t in set(a) if t not in seen).most_common(1)[0][0]
    ends = [tok.eos_token_id, frequent]
    declared = tmp_path / "target"
    shutil.copytree(target, declared)
    (declared / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    # each turn's fate by the independent greedy loop and the spec above
    fates, generated = [], 0
    for ids in answers:
        stop = next((k for k, t in enumerate(ids) if t in ends), None)
        t = loop_length(ids if stop is None else ids[:stop + 1], span, period)
        if t is not None and (stop is None or t <= stop):
            fates.append("loop")
            generated += t
        else:
            fates.append("capped" if stop is None else "kept")
            generated += cap if stop is None else stop + 1
    assert {"loop", "kept"} <= set(fates), fates
    convs = [p + [{"role": "assistant", "content": "x"}] for p in prompts]
    regen = Regenerator(str(declared), Rendering(tok), max_new_tokens=cap, batch_size=4, loop_min_span=span,
                        loop_max_period=period, engine=engine)
    out, counts = regen(convs)
    assert counts["turns dropped: a greedy loop"] == fates.count("loop")
    assert counts["turns dropped: hit max_new_tokens"] == fates.count("capped")
    assert counts["generated tokens"] == generated     # a looping row counts the tokens up to its loop only
    for got, fate, conv, ids in zip(out, fates, convs, answers):
        if fate == "kept":   # the greedy answer, token for token, as without loop stopping
            stop = next(k for k, t in enumerate(ids) if t in ends)
            assert got == conv[:1] + [{"role": "assistant", "content": tok.decode(ids[:stop])}]
        else:
            assert got is None
    # on_max_tokens=keep (the demo's): nothing stops early, the looping turns run to the cap and are kept
    out, counts = Regenerator(str(declared), Rendering(tok), max_new_tokens=cap, batch_size=4, on_max_tokens="keep",
                              loop_min_span=span, loop_max_period=period, engine=engine)(convs)
    assert "turns dropped: a greedy loop" not in counts and all(o is not None for o in out)
