"""Supervision that matches serving: the tokens supervised for an assistant turn are exactly what the
target generates for it, given the prompt rendered with the generation prompt; templates that rewrite
history give one row per turn; untrustworthy turns are counted, never silently mis-masked."""
import numpy as np
import pytest
from helpers_data import make_tokenizer
from transformers import AutoTokenizer

from dflash_ray.data.supervision import supervise

# A template with Qwen3's behaviours, written for these tests: the system prompt and the tools block;
# reasoning in a <think> block only for assistant turns after the last user query (earlier turns lose
# it: history is rewritten); tool calls as <tool_call> JSON; tool results inside a user turn; with
# enable_thinking=false the generation prompt holds an empty think block.
QWEN3_STYLE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for c in m.tool_calls or [] %}
            {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    _, tokdir = make_tokenizer(tmp_path_factory.mktemp("tok"))
    t = AutoTokenizer.from_pretrained(str(tokdir))
    t.chat_template = QWEN3_STYLE
    return t


def supervised_text(tok, row):
    """The supervised tokens decoded, one string per contiguous run."""
    idx = np.flatnonzero(row.mask)
    runs = np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1) if idx.size else []
    return [tok.decode(row.ids[r]) for r in runs]


def test_single_turn_with_reasoning_supervises_the_whole_generation(tok):
    conv = [{"role": "user", "content": "Count to 3."},
            {"role": "assistant", "reasoning_content": "one two three", "content": "1 2 3"}]
    sup = supervise(tok, conv)
    assert not sup.per_turn and len(sup.rows) == 1 and not sup.skipped_turns
    # by hand: after "<|im_start|>assistant\n" the target generates the think block, answer, end of turn
    assert supervised_text(tok, sup.rows[0]) == ["<think>\none two three\n</think>\n\n1 2 3<|im_end|>"]


def test_history_rewriting_gives_one_row_per_turn_each_as_served(tok):
    conv = [{"role": "user", "content": "a"},
            {"role": "assistant", "reasoning_content": "think one", "content": "first"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "reasoning_content": "think two", "content": "second"}]
    sup = supervise(tok, conv)
    assert sup.per_turn and [r.turn for r in sup.rows] == [1, 2]
    first, second = sup.rows
    assert supervised_text(tok, first) == ["<think>\nthink one\n</think>\n\nfirst<|im_end|>"]
    # the second row's history is what the target sees when serving turn 2: turn 1 without its reasoning
    assert tok.decode(second.ids) == ("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nfirst<|im_end|>\n"
                                      "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think>\nthink two\n"
                                      "</think>\n\nsecond<|im_end|>\n")
    assert supervised_text(tok, second) == ["<think>\nthink two\n</think>\n\nsecond<|im_end|>"]
    last = supervise(tok, conv, turns="last")
    assert len(last.rows) == 1 and supervised_text(tok, last.rows[0]) == supervised_text(tok, second)


def test_tool_calls_and_tools_block_are_rendered_and_the_call_is_supervised(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    conv = [{"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "5"}]
    sup = supervise(tok, conv, tools)
    text = tok.decode(sup.rows[0].ids)
    assert '"name": "add"' in text.split("<|im_end|>")[0]          # the tools block rendered in the system turn
    # both assistant turns come after the last user query: the template renders each with a think block
    runs = [t for r in sup.rows for t in supervised_text(tok, r)]
    assert runs[0] == ("<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n"
                       "</tool_call><|im_end|>")
    assert runs[-1].endswith("5<|im_end|>")


def test_enable_thinking_false_moves_the_empty_think_block_into_the_prompt(tok):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    sup = supervise(tok, conv, template_kwargs={"enable_thinking": False})
    assert supervised_text(tok, sup.rows[0]) == ["hello<|im_end|>"]   # the think block is the prompt's now
    # a turn with reasoning cannot be what an enable_thinking=false deployment generates: counted, left out
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": "r", "content": "x"}]
    sup = supervise(tok, conv, template_kwargs={"enable_thinking": False})
    assert sup.rows == [] and sup.skipped_turns == {"prompt_not_a_prefix_of_turn": 1}


def test_append_only_templates_keep_one_row_with_every_turn_and_its_end_of_turn(tok):
    chatml = AutoTokenizer.from_pretrained(tok.name_or_path)  # the project's ChatML template
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "two"}]
    sup = supervise(chatml, conv)
    assert not sup.per_turn and len(sup.rows) == 1
    assert supervised_text(chatml, sup.rows[0]) == ["one<|im_end|>", "two<|im_end|>"]


def test_an_assistant_turn_first_has_no_prompt_and_is_counted(tok):
    conv = [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "ok"},
            {"role": "assistant", "content": "fine"}]
    sup = supervise(tok, conv)
    assert sup.skipped_turns == {"no_prompt_before_turn": 1}
    assert [t for r in sup.rows for t in supervised_text(tok, r)] == ["<think>\n\n</think>\n\nfine<|im_end|>"]


def _qwen3_style_tokenizer_dir(tok, root):
    tok.save_pretrained(str(root))  # the fixture's tokenizer carries QWEN3_STYLE as its template
    return root


