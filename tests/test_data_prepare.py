"""prepare: conversations -> parquet shards with an assistant-only loss mask."""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers_data import make_tokenizer, write_jsonl
from transformers import AutoTokenizer

from dflash_ray.cli import run_command
from dflash_ray.data.prepare import TURN_STRIDE, prepare
from dflash_ray.data.shards import PREPARED_SCHEMA, list_shards


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_loss_mask_covers_exactly_the_assistant_turns(tok_dir, tmp_path):
    corpus, tokdir = tok_dir
    conv = [{"role": "system", "content": "You are a precise assistant."},
            {"role": "user", "content": "Count from 3 to 6."},
            {"role": "assistant", "content": "3 4 5 6"},
            {"role": "user", "content": "Repeat 'red blue' 2 times."},
            {"role": "assistant", "content": "red blue red blue"}]
    src = write_jsonl(tmp_path / "c.jsonl", [{"id": "x", "conversations": conv}] * 3)
    s = prepare(str(src), str(tokdir), str(tmp_path / "out"), shard_size=2, progress=False)
    assert (s.samples, s.shards) == (3, 2)
    t = pq.read_table(list_shards(tmp_path / "out")[0])
    assert t.schema.equals(PREPARED_SCHEMA)
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    ids = np.array(t.column("input_ids")[0].as_py())
    mask = np.array(t.column("loss_mask")[0].as_py())
    assert t.column("num_tokens")[0].as_py() == ids.size == mask.size
    assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False)
    # masked tokens decode to the two answers, each with its end-of-turn token; nothing else
    runs = np.split(np.flatnonzero(mask), np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    assert [tok.decode(ids[r]) for r in runs] == ["3 4 5 6<|im_end|>", "red blue red blue<|im_end|>"]
    # the planner's drafter budget reads the supervised count: the two answers' tokens, counted here
    # from the tokenizer alone
    answers = sum(len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for a in ("3 4 5 6", "red blue red blue"))
    assert t.column("num_supervised")[0].as_py() == answers
    assert t.column("sample_id").to_pylist() == [0, TURN_STRIDE]  # conversation id x 1024 + turn (0: whole)


def test_prepare_cli_summary_counts_drops(tok_dir, tmp_path, capsys):
    _, tokdir = tok_dir
    rows = [{"id": 1, "conversations": [{"role": "user", "content": "hi"}]},  # no assistant turn
            {"id": 2, "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
            {"id": 3, "conversations": [{"role": "user", "content": "Count from 1 to 40."},
                                        {"role": "assistant", "content": " ".join(map(str, range(1, 41)))}]}]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/o",
                                 "model.block_size=8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["samples"] == 1 and out["dropped"] == {"no_assistant_turn": 1, "too_few_supervised_tokens": 1}


def test_malformed_line_exits_2_naming_file_and_line_and_writes_nothing(tok_dir, tmp_path, capsys):
    _, tokdir = tok_dir
    good = {"id": 1, "conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    src = write_jsonl(tmp_path / "c.jsonl", [good, good, '{"id": 3, "conversations": [', good])
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/o"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "c.jsonl: line 3: malformed JSON" in err[0]     # lines count as an editor counts them
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp*"))
    src2 = write_jsonl(tmp_path / "d.jsonl", [{"id": 1, "conversations": [{"role": "robot", "content": "x"}]}])
    rc = run_command("prepare", [f"data.input={src2}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/o"])
    assert rc == 2 and "d.jsonl: line 1: message 0: unknown role 'robot'" in capsys.readouterr().err


def test_prepare_refuses_foreign_output_dirs_and_bad_encodings_and_templates(tok_dir, tmp_path, capsys):
    _, tokdir = tok_dir
    good = {"id": 1, "conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "1 2 3 4 5 6"}]}
    src = write_jsonl(tmp_path / "c.jsonl", [good])
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    args = [f"data.tokenizer={tokdir}", "model.block_size=2"]
    rc = run_command("prepare", [f"data.input={src}", f"data.output={tmp_path}/o"] + args)
    assert rc == 2 and "holds files prepare did not write (notes.txt)" in capsys.readouterr().err
    assert (tmp_path / "o" / "notes.txt").read_text() == "mine"
    rc = run_command("prepare", [f"data.input={src}", f"data.output={tmp_path}"] + args)
    assert rc == 2 and "holds the input" in capsys.readouterr().err and src.exists()
    # a second prepare into its own output replaces it
    assert run_command("prepare", [f"data.input={src}", f"data.output={tmp_path}/p"] + args) == 0
    assert run_command("prepare", [f"data.input={src}", f"data.output={tmp_path}/p"] + args) == 0
    capsys.readouterr()
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps(good).encode() + b"\n" + b'{"id": 2, "conversations": [{"role": "user", "content": "caf\xe9"}]}\n')
    rc = run_command("prepare", [f"data.input={bad}", f"data.output={tmp_path}/q"] + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "latin1.jsonl: line 2: not UTF-8" in err[0]
    two_users = {"id": 3, "conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    strict = tmp_path / "tok_strict"
    import shutil

    shutil.copytree(tokdir, strict)
    cfg_path = strict / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}{% if m['role'] == 'user' %}{{ raise_exception('no users here') }}{% endif %}{% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    for extra in strict.glob("chat_template.*"):
        extra.write_text(cfg["chat_template"]) if extra.suffix == ".jinja" else extra.unlink()
    src2 = write_jsonl(tmp_path / "d.jsonl", [two_users])
    rc = run_command("prepare", [f"data.input={src2}", f"data.output={tmp_path}/r", f"data.tokenizer={strict}", "model.block_size=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "d.jsonl: line 1: chat template failed (no users here)" in err[0], err


def _counting(m: int) -> dict:
    """A one-turn conversation whose answer is '1 2 ... m'."""
    return {"conversations": [{"role": "user", "content": f"Count from 1 to {m}."},
                              {"role": "assistant", "content": " ".join(map(str, range(1, m + 1)))}]}


def _supervised(tok, m: int) -> int:
    """Supervised tokens of _counting(m), by the rule: the answer's tokens plus its end-of-turn token. With
    this tokenizer '1 2 ... m' is m tokens ('1', ' 2', ..., ' m'), checked here so the counts below hold."""
    answer = " ".join(map(str, range(1, m + 1)))
    assert tok.tokenize(answer) == ["1"] + [f"\u0120{i}" for i in range(2, m + 1)]
    return m + 1


def test_sample_id_is_the_input_row_index_times_1024_so_dropped_lines_leave_gaps(tok_dir, tmp_path, capsys):
    _, tokdir = tok_dir
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    lines = [_counting(9),                                            # row 0 -> id 0
             "",                                                      # row 1: empty
             {"conversations": [{"role": "user", "content": "hi"}]},  # row 2: no assistant turn
             _counting(10),                                           # row 3 -> id 3 x 1024
             _counting(3),                                            # row 4: 4 supervised < 8
             "   ",                                                   # row 5: blank
             _counting(11)]                                           # row 6 -> id 6 x 1024
    src = write_jsonl(tmp_path / "c.jsonl", lines)
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/o",
                                 "model.block_size=4", "data.shard_size=2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["samples"] == 3 and out["shards"] == 2
    assert out["dropped"] == {"no_assistant_turn": 1, "too_few_supervised_tokens": 1}
    assert out["bad_rows"]["counts"] == {"empty_line": 2} and out["conversations"] == 5
    shards = [pq.read_table(p) for p in list_shards(tmp_path / "o")]
    assert [t.column("sample_id").to_pylist() for t in shards] == [[0, 3 * 1024], [6 * 1024]]
    # each id holds the conversation of its line
    rows = [r for t in shards for r in t.to_pylist()]
    for row, m in zip(rows, (9, 10, 11)):
        assert tok.decode(row["input_ids"]) == tok.apply_chat_template(_counting(m)["conversations"], tokenize=False)
        assert sum(row["loss_mask"]) == _supervised(tok, m)


def test_min_supervised_is_two_blocks_inclusive(tok_dir, tmp_path, capsys):
    # block_size 4: a sample needs at least 2 x 4 = 8 supervised tokens; exactly 8 is kept, 7 is dropped
    _, tokdir = tok_dir
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    assert (_supervised(tok, 7), _supervised(tok, 6), _supervised(tok, 8)) == (8, 7, 9)
    src = write_jsonl(tmp_path / "c.jsonl", [_counting(6), _counting(7), _counting(8)])
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/o",
                                 "model.block_size=4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["dropped"] == {"too_few_supervised_tokens": 1}
    t = pq.read_table(list_shards(tmp_path / "o")[0])
    assert t.column("sample_id").to_pylist() == [1 * 1024, 2 * 1024]
    assert [sum(m) for m in t.column("loss_mask").to_pylist()] == [8, 9] and out["supervised_tokens"] == 17
    # block_size 3 (6 tokens) keeps all three; block_size 5 (10 tokens) keeps none and says so
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/p",
                                 "model.block_size=3", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["samples"] == 3
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/q",
                                 "model.block_size=5"])
    err = capsys.readouterr().err
    assert rc == 2 and ("no usable conversations (dropped: samples with fewer than 10 (2 x model.block_size) "
                        "supervised tokens: 3; no bad rows)") in err, err
