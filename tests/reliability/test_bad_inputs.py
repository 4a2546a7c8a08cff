"""Bad input beyond the planner: each case ends in exit code 2 and ONE line on stderr naming
the file, row or key (or a counted skip), before any training starts. Real shards, tokenizers and HF
models built from configs; the train command runs against the session's Ray (`ray_session`), which only
the cluster-size case needs: the others fail in resolve_spec, which main_job calls inside the cluster."""
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_data import write_shard

from dflash_ray.cli import run_command
from dflash_ray.config import compose_config
from dflash_ray.data.shards import SUPERVISED
from dflash_ray.runtime.training.checkpoint_format import cursor_metrics
from dflash_ray.runtime.stream.feed import Cursor
from dflash_ray.run_layout import RUN_INPUTS
from dflash_ray.runtime.spec import resolve_spec
from helpers_ray_train import forget_checkpoints, register_with_ray_train


def _opt(args, key):
    return next(a.split("=", 1)[1] for a in args if a.startswith(key + "="))


def _run(cmd, args, capsys):
    capsys.readouterr()  # what the test's own setup printed
    rc = run_command(cmd, [str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.err.strip().splitlines(), out.out


def _one_line(rc, err, cmd="train"):
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"dflash-ray {cmd}: error: "), err[0]
    return err[0][len(f"dflash-ray {cmd}: error: "):]


def _with(args, **values):
    """tiny_data's overrides with some replaced (keys with dots given as __)."""
    values = {k.replace("__", "."): v for k, v in values.items()}
    return [a for a in args if a.split("=", 1)[0] not in values] + [f"{k}={v}" for k, v in values.items()]


@pytest.fixture
def run_args(tiny_data, tmp_path):
    return [f"run.root={tmp_path / 'runs'}", "run.name=r", *tiny_data]


def _synthetic_target(out, vocab, **changes):
    from dflash_ray.model.target import build_synthetic_target

    fields = dict(compose_config([]).model.target_config)
    fields.update(changes)
    return Path(build_synthetic_target(fields, vocab, str(out), seed=0))


@pytest.fixture(scope="module")
def other_tokenizer(tiny_data, tmp_path_factory):
    """A tokenizer trained on the same corpus with a larger vocabulary (more tokens than the tiny
    target's 512), and the corpus prepared into shards with it."""
    from transformers import AutoTokenizer

    from dflash_ray.data.synthetic import train_tokenizer

    root = tmp_path_factory.mktemp("other_tokenizer")
    tok = train_tokenizer(_opt(tiny_data, "data.input"), root / "tokenizer", vocab_size=2048)
    assert len(AutoTokenizer.from_pretrained(str(tok))) > 512
    assert run_command("prepare", [f"data.input={_opt(tiny_data, 'data.input')}", f"data.tokenizer={tok}",
                                   f"data.output={root / 'shards'}"]) == 0
    return tok, root / "shards"


# ----------------------------------------------------------------------------- 1. token ids vs the target
@pytest.mark.parametrize("statistics", [True, False], ids=["footer-stats", "no-stats"])
def test_train_refuses_shards_of_another_tokenizer_naming_file_row_and_vocab(
        statistics, other_tokenizer, run_args, tmp_path, ray_session, capsys):
    _, prepared = other_tokenizer
    shard = (tmp_path / "shards" / "part-00000.parquet").resolve()
    shard.parent.mkdir()
    table = pq.read_table(prepared / "part-00000.parquet")
    pq.write_table(table, shard, write_statistics=statistics)
    stats = pq.ParquetFile(shard).metadata.row_group(0).column(1).statistics
    assert (stats is not None and stats.has_min_max) == statistics   # no-stats: the scan reads the ids
    row, token = next((r, t) for r, ids in enumerate(table.column("input_ids").to_pylist()) for t in ids if t >= 512)
    target = _opt(run_args, "model.target_path")

    rc, err, _ = _run("train", _with(run_args, data__shards=shard.parent), capsys)
    assert _one_line(rc, err) == (f"{shard}: row {row} (0-based): token id {token} is out of vocabulary (size 512) of the "
                                  f"target at {Path(target).resolve()}: were the shards prepared with another "
                                  "tokenizer?")


def test_token_scan_reads_only_footers_when_ids_are_in_range(tiny_data, tmp_path):
    """The cheap check: with footer statistics no token data is read (a shard whose token pages are
    garbage passes it; the full per-row validation happens when training reads the tokens)."""
    from helpers_data import corrupt_column_pages

    from dflash_ray.data.shards import check_token_range

    src = Path(_opt(tiny_data, "data.shards")) / "part-00000.parquet"
    shutil.copy(src, tmp_path / "a.parquet")
    corrupt_column_pages(tmp_path / "a.parquet", ["input_ids"])
    assert check_token_range(tmp_path, 512) == pq.ParquetFile(src).metadata.row_group(0).column(1).statistics.max


# ----------------------------------------------------------------------------- 2. unsupervised samples
def test_plan_counts_and_drops_samples_without_supervised_tokens(tiny_data, tmp_path, capsys):
    shards = tmp_path / "shards"
    shutil.copytree(_opt(tiny_data, "data.shards"), shards)
    n = 40
    masks = [np.zeros(n, np.int8), np.zeros(n, np.int8), np.r_[np.zeros(n - 1, np.int8), np.ones(1, np.int8)]]
    write_shard(shards / "unsupervised.parquet", [10_000, 10_001, 10_002], [n] * 3, vocab=512,
                loss_mask=pa.array(masks, pa.list_(pa.int8())),
                **{SUPERVISED: pa.array([int(m.sum()) for m in masks], pa.int32())})
    args = _with(tiny_data, data__shards=shards)

    rc, err, out = _run("plan", ["--json", *args], capsys)
    assert rc == 0, err
    samples = json.loads(out)["samples"]
    assert samples["dropped_unsupervised"] == 3 and samples["in"] == 64 + 3, samples
    rc, err, out = _run("plan", ["--check", *args], capsys)     # the shard is valid: counted, not an error
    assert rc == 0, err
    assert ", 3 dropped (fewer than 2 supervised tokens)" in out, out


# ----------------------------------------------------------------------------- 3. shards changed between runs
def _split_shards(args, shards: Path) -> None:
    table = pq.read_table(Path(_opt(args, "data.shards")) / "part-00000.parquet")
    shards.mkdir(parents=True)
    pq.write_table(table.slice(0, 32), shards / "a.parquet")
    pq.write_table(table.slice(32), shards / "b.parquet")


def _register_checkpoint(spec) -> None:
    """A checkpoint registered by Ray Train's own code (what latest_checkpoint reads)."""
    register_with_ray_train(spec.experiment_dir, "checkpoint_x", {**cursor_metrics(Cursor(0, 2, 1)), "loss": 1.0})


@pytest.mark.parametrize("fault", ["rewritten", "removed"])
def test_resume_refuses_shards_changed_since_the_first_run(fault, run_args, tmp_path, ray_session, capsys):
    shards = (tmp_path / "shards").resolve()
    _split_shards(run_args, shards)
    args = _with(run_args, data__shards=shards)
    spec = resolve_spec(compose_config(args), log=lambda *a, **k: None)    # the first run, before a checkpoint
    recorded = json.loads((Path(spec.run_dir) / RUN_INPUTS).read_text())
    assert sorted(recorded["shards"]["files"]) == ["a.parquet", "b.parquet"]
    _register_checkpoint(spec)
    resolve_spec(compose_config(args), log=lambda *a, **k: None)             # same shards: resumes
    size = (shards / "b.parquet").stat().st_size

    if fault == "rewritten":   # one sample less: the plan, and so every cursor, would differ
        pq.write_table(pq.read_table(shards / "b.parquet").slice(1), shards / "b.parquet")
        name, what = "b.parquet", f"changed ({size} -> {(shards / 'b.parquet').stat().st_size} bytes, 32 -> 31 rows)"
    else:
        (shards / "a.parquet").unlink()
        name, what = "a.parquet", "removed"
    rc, err, _ = _run("train", args, capsys)
    assert _one_line(rc, err) == (
        f"{shards}/{name}: shard {what} since run 'r' started (recorded in {spec.run_dir}/{RUN_INPUTS} at its "
        "first run); resuming its checkpoint with other data would not be exactly-once: restore the shards, "
        "or train them under a new run.name")

    forget_checkpoints(spec.experiment_dir)                                   # no checkpoint: a fresh run
    resolve_spec(compose_config(args), log=lambda *a, **k: None)
    assert len(json.loads((Path(spec.run_dir) / RUN_INPUTS).read_text())["shards"]["files"]) == (2 if fault == "rewritten" else 1)


def test_resume_refuses_another_plan_config(run_args, tmp_path, ray_session, capsys):
    # the plan is a function of the config's plan keys and the seed too: a cursor into the old plan
    args = _with(run_args, run__root=tmp_path / "plancfg")
    spec = resolve_spec(compose_config(args), log=lambda *a, **k: None)
    _register_checkpoint(spec)
    resolve_spec(compose_config(args), log=lambda *a, **k: None)             # same config: resumes
    budget = spec.plan.max_tokens_per_batch
    rc, err, _ = _run("train", [*args, f"data.max_tokens_per_batch={budget * 2}"], capsys)
    assert _one_line(rc, err) == (
        f"config key 'data.max_tokens_per_batch': run 'r' planned its batches with {budget}, this config gives "
        f"{budget * 2} (recorded in {spec.run_dir}/{RUN_INPUTS} at its first run); resuming its checkpoint under "
        "another plan would not be exactly-once: set it back, or train under a new run.name")
    rc, err, _ = _run("train", [*args, "seed=7"], capsys)
    assert "config key 'seed': run 'r' planned its batches with 0, this config gives 7" in _one_line(rc, err)
    # a step's batches share a bucket (data/plan.py step_order): another step width is another order
    w = spec.plan.step_batches
    rc, err, _ = _run("train", [*args, "train.grad_accum=2", f"cluster.max_batches_in_flight={4 * w}"], capsys)
    assert (f"config key 'cluster.drafter_workers x train.grad_accum': run 'r' planned its batches with {w}, "
            f"this config gives {2 * w}") in _one_line(rc, err)


# ----------------------------------------------------------------------------- 4. the target and the cluster
@pytest.mark.parametrize("ids", ["[0,6]", "[-1,2]", "[]"])
def test_target_layer_ids_out_of_range(ids, run_args, ray_session, capsys):
    rc, err, _ = _run("train", [*run_args, f"model.target_layer_ids={ids}"], capsys)
    shown = "[" + ", ".join(ids.strip("[]").split(",")) + "]" if ids != "[]" else "[]"
    assert _one_line(rc, err) == (f"config key 'model.target_layer_ids': {shown} out of range for a 6-layer "
                                  "target (ids 0..5, at least one)")


def test_target_without_weights(run_args, tmp_path, ray_session, capsys):
    target = tmp_path / "no_weights"
    target.mkdir()
    shutil.copy(Path(_opt(run_args, "model.target_path")) / "config.json", target)
    rc, err, _ = _run("train", _with(run_args, model__target_path=target), capsys)
    assert _one_line(rc, err) == (f"{target.resolve()}: no model.safetensors or model.safetensors.index.json "
                                  "(config.json but no weights) (config key 'model.target_path')")


def test_sharded_target_with_a_weight_file_missing(run_args, tmp_path, ray_session, capsys):
    from transformers import AutoModelForCausalLM

    target = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(_opt(run_args, "model.target_path")).save_pretrained(
        target, max_shard_size="100KB")
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    (target / files[-1]).unlink()
    rc, err, _ = _run("train", _with(run_args, model__target_path=target), capsys)
    assert _one_line(rc, err) == (f"{target.resolve()}: model.safetensors.index.json names {files[-1]}, which is "
                                  "missing (config key 'model.target_path')")


def test_target_config_without_model_type(run_args, tmp_path, ray_session, capsys):
    target = _synthetic_target(tmp_path / "t", 512)
    config = json.loads((target / "config.json").read_text())
    del config["model_type"]
    (target / "config.json").write_text(json.dumps(config))
    rc, err, _ = _run("train", _with(run_args, model__target_path=target), capsys)
    assert _one_line(rc, err) == (f"{target.resolve()}/config.json: not a usable model config (Unrecognized model "
                                  f"in {target.resolve()}. Should have a `model_type` key in its config.json.) "
                                  "(config key 'model.target_path')")


def test_target_vocabulary_smaller_than_the_tokenizer(other_tokenizer, run_args, ray_session, capsys):
    from transformers import AutoTokenizer

    tok, _ = other_tokenizer
    rc, err, _ = _run("train", _with(run_args, data__tokenizer=tok), capsys)
    assert _one_line(rc, err) == (f"{tok}: tokenizer has {len(AutoTokenizer.from_pretrained(str(tok)))} tokens but "
                                  "the target's vocabulary is 512 (config key 'model.target_path')")


@pytest.fixture
def export_of_tiny(run_args, tmp_path):
    """An exported drafter of the tiny target (hidden size 64), as `dflash-ray export` writes one."""
    from transformers import AutoConfig

    from dflash_ray.model.drafter import build_drafter
    from dflash_ray.model.export import export_drafter
    from dflash_ray.model.target import load_embed_and_head

    spec = resolve_spec(compose_config(run_args), log=lambda *a, **k: None)
    drafter = build_drafter(spec.drafter, AutoConfig.from_pretrained(spec.target_path),
                            *load_embed_and_head(spec.target_path), seed=0)
    return spec, Path(export_drafter(drafter, str(tmp_path / "export")))


def test_init_from_an_export_of_another_target(export_of_tiny, run_args, tmp_path, ray_session, capsys):
    _, export = export_of_tiny
    other = _synthetic_target(tmp_path / "narrow", 512, hidden_size=32)
    rc, err, _ = _run("train", _with(run_args, model__target_path=other, model__init_from=export), capsys)
    assert _one_line(rc, err) == (f"config key 'model.init_from': the export at {export.resolve()} does not match "
                                  "this run's drafter (export vs run): hidden_size 64 != 32")


def test_resume_refuses_a_checkpoint_of_another_target(export_of_tiny, run_args, tmp_path, ray_session, capsys):
    spec, _ = export_of_tiny            # the first run (on the tiny target) recorded its drafter
    _register_checkpoint(spec)
    other = _synthetic_target(tmp_path / "narrow", 512, hidden_size=32)
    rc, err, _ = _run("train", _with(run_args, model__target_path=other), capsys)
    assert _one_line(rc, err) == (
        f"config key 'model.target_path': run 'r' has a checkpoint of a drafter with hidden_size 64 but this "
        f"config gives hidden_size 32 (target {spec.target_path} then, {other.resolve()} now) (recorded in "
        f"{spec.run_dir}/{RUN_INPUTS} at its first run): use a new run.name (model.init_from can start it from "
        "this run's export)")


@pytest.mark.parametrize("override,line", [
    ("data.bucket_boundaries=[512,256,1024]",
     "config key 'data.bucket_boundaries': must be positive and ascending, got [512, 256, 1024]"),
    ("data.bucket_boundaries=[256,256]", "config key 'data.bucket_boundaries': must be positive and ascending, got [256, 256]"),
    ("data.max_tokens_per_batch=0", "config key 'data.max_tokens_per_batch': must be >= 1, got 0"),
    ("data.max_tokens_per_batch=-4096", "config key 'data.max_tokens_per_batch': must be >= 1, got -4096"),
])
def test_batch_shape_keys_are_checked_at_compose_time(override, line, run_args, capsys):
    rc, err, _ = _run("train", [*run_args, override], capsys)     # fails before Ray: no ray_session
    assert _one_line(rc, err) == line


@pytest.mark.parametrize("workers", ["target", "drafter"])
def test_more_workers_than_the_cluster_can_place(workers, run_args, ray_session, capsys):
    have = ray_session.cluster_resources()
    cpus, slots = have.get("CPU", 0), have.get("target_slot", 0)
    if workers == "target":
        n = int(slots) + 1
        extra = [f"cluster.target_workers={n}"]
        line = (f"cluster has {slots:g} of resource 'target_slot' but cluster.target_workers = {n} (start Ray with "
                f"--resources '{{\"target_slot\": {n}}}')")
    else:
        n = int(cpus) + 1
        extra = [f"cluster.drafter_workers={n}", f"cluster.max_batches_in_flight={2 * n}"]
        line = (f"cluster has {cpus:g} CPUs but cluster.drafter_workers = {n} and cluster.target_workers = 1 need "
                f"{n + 0.5 + 0.25:g} (on one machine, raise cluster.num_cpus: oversubscribing is fine)")
    rc, err, _ = _run("train", [*run_args, *extra], capsys)
    assert _one_line(rc, err) == line
