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
    ("model=qwen9", "config group 'model' has no option 'qwen9' (options: llama3_70b, llama3_8b, qwen3_30b_a3b, qwen3_8b, smollm2_135m, tiny)"),
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
    # the figures against the shard lengths and the rules (sharegpt: buckets (0,512] ... (3296,8192],
    # longer samples truncated to 8192, budget 16384 padded tokens, longest row first)
    bounds = [0, 512, 1024, 1536, 2304, 3296, 8192]
    cut = np.minimum(lengths, 8192)
    for b, r in enumerate(s["buckets"]):
        inside = (cut > bounds[b]) & (cut <= bounds[b + 1])
        assert (r["samples"], r["tokens"]) == (inside.sum(), cut[inside].sum()), b
        assert r["range"] == f"{bounds[b] + 1}-{bounds[b + 1]}"
    assert s["samples"]["truncated"] == (lengths > 8192).sum() and s["tokens"] == cut.sum()
    padded, per_bucket = 0, np.zeros(6, dtype=int)
    for b, members in zip(t.column("bucket").to_pylist(), t.column("sample_ids").to_pylist()):
        rows = cut[members]
        assert ((rows > bounds[b]) & (rows <= bounds[b + 1])).all()   # one bucket, the row's
        assert (np.diff(rows) <= 0).all() and rows.size * rows[0] <= 16384  # longest first, in budget
        padded += rows.size * rows[0]
        per_bucket[b] += 1
    assert [r["batches"] for r in s["buckets"]] == per_bucket.tolist()
    assert s["padded_tokens"] == padded and s["padding_efficiency"] == pytest.approx(cut.sum() / padded)
    # the order is in steps (the default cluster: 2 drafter workers x grad_accum 1): each bucket's whole steps,
    # and the buckets' leftover batches as steps of their own label
    assert s["step_batches"] == 2 and s["order"]["unit"] == "steps of 2 batches"
    units = np.append(per_bucket // 2, (per_bucket % 2).sum() // 2)
    units = units[units > 0] if units[-1] == 0 else units
    assert s["order"]["counts"] == units.tolist()
    assert s["order"]["longest_run"] == max(1, -(-units.max() // (units.sum() - units.max() + 1)))


# ----------------------------------------------------------------------------- figures derived by hand
def _table_rows(text: str) -> dict:
    """Rows of a whitespace-separated table, keyed by their first cell."""
    return {line.split()[0]: line.split()[1:] for line in text.strip().splitlines()}


def _measure_lines(text: str) -> dict:
    return {k.strip(): v.strip() for k, v in (line.split(" : ", 1) for line in text.splitlines() if " : " in line)}


def test_order_stats_figures_match_hand_computed_orders(capsys):
    # sequential on counts 3,1 is [0 0 0 1]. Quarters are single batches; the last quarter holds only
    # bucket 1 (share 1 vs 1/4): 75 pp. Prefix: after 3 batches bucket 1 has 0 of 3/4 expected: 0.75.
    # Runs [3][1]: longest 3, least possible ceil(3 / (1 + 1)) = 2; 1 of 4 batches in runs of 1.
    # Last batches: bucket 0 at position 3 of 4, bucket 1 at 4 of 4.
    assert run_command("order-stats", ["--counts", "3,1", "--strategy", "sequential"]) == 0
    m = _measure_lines(capsys.readouterr().out)
    assert m == {"quarter share, max deviation from global share": "75.000 pp",
                 "prefix discrepancy (batches)": "0.75",
                 "longest same-bucket run (least possible)": "3 (2)",
                 "batches in runs of 1": "25.0%",
                 "run-length histogram (length:runs)": "1:1, 3:1",
                 "last batch of each bucket (fraction of epoch)": "0.7500, 1.0000"}, m
    # default on 3,1 must split the 0s: [0 1 0 0] or [0 0 1 0]; either way quarters 75 pp, prefix 0.5,
    # longest run 2 (the least possible), 2 of 4 in runs of 1, bucket 1 ends at 2/4 or 3/4
    assert run_command("order-stats", ["--counts", "3,1", "--compare"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert rows["sequential"] == ["75.000", "0.75", "3", "25.0%", "0.7500"]
    assert rows["default"][:4] == ["75.000", "0.50", "2", "50.0%"] and rows["default"][4] in ("0.5000", "0.7500")
    # default on 2,2 alternates: every quarter is one batch (50 pp off the 1/2 shares), prefix 0.5,
    # all batches in runs of 1, the buckets end at 3/4 and 4/4
    assert run_command("order-stats", ["--counts", "2,2", "--json", "--seed", "4"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["counts"] == [2, 2] and m["batches"] == 4 and m["global_share"] == [0.5, 0.5]
    assert m["quarter_max_dev_pp"] == pytest.approx(50) and m["prefix_discrepancy"] == pytest.approx(0.5)
    assert m["longest_run"] == m["least_possible_longest_run"] == 1 and m["run_length_hist"] == {"1": 4}
    assert m["fraction_in_runs_of_1"] == 1.0 and sorted(m["last_batch_fraction"]) == [0.75, 1.0]
    assert m["earliest_bucket_end"] == 0.75


def test_order_stats_sequential_on_the_seed_run_counts(capsys):
    # bucket after bucket: the last bucket (19581 of 46703) starts at 27122 and fills the last quarter
    # (positions 35027-46702) alone; before it starts it lags 27122 * 19581 / 46703 batches behind
    counts = [2120, 4019, 5468, 7477, 8038, 19581]
    n = sum(counts)
    assert run_command("order-stats", ["--counts", ",".join(map(str, counts)), "--strategy", "sequential",
                                       "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["quarter_max_dev_pp"] == pytest.approx(100 * (1 - 19581 / n))
    assert m["prefix_discrepancy"] == pytest.approx((n - 19581) * 19581 / n)
    assert m["longest_run"] == 19581 and m["least_possible_longest_run"] == -(-19581 // (n - 19581 + 1)) == 1
    assert m["run_length_hist"] == {str(c): 1 for c in sorted(counts)} and m["fraction_in_runs_of_1"] == 0
    assert m["last_batch_fraction"] == pytest.approx(list(np.cumsum(counts) / n))
    assert m["earliest_bucket_end"] == pytest.approx(2120 / n)


# id: tokens. Boundaries [64, 128], budget 256 tokens, block_size 8 (samples need >= 16 tokens).
HAND_LENGTHS = {11: 64, 4: 60, 30: 50, 2: 40, 17: 33, 9: 20, 25: 17, 13: 16,   # bucket 0 (16-64)
                6: 300, 19: 120, 1: 100, 14: 90, 22: 70, 8: 66,                # bucket 1 (65-128; 300 over)
                3: 10, 27: 15}                                                 # too short: dropped
# Sorted longest first, each batch takes 256 // (its first row) rows:
#   bucket 0: 64 -> 4 rows [64 60 50 40]; 33 -> 7 rows [33 20 17 16]            tokens 300, padded 256 + 132
#   bucket 1: 300 truncated to 128 -> 2 rows [128 120]; 100 -> [100 90]; 70 -> [70 66]
#                                                                       tokens 574, padded 256 + 200 + 140
HAND_BATCHES = {(0, (11, 4, 30, 2)), (0, (17, 9, 25, 13)), (1, (6, 19)), (1, (1, 14)), (1, (22, 8))}
HAND_ARGS = ["data.bucket_boundaries=[64,128]", "data.max_tokens_per_batch=256", "model.block_size=8",
             "data.attention_tokens=0"]  # the token budget alone (the attention term: test_data_budgets.py)


def _hand_shards(root):
    ids = list(HAND_LENGTHS)
    write_shard(root / "s" / "a.parquet", ids[::2], [HAND_LENGTHS[i] for i in ids[::2]])
    write_shard(root / "s" / "b.parquet", ids[1::2], [HAND_LENGTHS[i] for i in ids[1::2]], seed=1)
    return [f"data.shards={root}/s", *HAND_ARGS]


def test_plan_command_figures_match_a_plan_made_by_hand(tmp_path, capsys):
    args = _hand_shards(tmp_path) + ["cluster.drafter_workers=1"]   # a step of one batch: the order in batches
    assert run_command("plan", args + ["--dump", str(tmp_path / "plan.parquet")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "epoch 0 plan (seed 0, strategy default): 5 batches, 874 tokens"
    assert lines[1] == "budgets per batch: target 256 padded tokens; drafter no bound beyond 64 anchors a row"
    assert lines[2] == ("samples: 16 in, 14 planned, 1 truncated, 0 dropped (over the last boundary), "
                        "2 dropped (too short), 0 dropped (fewer than 2 supervised tokens)")
    # bucket, range, samples, batches, tokens, share of batches, padding efficiency (300/388, 574/596) |
    # rows, target fill (padded / 256), target cost (padded / the mean batch's 984 / 5) |
    # anchors (no supervised counts in these shards: every token; min(64, length - 1) per row), block
    # tokens (x 8), drafter fill (no anchors_per_batch), density (anchors trained / valid anchors), block
    # tokens per context token (bucket 0: 2 x 1168 / 300 = 7.79; bucket 1: 3 x 1024 / 574 = 5.35)
    #   bucket 0: [63 59 49 39] = 210, [32 19 16 15] = 82 -> 146, all valid ones; padded 256, 132
    #   bucket 1: valid [127 119], [99 89], [69 65] (568), each row capped at 64 -> 128 per batch,
    #             density 384 / 568 = 0.676; padded 256, 200, 140
    bar = lines[4].split("|")
    assert bar[0].split() == ["0", "1-64", "8", "2", "300", "40.0%", "0.773"]
    assert bar[1].split() == ["4.0", "0.758", "0.986"] and bar[2].split() == ["146", "1168", "-", "1.000", "7.79"]
    bar = lines[5].split("|")
    assert bar[0].split() == ["1", "65-128", "6", "3", "574", "60.0%", "0.963"]
    assert bar[1].split() == ["2.0", "0.776", "1.009"] and bar[2].split() == ["128", "1024", "-", "0.676", "5.35"]
    assert lines[6] == "padding efficiency (real / padded batch tokens): 0.8882"  # 874 / 984
    # 2 batches of bucket 0 and 3 of bucket 1 with no bucket twice in a row: only 1 0 1 0 1. Quarters of
    # 5 positions are [0,1) [1,2) [2,4) [4,5): [1] [0] [1 0] [1], the worst 60 pp off the 0.4/0.6 shares
    m = _measure_lines(out)
    assert m["quarter share, max deviation from global share"] == "60.000 pp"
    assert m["prefix discrepancy (batches)"] == "0.40"
    assert m["longest same-bucket run (least possible)"] == "1 (1)"
    assert m["run-length histogram (length:runs)"] == "1:5"
    assert m["last batch of each bucket (fraction of epoch)"] == "0.8000, 1.0000"
    t = pq.read_table(tmp_path / "plan.parquet")
    assert t.column("position").to_pylist() == [0, 1, 2, 3, 4]
    assert t.column("bucket").to_pylist() == [1, 0, 1, 0, 1]
    assert set(zip(t.column("bucket").to_pylist(), map(tuple, t.column("sample_ids").to_pylist()))) == HAND_BATCHES


def test_plan_of_two_workers_orders_whole_steps_of_one_bucket(tmp_path, capsys):
    # the same 5 batches, 2 a step (2 drafter workers): bucket 0's two batches make one step, bucket 1's
    # first two another, and its third, left over, is the epoch's last (partial) step: [a a b b 1] in steps
    args = _hand_shards(tmp_path) + ["cluster.drafter_workers=2", "--json", "--dump", str(tmp_path / "plan.parquet")]
    assert run_command("plan", args) == 0
    s = json.loads(capsys.readouterr().out)
    buckets = pq.read_table(tmp_path / "plan.parquet").column("bucket").to_pylist()
    assert buckets in ([0, 0, 1, 1, 1], [1, 1, 0, 0, 1])
    assert s["order"]["unit"] == "steps of 2 batches" and s["order"]["counts"] == [1, 1]
    assert s["order"]["longest_run"] == 1


def test_plan_command_json_with_overlong_samples_dropped(tmp_path, capsys):
    # data.overlong=drop: the 300-token sample goes; bucket 1 is [120 100] [90 70] [66]
    args = _hand_shards(tmp_path) + ["data.overlong=drop", "--json", "--dump", str(tmp_path / "plan.parquet")]
    assert run_command("plan", args) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["samples"] == {"in": 16, "kept": 13, "truncated": 0, "dropped_overlong": 1, "dropped_too_short": 2,
                            "dropped_unsupervised": 0}
    assert (s["batches"], s["tokens"], s["padded_tokens"]) == (5, 300 + 446, 388 + 240 + 180 + 66)
    assert [(r["samples"], r["batches"], r["tokens"]) for r in s["buckets"]] == [(8, 2, 300), (5, 3, 446)]
    assert s["padding_efficiency"] == pytest.approx(746 / 874)
    t = pq.read_table(tmp_path / "plan.parquet")
    got = set(zip(t.column("bucket").to_pylist(), map(tuple, t.column("sample_ids").to_pylist())))
    assert got == {(0, (11, 4, 30, 2)), (0, (17, 9, 25, 13)), (1, (19, 1)), (1, (14, 22)), (1, (8,))}