def test_prepare_reads_sharegpt_and_openai_rows_and_skips_bad_ones_counted(tok, tmp_path, capsys):
    import json

    import pyarrow.parquet as pq

    from dflash_ray.cli import run_command
    from dflash_ray.data.shards import list_shards

    tokdir = _qwen3_style_tokenizer_dir(tok, tmp_path / "tok")
    data = tmp_path / "data"
    data.mkdir()
    sharegpt = {"conversations": [{"from": "human", "value": "Count to 3."},
                                  {"from": "gpt", "value": "1 2 3 4 5 6 7 8 9 10 11 12"}]}
    openai = {"messages": [{"role": "user", "content": "a"},
                           {"role": "assistant", "reasoning_content": "think one", "content": "first answer here"},
                           {"role": "user", "content": "b"},
                           {"role": "assistant", "reasoning_content": "think two", "content": "second answer here"}]}
    (data / "a.jsonl").write_text(json.dumps(sharegpt) + "\n" + "{not json\n" + json.dumps(sharegpt) + "\n")
    (data / "b.jsonl").write_text(json.dumps(openai) + "\n")
    args = [f"data.input={data}", f"data.tokenizer={tokdir}", f"data.output={tmp_path / 'out'}", "model.block_size=2"]
    assert run_command("prepare", args) == 2
    assert "a.jsonl: line 2: malformed JSON" in capsys.readouterr().err
    assert run_command("prepare", args + ["data.on_bad_row=skip", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bad_rows"]["counts"] == {"malformed_json": 1} and out["bad_rows"]["first"]["malformed_json"][0][1] == 1
    # rows 0 and 2 of a.jsonl (ids 0 and 2), row 0 of b.jsonl (conversation id 3) as one row per turn
    assert out["conversations"] == 3 and out["per_turn_conversations"] == 1 and out["untrusted_turns"] == {}
    table = pq.read_table(list_shards(tmp_path / "out")[0])
    assert table.column("sample_id").to_pylist() == [0, 2 * 1024, 3 * 1024 + 1, 3 * 1024 + 2]
    # every assistant token of the reasoning conversation is supervised, in the row of its turn
    rows = table.to_pylist()
    texts = [tok.decode(np.asarray(r["input_ids"])[np.asarray(r["loss_mask"], bool)]) for r in rows[2:]]
    assert texts == ["<think>\nthink one\n</think>\n\nfirst answer here<|im_end|>",
                     "<think>\nthink two\n</think>\n\nsecond answer here<|im_end|>"]
    assert [r["num_supervised"] for r in rows] == [sum(r["loss_mask"]) for r in rows]


def test_prepare_template_arguments_and_untrusted_turns_are_counted(tok, tmp_path, capsys):
    import json

    from dflash_ray.cli import run_command

    tokdir = _qwen3_style_tokenizer_dir(tok, tmp_path / "tok")
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there friend"}]},
            {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "reasoning_content": "r", "content": "x y z w"}]}]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path / 'o'}",
                                 "model.block_size=2", "data.chat_template_kwargs={enable_thinking: false}", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["samples"] == 1
    assert out["untrusted_turns"] == {"prompt_not_a_prefix_of_turn": 1}
    assert out["dropped"] == {"no_trusted_assistant_turn": 1}


def test_a_generated_turn_is_stored_as_the_message_the_template_renders_back_exactly(tok):
    """Rendering.assistant_message: the stored form of a generated answer is one whose supervision is the
    generated text and its end token, character for character (expected messages written by hand from
    QWEN3_STYLE); None when no form renders as generated."""
    from dflash_ray.data.supervision import Rendering

    history = [{"role": "user", "content": "Count to 3."}]
    thinking, off = Rendering(tok), Rendering(tok, {"enable_thinking": False})
    ends = ("<|im_end|>",)
    assert thinking.assistant_message(history, None, "<think>\none two\n</think>\n\n1 2 3", ends) == \
        {"role": "assistant", "content": "1 2 3", "reasoning_content": "one two"}
    assert off.assistant_message(history, None, "1 2 3", ends) == {"role": "assistant", "content": "1 2 3"}
    # with thinking on, the template writes the think block itself: a plain answer cannot be rendered back
    assert thinking.assistant_message(history, None, "1 2 3", ends) is None
    # the template strips the reasoning's newlines: an answer with an extra one would train other text
    assert thinking.assistant_message(history, None, "<think>\n\none two\n</think>\n\n1 2 3", ends) is None
    # cut mid-reasoning (no end token): the template closes the think block, which the target never wrote
    assert thinking.assistant_message(history, None, "<think>\none two", ends + ("",)) is None
    # and a turn must end with an end token the model declares
    assert off.assistant_message(history, None, "1 2 3", ("<|endoftext|>",)) is None


def test_a_generated_tool_call_is_stored_as_tool_calls_and_recognised(tok):
    from dflash_ray.data.supervision import Rendering

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "2+3?"}]
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    r = Rendering(tok, {"enable_thinking": False})
    assert r.assistant_message(history, tools, text, ("<|im_end|>",)) == {
        "role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert r.calls_a_tool(text) and r.calls_a_tool("<think>\nr\n</think>\n\n" + text)
    assert not r.calls_a_tool("<think>\nmaybe <tool_call> later\n</think>\n\nno") and not r.calls_a_tool("5")
    # a call that is not JSON stays the text it was: rendered back as is
    broken = "<tool_call>\n{add 2 3}\n</tool_call>"
    assert r.assistant_message(history, tools, broken, ("<|im_end|>",)) == {"role": "assistant", "content": broken}
