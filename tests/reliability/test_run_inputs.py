"""What a resume compares with the run's first start (record/run_inputs.py check_run_inputs, data/shards.py), and what
`dflash-ray export` does not: the shards' samples and tokens, whatever their file layout.

Same samples (sample_id, num_tokens, num_supervised) and tokens in other files (another shard size,
another writer, rows in another order): the resume goes on. A sample removed, a length changed, a token or
a loss-mask bit changed: one line, before anything trains. No Ray: resolve_spec is what refuses, and a
registered checkpoint is Ray Train's record of it (written here as Ray Train writes it)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray.cli import run_command
from dflash_ray.config import compose_config
from dflash_ray.data import shards as shards_module
from dflash_ray.data.shards import SUPERVISED, contents_digest, list_shards, samples_fingerprint, scan_shards
from dflash_ray.errors import UserError
from dflash_ray.runtime.training.checkpoint_format import cursor_metrics, write_checkpoint
from dflash_ray.runtime.stream.feed import Cursor
from dflash_ray.run_layout import RUN_INPUTS
from dflash_ray.runtime.spec import resolve_spec
from helpers_ray_train import register_with_ray_train


def _opt(args, key):
    return next(a.split("=", 1)[1] for a in args if a.startswith(key + "="))


def quiet(*a, **k):
    pass


def corpus(tiny_data) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in list_shards(_opt(tiny_data, "data.shards")))


def write_layout(table: pa.Table, directory: Path, files: int, seed: int, prefix: str = "part", **write) -> Path:
    """`table`'s rows shuffled into `files` shards (another writer's layout: names, sizes, row order)."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    rows = np.random.default_rng(seed).permutation(table.num_rows)
    for i, part in enumerate(np.array_split(rows, files)):
        pq.write_table(table.take(pa.array(part)), directory / f"{prefix}-{i:03d}.parquet", **write)
    return directory


def with_row(table: pa.Table, r: int, ids=None, mask=None) -> pa.Table:
    """Row r with other input_ids / loss_mask (num_tokens and num_supervised follow)."""
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    if ids is not None:
        cols["input_ids"][r] = ids
        cols["num_tokens"][r] = len(ids)
    if mask is not None:
        cols["loss_mask"][r] = mask
    cols[SUPERVISED][r] = int(sum(cols["loss_mask"][r][:cols["num_tokens"][r]]))
    cols["loss_mask"][r] = cols["loss_mask"][r][:cols["num_tokens"][r]]
    return pa.table(cols, schema=table.schema)


def swap_mask_bits(table: pa.Table) -> tuple[pa.Table, int]:
    """A row whose loss mask moves one supervised token (same num_supervised): only the tokens change."""
    for r, m in enumerate(table.column("loss_mask").to_pylist()):
        ones, zeros = [i for i, v in enumerate(m) if v], [i for i, v in enumerate(m) if not v]
        if ones and zeros:
            m = list(m)
            m[ones[0]], m[zeros[-1]] = 0, 1
            return with_row(table, r, mask=m), r
    raise AssertionError("no row with both 0 and 1 in its loss mask")


# ----------------------------------------------------------------------------- the fingerprints
def test_fingerprints_do_not_depend_on_the_file_layout(tiny_data, tmp_path):
    """One file vs 5 files in shuffled order, small row groups, no statistics: the same samples and
    contents digests (the files differ); one token or one loss-mask bit changed: the same samples (the
    plan does not move), other contents."""
    table = corpus(tiny_data)
    a = write_layout(table, tmp_path / "a", 1, seed=0)
    b = write_layout(table, tmp_path / "b", 5, seed=1, prefix="other", row_group_size=7, write_statistics=False)
    sa, sb = scan_shards(a, contents=True), scan_shards(b, contents=True)
    assert sa.files != sb.files and len(sb.files) == 5
    assert samples_fingerprint(sa.lengths) == samples_fingerprint(sb.lengths)
    assert sa.contents == sb.contents == contents_digest(b)

    ids = table.column("input_ids")[3].as_py()
    token = write_layout(with_row(table, 3, ids=[ids[1]] + ids[1:]), tmp_path / "t", 1, seed=0)
    masked, _ = swap_mask_bits(table)
    mask = write_layout(masked, tmp_path / "m", 1, seed=0)
    for changed in (token, mask):
        s = scan_shards(changed, contents=True)
        assert samples_fingerprint(s.lengths) == samples_fingerprint(sa.lengths) and s.contents != sa.contents
    shorter = write_layout(with_row(table, 3, ids=ids[:-1]), tmp_path / "l", 1, seed=0)
    assert samples_fingerprint(scan_shards(shorter).lengths)["digest"] != samples_fingerprint(sa.lengths)["digest"]


