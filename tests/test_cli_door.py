"""The door of the CLI: `--help` (every command, one line each), each command's whole help with its main
config keys, `--version`, prepare's drops in words with their threshold, bad rows named by the line an
editor shows, and progress with totals for prepare and eval.

Expected values come from the project's files (pyproject.toml, config.py's source), from counting the
inputs written here, or from the words of the behaviour's spec, not from the code under test."""
import json
import re
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_data import make_tokenizer, write_jsonl

from dflash_ray.cli import main, run_command
from dflash_ray.data import report
from dflash_ray.data.formats import BadRows, iter_conversations
from dflash_ray.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["regenerate", "prepare", "plan", "order-stats", "train", "compare", "compare-orders", "eval", "export", "plot",
            "config"]


def _flat(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------- help and version
def test_top_help_lists_every_command_with_a_line_and_the_version_flag(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in COMMANDS:
        line = next((x for x in out.splitlines() if x.split()[:1] == [cmd]), None)
        assert line is not None, f"{cmd} has no line of its own in:\n{out}"
        assert len(line.split(None, 1)[1]) > 30, line          # a description, not just the name
    assert "--version" in out and "overrides" in out.lower()
    assert main([]) == 2 and "commands:" in capsys.readouterr().err   # no command: the same help, exit 2


def test_version_prints_the_installed_version(capsys):
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dflash-ray {want}"


def _schema_comment(field: str) -> str:
    """The line of `field` in dflash_ray/config.py: its knob's doc string, read from the source's syntax tree."""
    import ast

    tree = ast.parse((ROOT / "dflash_ray" / "config.py").read_text())
    call = next(n.value for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == field)
    docs = [k.value for k in call.keywords if k.arg == "doc"] or call.args[1:2]
    return docs[0].value


@pytest.mark.parametrize("cmd,keys,sentence", [
    ("prepare", ["data.input", "data.tokenizer", "data.output", "data.on_bad_row", "data.chat_template_kwargs"],
     "Samples with fewer than 2 x model.block_size supervised tokens are dropped"),
    ("plan", ["data.shards", "model.target_path", "model.max_block_tokens_per_batch", "model.anchors_per_batch",
              "cluster.device_memory_gb"],
     "--check validates every token"),
    ("eval", ["drafter", "model.target_path", "data.prompts", "eval.max_new_tokens"], "exit 1 if it does not, in fp32"),
    ("regenerate", ["data.input", "model.target_path", "regenerate.output", "regenerate.max_new_tokens", "regenerate.on_max_tokens"],
     "Every case is counted by reason"),
    ("train", ["model.target_path", "train.epochs", "train.storage_path", "run.name"], "With no arguments"),
])
def test_command_help_shows_the_whole_description_and_the_main_keys(cmd, keys, sentence, capsys):
    assert run_command(cmd, ["--help"]) == 0
    out = _flat(capsys.readouterr().out)
    assert sentence in out, out     # past the description's first line
    for key in keys:
        assert f"{key} (default" in out, key
    leaf = {"prepare": "on_bad_row", "plan": "anchors_per_batch", "eval": "max_prompts",
            "regenerate": "batch_size", "train": "storage_path"}[cmd]
    assert _flat(_schema_comment(leaf)) in out                   # each key with its line from the schema
    if cmd == "prepare":
        assert 'data.on_bad_row (default "fail")' in out and 'data.output (default "${run.dir}/shards")' in out


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help(cmd, capsys):
    assert run_command(cmd, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dflash-ray {cmd}") and len(out.splitlines()) > 8


# ----------------------------------------------------------------------------- prepare's words and lines
@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))[1]


def _counting(m: int) -> dict:
    return {"conversations": [{"role": "user", "content": f"Count from 1 to {m}."},
                              {"role": "assistant", "content": " ".join(map(str, range(1, m + 1)))}]}


def test_prepare_says_its_drops_in_words_with_the_threshold(tokdir, tmp_path, capsys):
    # block 8: a sample needs 16 supervised tokens. "ok" + end of turn has 2: dropped; counting to 40 (41) kept
    rows = [{"conversations": [{"role": "user", "content": "hi"}]},
            {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
            _counting(40)]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    args = [f"data.input={src}", f"data.tokenizer={tokdir}"]
    assert run_command("prepare", args + [f"data.output={tmp_path}/o", "model.block_size=8"]) == 0
    dropped = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dropped:"))
    assert dropped.startswith("dropped: conversations without an assistant turn: 1, samples with fewer than 16 "
                              "(2 x model.block_size) supervised tokens: 1; "), dropped
    # nothing usable: the one error line says the same, not a Python dict
    assert run_command("prepare", args + [f"data.output={tmp_path}/p", "model.block_size=32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "{" not in err[0], err
    assert ("no usable conversations (dropped: conversations without an assistant turn: 1, samples with fewer "
            "than 64 (2 x model.block_size) supervised tokens: 2; no bad rows)") in err[0], err


def test_bad_jsonl_rows_are_named_by_their_line_as_an_editor_counts(tokdir, tmp_path, capsys):
    # line 1 good, line 2 blank, line 3 malformed: the editor's line 3 (0-based index 2)
    src = write_jsonl(tmp_path / "c.jsonl", [_counting(40), "", '{"conversations": ['])
    args = [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/o"]
    assert run_command("prepare", args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{src}: line 3: malformed JSON" in err[0], err
    assert run_command("prepare", args + ["data.on_bad_row=skip"]) == 0
    bad = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dropped:"))
    assert f"malformed_json 1: {src} line 3)" in bad and "1 empty lines" in bad, bad


def _one_line(path, **kw) -> str:
    with pytest.raises(UserError) as e:
        list(iter_conversations(str(path), **kw))
    return str(e.value)


def test_rows_outside_json_lines_say_they_count_from_zero(tmp_path):
    good = _counting(3)
    bad = {"messages": "not a list"}
    # a .json file holding JSON lines: read line by line, named by line
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    assert _one_line(lines).startswith(f"{lines}: line 2: ")
    # a JSON list (pretty-printed over many lines): its index, said to be 0-based
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([good, bad], indent=2))
    assert _one_line(listed).startswith(f"{listed}: row 1 (0-based): ")
    # parquet: the index pyarrow gives the row
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"messages": [good["conversations"], []]}), table)
    assert _one_line(table) == f"{table}: row 1 (0-based): empty conversation"
    # skipped rows are named the same way in the summary
    report_ = BadRows()
    list(iter_conversations([str(lines), str(listed)], on_bad_row="skip", report=report_))
    assert f"{lines} line 2" in report_.summary_line() and f"{listed} row 1 (0-based)" in report_.summary_line()


# ----------------------------------------------------------------------------- progress with totals
def _progress_lines(err: str, desc: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(rf"^{desc}: (\d+)/(\d+) ", err, flags=re.M)]


def test_prepare_progress_counts_rows_toward_the_inputs_total(tokdir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "LINE_EVERY_S", 0.0)   # a line at every count (logs get one every 5 s)
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [_counting(40), "", _counting(41)])
    pq.write_table(pa.table({"conversations": [_counting(42)["conversations"]] * 2}), tmp_path / "in" / "b.parquet")
    assert run_command("prepare", [f"data.input={tmp_path}/in", f"data.tokenizer={tokdir}",
                                   f"data.output={tmp_path}/o"]) == 0
    seen = _progress_lines(capsys.readouterr().err, "prepare")
    # 3 lines of a.jsonl (the blank one included) + 2 parquet rows = 5 rows in all, counted up to the end
    assert seen and {total for _, total in seen} == {5}, seen
    assert seen[-1][0] == 5 and [n for n, _ in seen] == sorted(n for n, _ in seen)


@pytest.mark.rounding
def test_eval_prints_progress_per_prompt(tmp_path, monkeypatch, capsys):
    from dflash_ray.model.drafter import DrafterConfig, build_drafter
    from dflash_ray.model.export import export_drafter
    from dflash_ray.model.target import build_synthetic_target, load_embed_and_head, load_target

    tcfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    target_dir = build_synthetic_target(tcfg, 64, str(tmp_path / "target"), seed=0)
    embed, head = load_embed_and_head(target_dir)
    drafter = build_drafter(DrafterConfig(num_draft_layers=1, block_size=4, num_anchors=8, mask_token_id=63),
                            load_target(target_dir).config, embed, head, seed=0)
    drafter_dir = export_drafter(drafter, str(tmp_path / "drafter"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    monkeypatch.setattr(report, "LINE_EVERY_S", 0.0)
    rc = run_command("eval", [f"drafter={drafter_dir}", f"target={target_dir}", f"data.prompts={prompts}",
                              "eval.max_new_tokens=4"])
    assert rc == 0   # fp32: the speculative output equals plain greedy decoding
    assert _progress_lines(capsys.readouterr().err, "eval") == [(1, 3), (2, 3), (3, 3)]


def test_progress_lines_off_a_terminal_come_every_few_seconds_and_end_where_the_phase_ended(monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(report, "_now", lambda: now[0])
    with report.ProgressCount(6, "phase", "things") as p:
        for t in (1, 2, 6, 7, 8, 9):   # seconds since the start at each count
            now[0] = t
            p.update()
    lines = capsys.readouterr().err.splitlines()
    # the first line once 5 s have passed (the 3rd count, at 6 s), none until 5 s later, the last at the end
    assert [x.split(",")[0] for x in lines] == ["phase: 3/6 things (50%)", "phase: 6/6 things (100%)"], lines


def test_the_target_time_figure_reads_one_way_only():
    """greedy seconds / speculative seconds, in words that cannot be misread (by hand: 1 / 0.61 = 1.639)."""
    from dflash_ray.cli import target_time_words

    assert target_time_words(2.62) == "2.62x less target time than plain greedy decoding"
    assert target_time_words(0.61) == "1.64x the target time of plain greedy decoding (slower)"
    assert target_time_words(float("nan")) == "target time not measured"
