"""Conversation formats (dflash_ray/data/formats.py): ShareGPT, OpenAI/UltraChat and the project's own rows,
from jsonl, json, parquet, directories and globs, normalised for a chat template; bad rows fail with one line
naming file and row, or are skipped and reported. Every test reads files it wrote."""
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray.data.formats import FORMATS, BadRows, expand_inputs, iter_conversations
from dflash_ray.errors import UserError


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode())
            f.write(b"\n")
    return path


def write_parquet(path: Path, rows) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def one_line_error(spec, **kw) -> str:
    with pytest.raises(UserError) as e:
        list(iter_conversations(spec, **kw))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def sg(*turns, **extra):
    """A ShareGPT row from (from, value) pairs."""
    return {"conversations": [{"from": f, "value": v} for f, v in turns], **extra}


def own(*turns):
    return {"conversations": [{"role": r, "content": c} for r, c in turns]}


USER_HI = {"role": "user", "content": "hi"}


def test_sharegpt_row_is_normalised(tmp_path):
    row = {"system": "be brief", "tools": json.dumps([{"name": "add", "parameters": {}}]), "conversations": [
        {"from": "Human", "value": "add 1 and 2"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})},
        {"from": "observation", "value": "3"},
        {"from": "gpt", "value": "3"},
        {"from": "user", "value": "thanks"},
        {"from": "chatgpt", "value": "welcome"},
        {"from": "ipython", "value": "out"},
        {"from": "model", "value": "done"},
    ]}
    (conv,) = iter_conversations(write_jsonl(tmp_path / "a.jsonl", [row]))
    assert conv.format == "sharegpt" and (conv.source, conv.row, conv.id) == (str(tmp_path / "a.jsonl"), 0, 0)
    assert conv.messages == [
        {"role": "system", "content": "be brief"},  # the row's system field, put first
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "welcome"},
        {"role": "tool", "content": "out"},
        {"role": "assistant", "content": "done"},
    ]
    assert conv.tools == [{"name": "add", "parameters": {}}]  # the JSON string parsed


def test_openai_row_with_tools_calls_and_reasoning(tmp_path):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    row = {"tools": tools, "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "need the tool",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "-3C"},
        {"role": "assistant", "tool_calls": [{"type": "function",  # content missing, arguments an object
                                              "function": {"name": "weather", "arguments": {"city": "Bergen"}}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "5C"},
        {"role": "assistant", "content": "Oslo -3C, Bergen 5C", "reasoning_content": "done", "extra": 1},
    ]}
    (conv,) = iter_conversations(write_jsonl(tmp_path / "a.jsonl", [row]))
    assert conv.format == "openai" and conv.tools == tools
    assert conv.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "need the tool",
         "tool_calls": [{"type": "function", "id": "c1",
                         "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3C", "tool_call_id": "c1", "name": "weather"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Bergen"}}}]},
        {"role": "tool", "content": "5C", "tool_call_id": "c2"},
        {"role": "assistant", "content": "Oslo -3C, Bergen 5C", "reasoning_content": "done"},  # "extra" dropped
    ]


def test_text_parts_are_joined_and_a_non_text_part_is_a_bad_row(tmp_path):
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    (conv,) = iter_conversations(write_jsonl(tmp_path / "a.jsonl", [
        {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "hi"}]}]))
    assert conv.messages[0] == {"role": "user", "content": "Hello, world"}

    image = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x.png"}}]
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": [USER_HI, {"role": "assistant", "content": "x"}]},
                                             {"messages": [{"role": "user", "content": image}]}])
    assert one_line_error(bad) == f"{bad}: line 2: message 0: non-text content (part of type 'image_url')"


def test_own_format_passes_through_and_rows_without_assistant_are_yielded(tmp_path):
    rows = [own(("system", "s"), ("user", "u"), ("assistant", "a")), own(("user", "only a question"))]
    convs = list(iter_conversations(write_jsonl(tmp_path / "a.jsonl", rows)))
    assert [c.messages for c in convs] == [r["conversations"] for r in rows]
    assert [c.format for c in convs] == ["conversations"] * 2 and convs[1].tools is None


def test_forced_format_rejects_another_shape(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [sg(("human", "q"), ("gpt", "a")), own(("user", "q"))])
    assert [c.format for c in iter_conversations(path, format="auto")] == ["sharegpt", "conversations"]
    msg = one_line_error(path, format="sharegpt")
    assert msg == (f"{path}: line 2: a conversations row ('conversations' of {{role, content}}), "
                   "but the format is set to sharegpt")
    assert one_line_error(path, format="openai").startswith(f"{path}: line 1: a sharegpt row")
    assert "unknown format 'chatml'" in one_line_error(path, format="chatml")
    assert FORMATS == ("auto", "sharegpt", "openai", "conversations")