# ----------------------------------------------------------------------------- resume
@pytest.fixture
def first_run(tiny_data, tmp_path):
    """A run's first start on the tiny corpus laid out in 2 shards, then a checkpoint registered: the
    next resolve_spec of the same run.name resumes. Returns (args, shards dir, spec, corpus table)."""
    table = corpus(tiny_data)
    shards = write_layout(table, tmp_path / "shards", 2, seed=0)
    args = [f"run.root={tmp_path / 'runs'}", "run.name=r", *[a for a in tiny_data if not a.startswith("data.shards=")],
            f"data.shards={shards}"]
    spec = resolve_spec(compose_config(args), log=quiet)
    recorded = json.loads((Path(spec.run_dir) / RUN_INPUTS).read_text())["shards"]
    assert recorded["samples"] == table.num_rows and recorded["contents"] and len(recorded["files"]) == 2
    register_checkpoint(spec)
    return args, shards, spec, table


def register_checkpoint(spec, drafter=None) -> None:
    """The checkpoint registered by Ray Train's own code (what latest_checkpoint reads); with `drafter`, the
    checkpoint's files too (what export reads)."""
    exp = Path(spec.experiment_dir)
    cursor = Cursor(0, 2, 1)
    if drafter is not None:
        from dflash_ray.runtime.training.model import make_optimizer

        opt, sched = make_optimizer(spec.train, drafter, 10)
        write_checkpoint(exp / "checkpoint_x", drafter=drafter, optimizer=opt, scheduler=sched, cursor=cursor,
                         world_size=1)
    register_with_ray_train(exp, "checkpoint_x", {**cursor_metrics(cursor), "loss": 1.0})


def refused(args) -> str:
    with pytest.raises(UserError) as e:
        resolve_spec(compose_config(args), log=quiet)
    line = str(e.value)
    assert "\n" not in line
    return line


def tail(spec) -> str:
    return (f" (recorded in {spec.run_dir}/{RUN_INPUTS} at its first run); resuming its "
            "checkpoint with other data would not be exactly-once: restore the shards, or train them under a new "
            "run.name")


def test_resume_of_the_same_samples_in_another_layout_goes_on(first_run, tiny_data, monkeypatch):
    """The shards prepared again with another shard size (`dflash-ray prepare data.shard_size=10`: 7
    files instead of the 2 recorded): the resume goes on, reading the tokens once to see they are the same,
    and the record follows the new files; the next resume compares footers only (no token is read)."""
    args, shards, spec, _ = first_run
    shutil.rmtree(shards)
    assert run_command("prepare", [f"data.input={_opt(tiny_data, 'data.input')}",
                                   f"data.tokenizer={_opt(tiny_data, 'data.tokenizer')}", f"data.output={shards}",
                                   "data.shard_size=10"]) == 0
    assert len(list_shards(shards)) == 7
    said = []
    resolve_spec(compose_config(args), log=said.append)
    assert [line for line in said if line.startswith(str(shards))] == [
        f"{shards}: the shard files changed since run 'r' started (another layout, or rewritten), with "
        "the same 64 samples, lengths and tokens: resuming"]
    # and the run's two choices, printed at every start
    assert said[0] == "compute dtype: float32 (model.compute_dtype)" and said[-1].startswith("target features: online")
    assert len(json.loads((Path(spec.run_dir) / RUN_INPUTS).read_text())["shards"]["files"]) == 7

    def no_token_read(*a, **k):
        raise AssertionError("the tokens were read")

    monkeypatch.setattr(shards_module, "contents_digest", no_token_read)
    resolve_spec(compose_config(args), log=quiet)


