"""Config composition, Hydra override grammar, and the CLI surface of the data plane."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers_data import realistic_lengths, write_shard

from dflash_ray.cli import main, run_command
from dflash_ray.config import compose_config
from dflash_ray.errors import UserError


def test_cfg_job_prints_the_composed_resolved_config(capsys):
    rc = run_command("plan", ["--cfg", "job", "model=qwen3_8b", "train.lr=3e-4", "+extra.note=hi",
                              "++data.shard_size=7", "data.bucket_boundaries=[64,128]", "run.name=r1"])
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert rc == 0
    assert cfg["model"]["name"] == "qwen3_8b" and cfg["model"]["num_draft_layers"] == 5
    assert cfg["train"]["lr"] == 3e-4 and cfg["extra"] == {"note": "hi"}
    assert cfg["data"]["shard_size"] == 7 and cfg["data"]["bucket_boundaries"] == [64, 128]
    assert cfg["run"]["dir"] == "runs/r1" and cfg["data"]["shards"] == "runs/r1/shards"  # interpolations resolved


def test_delete_and_nested_values():
    cfg = compose_config(["~model.target_config.rope_theta", "+model.target_config.extra={a: 1, b: [1, 2]}"])
    assert "rope_theta" not in cfg.model.target_config
    assert cfg.model.target_config.extra.b == [1, 2]


@pytest.mark.parametrize("override,expect", [
    ("train.lrr=1", "unknown config key 'train.lrr' (did you mean 'train.lr'?)"),
    ("trian.epochs=2", "unknown config key 'trian.epochs' (did you mean 'train.epochs'?)"),
    ("train.lr=fast", "config key 'train.lr': Value 'fast' of type 'str' could not be converted to Float"),
    ("cluster.drafter_workers=two", "config key 'cluster.drafter_workers'"),
    ("model=qwen9", "config group 'model' has no option 'qwen9' (options: qwen3_8b, tiny)"),
    ("data.interleave=zigzag", "config key 'data.interleave': 'zigzag' is not one of"),
])
def test_bad_overrides_exit_2_with_one_line_naming_the_key(override, expect, capsys):
    rc = run_command("plan", ["--cfg", "job", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert expect in err[0], err[0]


def test_unknown_command_and_missing_required_value(capsys):
    assert main(["frobnicate"]) == 2
    with pytest.raises(UserError, match="data.input"):
        from dflash_ray.config import require

        require(compose_config(["data=sharegpt"]), "data.input")


def test_order_stats_compare_json_dump_and_plot(tmp_path, capsys):
    counts = "2120,4019,5468,7477,8038,19581"
    assert run_command("order-stats", ["--counts", counts, "--compare"]) == 0
    table = capsys.readouterr().out
    for name in ("default", "stride", "sequential", "random", "diversity"):
        assert name in table
    assert run_command("order-stats", ["--counts", counts, "--strategy", "stride", "--seed", "2", "--json",
                                       "--dump-order", str(tmp_path / "o.npy"), "--plot", str(tmp_path / "o.png")]) == 0
    m = json.loads(capsys.readouterr().out)
    order = np.load(tmp_path / "o.npy")
    assert m["batches"] == order.size == 46703 and np.bincount(order).tolist() == [2120, 4019, 5468, 7477, 8038, 19581]
    assert (tmp_path / "o.png").stat().st_size > 10_000
    assert run_command("order-stats", ["--counts", "3,x"]) == 2


def test_plan_command_table_json_and_atomic_dump(tmp_path, capsys):
    lengths = realistic_lengths(3000, seed=9)
    write_shard(tmp_path / "s" / "a.parquet", np.arange(3000), lengths)
    args = [f"data.shards={tmp_path}/s", "data=sharegpt", "data.input=x", "data.tokenizer=y"]
    assert run_command("plan", args) == 0
    out = capsys.readouterr().out
    assert "padding efficiency" in out and "prefix discrepancy" in out and "bucket" in out
    assert run_command("plan", args + ["--json", "--dump", str(tmp_path / "plan.parquet")]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["samples"]["kept"] == 3000 and len(s["buckets"]) == 6
    assert sum(r["batches"] for r in s["buckets"]) == s["batches"]
    t = pq.read_table(tmp_path / "plan.parquet")
    assert t.column_names == ["position", "bucket", "sample_ids"]
    assert t.schema.field("sample_ids").type.value_type == pa.int64() and str(t.schema.field("bucket").type) == "int32"
    assert t.num_rows == s["batches"] and not list(tmp_path.glob(".plan.parquet.tmp*"))
    assert sorted(np.concatenate(t.column("sample_ids").to_pylist())) == list(range(3000))