GOOD = own(("user", "q"), ("assistant", "a"))
# (the line as written, reason counted, the error's text after "line N: ")
BAD_LINES = {
    "truncated_json": ('{"conversations": [', "malformed_json",
                       "malformed JSON (Expecting value at the end of the line)"),
    "malformed_json": ('{"messages": [} ', "malformed_json", "malformed JSON (Expecting value at column 15)"),
    "not_utf8": (b'{"conversations": "\xff"}', "not_utf8", "not UTF-8 (invalid start byte at byte 19)"),
    "not_object": ("[1, 2]", "not_an_object", "row is a JSON list, not an object"),
    "no_conversation": ({"text": "hi"}, "no_conversation", "no 'messages' or 'conversations' list (keys: text)"),
    "empty": ({"messages": []}, "empty_conversation", "empty conversation"),
    "unknown_role": (sg(("human", "q"), ("robot", "a")), "unknown_role", "message 1: unknown role 'robot'"),
    "null_content": ({"messages": [{"role": "user", "content": None}]}, "bad_content",
                     "message 0 (user): 'content' is null, not a string"),
    "missing_value": ({"conversations": [{"from": "human"}]}, "bad_content",
                      "message 0 (user): 'value' is missing, not a string"),
    "number_content": (own(("user", 5)), "bad_content", "message 0 (user): 'content' is a int, not a string"),
    "message_not_object": ({"messages": [USER_HI, "hello"]}, "bad_message", "message 1 is not an object"),
    "bad_arguments": ({"messages": [USER_HI, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "bad_tool_calls",
        "message 1: tool call 0: arguments are not valid JSON (Expecting property name enclosed in double quotes)"),
    "call_without_name": ({"messages": [USER_HI, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"arguments": "{}"}}]}]}, "bad_tool_calls",
        "message 1: tool call 0 has no function name"),
    "calls_on_user": ({"messages": [{"role": "user", "content": "q", "tool_calls": [{"name": "f"}]}]},
                      "bad_tool_calls", "message 0: tool_calls on a user turn"),
    "function_call_not_json": (sg(("human", "q"), ("function_call", "add(1, 2)")), "bad_tool_calls",
                               "message 1: function_call value is not JSON (Expecting value)"),
    "bad_tools": ({"tools": 7, "messages": [USER_HI]}, "bad_tools", "'tools' is not a list of objects"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_row_fails_with_one_line_naming_file_and_row(case, tmp_path):
    line, _, detail = BAD_LINES[case]
    path = write_jsonl(tmp_path / "in.jsonl", [GOOD, "", GOOD, line, GOOD])
    assert one_line_error(path) == f"{path}: line 4: {detail}"   # the 4th line


def test_skip_policy_yields_the_good_rows_and_reports_the_bad(tmp_path):
    lines = [GOOD, "", '{"conversations": [', GOOD, {"messages": []}]
    lines += ['{"conversations": ['] * 6 + [GOOD, "   "]  # 7 malformed in all: only the first 5 are listed
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    report = BadRows()
    convs = list(iter_conversations(path, on_bad_row="skip", report=report))
    # rows (0-based lines): good 0, 3, 11; blank 1, 12; malformed 2, 5..10; empty 4
    assert [(c.row, c.id) for c in convs] == [(0, 0), (3, 3), (11, 11)]
    assert report.counts == {"empty_line": 2, "malformed_json": 7, "empty_conversation": 1}
    assert report.bad_rows == 8
    p = str(path)
    assert report.first == {"malformed_json": [(p, 2), (p, 5), (p, 6), (p, 7), (p, 8)],
                            "empty_conversation": [(p, 4)]}
    assert report.summary_line() == (f"skipped 8 bad rows (empty_conversation 1: {p} line 5; malformed_json 7: "
                                     f"{p} line 3, {p} line 6, {p} line 7, {p} line 8, {p} line 9); 2 empty lines")
    d = report.as_dict()
    assert json.loads(json.dumps(d)) == d  # goes into the prepare summary as is
    assert d["messages"]["malformed_json"] == f"{p}: line 3: malformed JSON (Expecting value at the end of the line)"
    # the same file under "fail" stops at the first bad row
    assert one_line_error(path) == f"{p}: line 3: malformed JSON (Expecting value at the end of the line)"
    assert BadRows().summary_line() == "no bad rows"


def test_json_list_and_object_with_one_list(tmp_path):
    rows = [sg(("human", "q1"), ("gpt", "a1")), own(("user", "q2"), ("assistant", "a2"))]
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(rows))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"version": 2, "data": rows}))
    for path in (listed, wrapped):
        convs = list(iter_conversations(path))
        assert [(c.row, c.messages[1]["content"]) for c in convs] == [(0, "a1"), (1, "a2")], path
    lines = write_jsonl(tmp_path / "lines.json", rows)  # datasets' to_json writes JSON lines as .json
    assert [c.messages[0]["content"] for c in iter_conversations(lines)] == ["q1", "q2"]
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"train": rows, "test": rows}))
    assert one_line_error(two) == (f"{two}: expected a list of rows, or an object with one list of rows "
                                   "(found 2 list-valued keys: train, test)")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"messages": []},\n oops]')
    assert one_line_error(broken) == f"{broken}: malformed JSON (Expecting value at line 2 column 2)"
    # a bad row inside a list is named by its index
    withbad = tmp_path / "withbad.json"
    withbad.write_text(json.dumps([rows[0], {"messages": "hello"}]))
    assert one_line_error(withbad) == f"{withbad}: row 1 (0-based): 'messages' is not a list"