@pytest.mark.parametrize("change", ["length", "removed", "token", "mask"])
def test_resume_refuses_other_samples_or_tokens_in_another_layout(change, first_run):
    """Re-written in 3 files, with one change: a sample one token shorter, a sample removed (the plan would
    differ), one token id or one loss-mask bit changed (same lengths: the run would train other data)."""
    args, shards, spec, table = first_run
    tokens, supervised = sum(table.column("num_tokens").to_pylist()), sum(table.column(SUPERVISED).to_pylist())
    ids = table.column("input_ids")[5].as_py()
    since = " since run 'r' started"
    if change == "length":
        table = with_row(table, 5, ids=ids[:-1])
        dropped = supervised - sum(table.column(SUPERVISED).to_pylist())
        what = f"the samples changed{since} ({tokens} -> {tokens - 1} tokens" + (
            f", {supervised} -> {supervised - 1} supervised" if dropped else "") + ")"
    elif change == "removed":
        gone = table.slice(5, 1)
        table = pa.concat_tables([table.slice(0, 5), table.slice(6)])
        n = gone.column("num_tokens")[0].as_py()
        s = gone.column(SUPERVISED)[0].as_py()
        what = (f"the samples changed{since} (64 -> 63 samples, {tokens} -> {tokens - n} tokens, "
                f"{supervised} -> {supervised - s} supervised)")
    else:
        table = with_row(table, 5, ids=[ids[0] + 1] + ids[1:]) if change == "token" else swap_mask_bits(table)[0]
        what = f"the tokens changed{since} (the same 64 samples with the same lengths, other input_ids or loss_mask)"
    write_layout(table, shards, 3, seed=4, prefix="other")
    assert refused(args) == f"{shards}: {what}{tail(spec)}"


def test_resume_names_the_shard_when_the_other_files_are_unchanged(first_run):
    """The recorded layout with one file changed (its tokens, same size and rows): that file is named."""
    args, shards, spec, _ = first_run
    path = list_shards(shards)[1]
    part = pq.read_table(path)
    ids = part.column("input_ids")[0].as_py()
    pq.write_table(with_row(part, 0, ids=[ids[0] + 1] + ids[1:]), path)
    name = Path(path).name
    line = refused(args)
    assert line.startswith(f"{shards}/{name}: shard changed ("), line
    assert line.endswith(" since run 'r' started" + tail(spec)), line


# ----------------------------------------------------------------------------- export
def test_export_does_not_read_the_shards(first_run, tmp_path, capsys):
    """A run with a checkpoint whose shards then changed (a sample removed) or are gone: training refuses
    to resume it, `dflash-ray export` writes its export all the same (a checkpoint and the drafter's shape
    are all it needs)."""
    import torch

    from dflash_ray.runtime.training.model import build_run_drafter

    args, shards, spec, table = first_run
    register_checkpoint(spec, build_run_drafter(spec, torch.device("cpu")))
    write_layout(table.slice(1), shards, 2, seed=0)
    assert refused(args).startswith(f"{shards}")
    for gone in (False, True):
        if gone:
            shutil.rmtree(shards)
        capsys.readouterr()
        assert run_command("export", args) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert out.strip() == f"exported {spec.experiment_dir}/checkpoint_x -> {spec.run_dir}/export", out
        assert (Path(spec.run_dir) / "export" / "model.safetensors").exists()


def test_a_run_recorded_by_the_earlier_per_file_check_is_compared_per_file(first_run):
    """run_inputs.json written before the samples' fingerprint existed (per file: bytes, rows, footer
    digest): the resume compares files as that check did (same files: resumes; one changed: its line)."""
    args, shards, spec, _ = first_run
    record = Path(spec.run_dir) / RUN_INPUTS
    inputs = json.loads(record.read_text())
    inputs["shards"] = {k: {f: v[f] for f in ("bytes", "rows", "footer")} for k, v in inputs["shards"]["files"].items()}
    record.write_text(json.dumps(inputs))
    resolve_spec(compose_config(args), log=quiet)
    path = list_shards(shards)[0]
    pq.write_table(pq.read_table(path).slice(1), path)
    assert refused(args).startswith(f"{shards}/{Path(path).name}: shard changed (")


# ----------------------------------------------------------------------------- file handles
def test_shard_reads_close_their_files(tmp_path):
    """Every read of the shards closes each file it opened when it is done with it, also when it stops on
    a bad shard: the exception (and its traceback, which a caller may keep) holds no open file, with the
    garbage collector off (with many s3 shards an unclosed handle is a connection)."""
    import gc
    import os

    from helpers_data import write_shard

    from dflash_ray.data.shards import check_token_range, read_lengths

    for i in range(10):
        write_shard(tmp_path / f"p{i}.parquet", range(10 * i, 10 * i + 10), [40] * 10)

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    kept = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = open_files()
        scan_shards(tmp_path, 1000, contents=True)
        contents_digest(tmp_path)
        assert open_files() == before
        write_shard(tmp_path / "p99.parquet", [5000], [40], vocab=100, num_tokens=pa.array(["x"]))
        for read in (read_lengths, lambda d: check_token_range(d, 10), lambda d: scan_shards(d, 1000)):
            with pytest.raises(UserError) as e:
                read(tmp_path)
            kept.append(e.value)          # the exception and its traceback stay alive ...
            assert open_files() == before, str(e.value)   # ... the files they came through are closed
    finally:
        if enabled:
            gc.enable()
