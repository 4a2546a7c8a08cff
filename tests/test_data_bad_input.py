"""Bad shards: exit code 2 and one line naming the file (and row, "row N (0-based)": the index pyarrow gives
it) and what is wrong; never a hang."""
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from helpers_data import corrupt_column_pages, write_shard

from dflash_ray.cli import run_command


def _plan(shards, capsys, *extra):
    rc = run_command("plan", [f"data.shards={shards}", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def _good(tmp_path, name="a.parquet", ids=range(40), seed=0):
    return write_shard(tmp_path / "s" / name, list(ids), [80] * len(list(ids)), seed=seed)


CASES = {
    "corrupt": lambda d: (d / "bad.parquet").write_bytes(b"PAR1 this is not parquet"),
    "missing_column": lambda d: write_shard(d / "bad.parquet", [900], [80]) and _drop(d / "bad.parquet", "num_tokens"),
    "mistyped_column": lambda d: write_shard(d / "bad.parquet", [900], [80], num_tokens=pa.array(["80"])),
    "negative_length": lambda d: write_shard(d / "bad.parquet", [900, 901], [80, 80], num_tokens=pa.array([80, -1], pa.int32())),
    "duplicate_id": lambda d: write_shard(d / "bad.parquet", [900, 5], [80, 80]),
    "empty_shard": lambda d: write_shard(d / "bad.parquet", [], []),
}
EXPECT = {
    "corrupt": "bad.parquet: not a readable parquet file",
    "missing_column": "bad.parquet: missing column 'num_tokens'",
    "mistyped_column": "bad.parquet: column 'num_tokens' has type string",
    "negative_length": "bad.parquet: row 1 (0-based): negative num_tokens",
    "duplicate_id": "bad.parquet: row 1 (0-based): duplicate sample_id 5 (first seen in",
    "empty_shard": "bad.parquet: empty shard (0 rows)",
}


def _drop(path, column):
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(path).drop_columns([column]), path)
    return True


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_rejects_bad_shards_with_one_line(case, tmp_path, capsys):
    _good(tmp_path)
    CASES[case](tmp_path / "s")
    rc, err = _plan(tmp_path / "s", capsys)
    assert rc == 2 and len(err) == 1, err
    assert EXPECT[case] in err[0], err[0]


@pytest.mark.parametrize("case,expect", [
    ("negative_token", "row 2 (0-based): negative token id"),
    ("oov_token", "row 1 (0-based): token id 500 is out of vocabulary (size 100)"),
    ("length_mismatch", "row 0 (0-based): input_ids has 80 tokens but loss_mask has 79"),
    ("num_tokens_mismatch", "row 3 (0-based): num_tokens is 81 but input_ids has 80 tokens"),
])
def test_token_checks_name_the_row(case, expect, tmp_path, capsys):
    _good(tmp_path)
    ids = [np.full(80, 7, np.int32) for _ in range(4)]
    masks = [np.ones(80, np.int8) for _ in range(4)]
    nt = [80] * 4
    if case == "negative_token":
        ids[2][5] = -3
    if case == "oov_token":
        ids[1][0] = 500
    if case == "length_mismatch":
        masks[0] = masks[0][:79]
    if case == "num_tokens_mismatch":
        nt[3] = 81
    write_shard(tmp_path / "s" / "bad.parquet", [100, 101, 102, 103], [80] * 4,
                input_ids=pa.array(ids, pa.list_(pa.int32())), loss_mask=pa.array(masks, pa.list_(pa.int8())),
                num_tokens=pa.array(nt, pa.int32()))
    rc, err = _plan(tmp_path / "s", capsys, "--check", "data.vocab_size=100")
    assert rc == 2 and len(err) == 1
    assert "bad.parquet: " + expect in err[0], err[0]


def test_missing_and_empty_directories(tmp_path, capsys):
    rc, err = _plan(tmp_path / "nope", capsys)
    assert rc == 2 and err == [f"dflash-ray plan: error: {tmp_path / 'nope'}: shard directory does not exist"]
    (tmp_path / "empty").mkdir()
    rc, err = _plan(tmp_path / "empty", capsys)
    assert rc == 2 and "no .parquet shards" in err[0]


def test_console_script_exit_code_and_debug_traceback(tmp_path):
    exe = [sys.executable, "-m", "dflash_ray", "plan", f"data.shards={tmp_path}/missing"]
    r = subprocess.run(exe, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = subprocess.run(exe + ["--debug"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.parametrize("column,values,expect", [
    ("sample_id", pa.array([900, None], pa.int64()), "row 1 (0-based): null sample_id"),
    ("num_tokens", pa.array([None, 80], pa.int32()), "row 0 (0-based): null num_tokens"),
])
def test_null_values_are_named(column, values, expect, tmp_path, capsys):
    _good(tmp_path)
    write_shard(tmp_path / "s" / "bad.parquet", [900, 901], [80, 80], **{column: values})
    rc, err = _plan(tmp_path / "s", capsys)
    assert rc == 2 and len(err) == 1 and "bad.parquet: " + expect in err[0], err


def test_plan_checks_the_whole_schema_without_reading_tokens(tmp_path, capsys):
    _good(tmp_path)
    path = write_shard(tmp_path / "s" / "bad.parquet", [900], [80])
    _drop(path, "loss_mask")
    rc, err = _plan(tmp_path / "s", capsys)
    assert rc == 2 and "bad.parquet: missing column 'loss_mask'" in err[0]


@pytest.mark.parametrize("columns", [("input_ids", "loss_mask"), ("input_ids",), ("loss_mask",)])
def test_plan_reads_only_sample_id_and_num_tokens_and_check_reads_the_token_columns(columns, tmp_path, capsys):
    # token pages that cannot be decoded: plan (2 columns read) does not notice; plan --check must
    _good(tmp_path)
    corrupt_column_pages(write_shard(tmp_path / "s" / "tok.parquet", range(100, 130), [90] * 30, seed=1), columns)
    rc = run_command("plan", [f"data.shards={tmp_path / 's'}", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    s = json.loads(out)
    assert s["samples"]["kept"] == 70 and s["tokens"] == 40 * 80 + 30 * 90
    rc, err = _plan(tmp_path / "s", capsys, "--check")
    assert rc == 2 and len(err) == 1 and "tok.parquet: unreadable data" in err[0], err


def test_nothing_left_to_plan_is_one_clear_line(tmp_path, capsys):
    write_shard(tmp_path / "s" / "a.parquet", [1, 2], [5, 6])
    rc, err = _plan(tmp_path / "s", capsys)
    assert rc == 2 and len(err) == 1 and "no samples left to plan: 2 in, 2 shorter than 16 tokens" in err[0], err


def test_unwritable_output_paths_exit_2(tmp_path, capsys):
    _good(tmp_path)
    (tmp_path / "file").write_text("x")
    rc, err = _plan(tmp_path / "s", capsys, "--dump", str(tmp_path / "file" / "plan.parquet"))
    assert rc == 2 and len(err) == 1 and f"{tmp_path / 'file'}: " in err[0], err
    rc = run_command("order-stats", ["--counts", "3,,4"])
    assert rc == 2 and "--counts" in capsys.readouterr().err