def test_parquet_sharegpt_and_openai_rows(tmp_path):
    path = write_parquet(tmp_path / "sg.parquet", [
        sg(("human", "q0"), ("gpt", "a0")), sg(("system", "s"), ("human", "q1"), ("bard", "a1"))])
    convs = list(iter_conversations(path))
    assert [c.messages for c in convs] == [
        [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]]
    assert [(c.row, c.id, c.format) for c in convs] == [(0, 0, "sharegpt"), (1, 1, "sharegpt")]

    # parquet unions the struct fields of all rows: absent keys come back as None and must read as absent
    call = {"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    oa = write_parquet(tmp_path / "oa.parquet", [
        {"messages": [USER_HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "content": "1", "tool_call_id": "c"}]},
        {"messages": [USER_HI, {"role": "assistant", "content": "plain"}]}])
    convs = list(iter_conversations(oa))
    assert convs[0].messages[1] == {"role": "assistant", "content": "",
                                    "tool_calls": [{"type": "function",
                                                    "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert convs[0].messages[2] == {"role": "tool", "content": "1", "tool_call_id": "c"}
    assert convs[1].messages == [USER_HI, {"role": "assistant", "content": "plain"}]

    nocol = write_parquet(tmp_path / "nocol.parquet", [{"text": "hello"}])
    assert one_line_error(nocol) == f"{nocol}: no 'messages' or 'conversations' column (columns: text)"
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 not really")
    assert one_line_error(junk).startswith(f"{junk}: not a readable parquet file (")


def test_directory_mixing_jsonl_and_parquet_sorted_with_stable_unique_ids(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_parquet(d / "b.parquet", [sg(("human", f"b{i}"), ("gpt", "x")) for i in range(3)])
    write_jsonl(d / "a.jsonl", [own(("user", "a0"), ("assistant", "x")), "", own(("user", "a2"), ("assistant", "x"))])
    write_jsonl(d / "c.jsonl", [own(("user", "c0"), ("assistant", "x"))])
    (d / "notes.txt").write_text("ignored")
    (d / "sub").mkdir()
    write_jsonl(d / "sub" / "z.jsonl", [GOOD])  # not recursive
    assert expand_inputs(d) == [str(d / "a.jsonl"), str(d / "b.parquet"), str(d / "c.jsonl")]
    got = [(Path(c.source).name, c.row, c.id, c.messages[0]["content"]) for c in iter_conversations(d)]
    # a.jsonl has 3 rows (its blank line counts), b.parquet 3: ids run on from 3 and 6
    assert got == [("a.jsonl", 0, 0, "a0"), ("a.jsonl", 2, 2, "a2"),
                   ("b.parquet", 0, 3, "b0"), ("b.parquet", 1, 4, "b1"), ("b.parquet", 2, 5, "b2"),
                   ("c.jsonl", 0, 6, "c0")]
    assert [c.id for c in iter_conversations(str(d))] == [g[2] for g in got]  # stable across calls


def test_directory_and_glob_order_is_by_name_not_by_listing(tmp_path):
    names = [f"f{i:02d}.jsonl" for i in range(12)]
    for name in reversed(names):  # created in reverse: a listing in creation or hash order is not sorted
        write_jsonl(tmp_path / name, [GOOD])
    assert [Path(p).name for p in expand_inputs(tmp_path)] == names
    assert [Path(p).name for p in expand_inputs(str(tmp_path / "f*.jsonl"))] == names
    assert [(Path(c.source).name, c.id) for c in iter_conversations(tmp_path)] == [(n, i) for i, n in enumerate(names)]


def test_glob_and_list_inputs(tmp_path):
    for name in ("x2.jsonl", "x1.jsonl", "y.jsonl"):
        write_jsonl(tmp_path / name, [own(("user", name), ("assistant", "a"))])
    assert [Path(c.source).name for c in iter_conversations(str(tmp_path / "x*.jsonl"))] == ["x1.jsonl", "x2.jsonl"]
    # a list keeps its order; a file named twice is read once
    spec = [tmp_path / "y.jsonl", str(tmp_path / "x*.jsonl"), tmp_path / "x1.jsonl"]
    assert [Path(p).name for p in expand_inputs(spec)] == ["y.jsonl", "x1.jsonl", "x2.jsonl"]
    assert [c.id for c in iter_conversations(spec)] == [0, 1, 2]
    pattern = str(tmp_path / "nothing*.jsonl")
    assert one_line_error(pattern) == f"{pattern}: no .jsonl, .json or .parquet files match this pattern"


def test_missing_empty_and_unsupported_inputs(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert one_line_error(missing) == f"{missing}: input does not exist"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("x")
    assert one_line_error(empty) == f"{empty}: no .jsonl, .json or .parquet files in this directory"
    csv = tmp_path / "a.csv"
    csv.write_text("a,b\n")
    assert one_line_error(csv) == f"{csv}: unsupported input file type (expected .jsonl, .json or .parquet)"
    good = write_jsonl(tmp_path / "g.jsonl", [GOOD])
    assert "unknown policy 'ignore'" in one_line_error(good, on_bad_row="ignore")


def test_datasets_directory_needs_the_package(tmp_path):
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed here: the missing-package message cannot be seen")
    d = tmp_path / "saved"
    d.mkdir()
    (d / "dataset_info.json").write_text("{}")
    (d / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (d / "data-00000-of-00001.arrow").write_bytes(b"")
    expect = f"{d}: a Hugging Face datasets directory (save_to_disk); reading it needs the datasets package: " \
             "pip install datasets"
    assert one_line_error(d) == expect  # not read as a directory of two .json inputs
    assert one_line_error(str(tmp_path / "sav*")) == expect


def test_chunks_give_the_same_conversations_ids_and_bad_rows_as_one_pass(tmp_path):
    """A parallel prepare reads chunks (jsonl by lines, parquet by row groups, .json whole): together they
    must yield exactly what iter_conversations yields, ids included."""
    import json as _json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_ray.data.formats import BadRows, iter_chunk, iter_conversations, plan_chunks

    def conv(i):
        return {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}

    lines = [_json.dumps(conv(i)) for i in range(23)]
    lines[4], lines[9], lines[15] = "", "{bad", "  "
    (tmp_path / "a.jsonl").write_text("\n".join(lines))           # no newline after the last row
    pq.write_table(pa.Table.from_pylist([conv(100 + i) for i in range(10)]), tmp_path / "b.parquet",
                   row_group_size=3)                                # row groups of 3, 3, 3, 1
    (tmp_path / "c.json").write_text(_json.dumps([conv(200), conv(201)]))
    whole_report, chunk_report = BadRows(), BadRows()
    whole = [(c.source, c.row, c.id, c.messages) for c in iter_conversations(tmp_path, on_bad_row="skip",
                                                                               report=whole_report)]
    chunks = plan_chunks(tmp_path, rows_per_chunk=5)
    # a.jsonl: 23 rows in 5 chunks of 5,5,5,5,3; b.parquet: row groups [0,1] [2,3]; c.json whole
    assert [(c.start, c.stop) for c in chunks if c.path.endswith("a.jsonl")] == [(0, 5), (5, 10), (10, 15),
                                                                                (15, 20), (20, 23)]
    assert [c.row_groups for c in chunks if c.path.endswith("b.parquet")] == [(0, 1), (2, 3)]
    assert [c.base for c in chunks] == [0] * 5 + [23, 23, 33]
    parts = [(c.source, c.row, c.id, c.messages) for ch in reversed(chunks)
             for c in iter_chunk(ch, on_bad_row="skip", report=chunk_report)]
    assert sorted(parts, key=lambda t: t[2]) == whole and len(whole) == 23 - 3 + 10 + 2
    assert chunk_report.counts == whole_report.counts == {"malformed_json": 1, "empty_line": 2}
