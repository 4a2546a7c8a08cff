"""`prepare` as a Ray Data job (data.prepare_engine=ray) writes the same samples and counts as the
single-process path, on a real local Ray."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_data import make_tokenizer

from dflash_ray.cli import run_command
from dflash_ray.data.shards import iter_validated, list_shards

pytestmark = pytest.mark.slow  # two Ray Data jobs: ~1 minute here


def _rows(directory):
    table = pa.concat_tables([t for _, t in iter_validated(directory)]).sort_by("sample_id")
    return table.to_pylist()


def test_ray_prepare_equals_the_local_one(ray_session, tmp_path, capsys):
    corpus, tokdir = make_tokenizer(tmp_path)           # 120 conversations in the project's own format
    data = tmp_path / "in"
    data.mkdir()
    lines = corpus.read_text().splitlines()
    lines[7] = "{broken"
    (data / "a.jsonl").write_text("\n".join(lines[:70]) + "\n")
    sharegpt = [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                   for m in json.loads(line)["conversations"] if m["role"] != "system"]}
                for line in lines[70:]]
    pq.write_table(pa.Table.from_pylist(sharegpt), data / "b.parquet", row_group_size=8)
    common = [f"data.input={data}", f"data.tokenizer={tokdir}", "model.block_size=4", "data.on_bad_row=skip",
              "data.shard_size=16", "data.heldout_fraction=0.1", "--json"]
    assert run_command("prepare", common + [f"data.output={tmp_path / 'local'}"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert run_command("prepare", common + [f"data.output={tmp_path / 'ray'}", "data.prepare_engine=ray",
                                            "data.prepare_rows_per_task=16"]) == 0
    on_ray = json.loads(capsys.readouterr().out)
    for key in ("conversations", "samples", "tokens", "supervised_tokens", "dropped", "untrusted_turns", "bad_rows",
                "heldout"):
        assert on_ray[key] == local[key], key
    assert local["bad_rows"]["counts"] == {"malformed_json": 1} and local["samples"] > 100
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
    # the same held-out slice (by conversation id) on both engines, never in the shards
    assert local["heldout"] > 0
    assert (tmp_path / "ray" / "heldout.jsonl").read_bytes() == (tmp_path / "local" / "heldout.jsonl").read_bytes()
    assert all(p.rsplit("/", 1)[-1].startswith("part-") for p in list_shards(tmp_path / "ray"))


def test_ray_prepare_fails_on_a_bad_row_with_the_same_one_line(ray_session, tmp_path, capsys):
    corpus, tokdir = make_tokenizer(tmp_path)
    lines = corpus.read_text().splitlines()
    lines[30] = "[1, 2]"
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc = run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path / 'o'}",
                                 "data.prepare_engine=ray", "data.prepare_rows_per_task=10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].endswith("c.jsonl: line 31: row is a JSON list, not an object"), err
    assert not (tmp_path / "o").exists()
    # a whole-file problem found inside a task is the driver's one line too, not a Ray task error
    pq.write_table(pa.table({"text": ["no conversation here"]}), tmp_path / "plain.parquet")
    rc = run_command("prepare", [f"data.input={tmp_path / 'plain.parquet'}", f"data.tokenizer={tokdir}",
                                 f"data.output={tmp_path / 'p'}", "data.prepare_engine=ray"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].endswith("plain.parquet: no 'messages' or 'conversations' column (columns: text)"), err
