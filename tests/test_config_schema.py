"""The typed config as the one path: new keys and rules between keys (the schema holds every default:
tests/test_config_defaults.py)."""
from __future__ import annotations

import pytest

from dflash_ray.cli import main
from dflash_ray.config import CONF_DIR, compose_config
from dflash_ray.errors import UserError


def test_new_key_in_a_typed_group_is_refused_at_the_root_it_is_kept(capsys):
    assert main(["train", "--cfg", "job", "+train.new_key=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unknown config key 'train.new_key'" in err and "adds keys at the root only" in err
    cfg = compose_config(["+corpus=/data/c", "data.shards=${corpus}/shards"])
    assert cfg.corpus == "/data/c" and cfg.data.shards == "/data/c/shards"


@pytest.mark.parametrize("overrides, key", [
    (["cluster.max_batches_in_flight=3", "cluster.drafter_workers=2", "train.grad_accum=2"],
     "cluster.max_batches_in_flight"),                       # one step needs 4 batches in flight
    (["data.bucket_boundaries=[64,32]"], "data.bucket_boundaries"),
    (["data.max_tokens_per_batch=100"], "data.max_tokens_per_batch"),   # the last boundary is 512
])
def test_rules_between_keys_are_checked_when_the_config_is_composed(overrides, key):
    with pytest.raises(UserError, match=f"config key '{key}'"):
        compose_config(overrides)
    compose_config(["cluster.max_batches_in_flight=4", "cluster.drafter_workers=2", "train.grad_accum=2"])


def test_nothing_reads_a_removed_knob(capsys):
    assert main(["train", "--cfg", "job", "train.log_every=1"]) == 2
    assert "unknown config key 'train.log_every'" in capsys.readouterr().err


@pytest.mark.parametrize("old, new", [("train.checkpoint_layers=true", "train.recompute_layers"),
                                      ("train.stream_window_rows=5", "train.stream_segment_blocks"),
                                      ("train.stream_segment_rows=5", "train.stream_segment_blocks")])
def test_a_renamed_key_names_its_new_name(old, new, capsys):
    assert main(["train", "--cfg", "job", old]) == 2
    assert f"(renamed: use '{new}')" in capsys.readouterr().err
    assert main(["train", "--cfg", "job", f"{new}={old.split('=')[1]}"]) == 0


def test_a_missing_required_value_is_one_line_before_ray_starts(tmp_path, capsys):
    """The 8-GPU job's usage without data.tokenizer: one line naming the key, exit 2, no cluster start."""
    import ray

    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text("{}")
    was_up = ray.is_initialized()
    assert main(["train", "model=qwen3_8b", "data=sharegpt", f"model.target_path={target}",
                 f"data.shards={tmp_path / 'shards'}", f"run.root={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dflash-ray train: error: config key 'data.tokenizer' must be set (e.g. data.tokenizer=...)"
    assert ray.is_initialized() == was_up


def test_job_scripts_name_every_required_key():
    """The usage lines of jobs/8gpu.sh and jobs/multinode.sh give every `???` of model=qwen3_8b data=sharegpt
    except data.input (shards made elsewhere need no input)."""
    from omegaconf import OmegaConf

    required = OmegaConf.missing_keys(compose_config(["model=qwen3_8b", "data=sharegpt"])) - {"data.input"}
    for script in ("8gpu.sh", "multinode.sh"):
        usage = (CONF_DIR.parent.parent / "jobs" / script).read_text()
        assert all(f"{key}=" in usage for key in required), (script, required)
