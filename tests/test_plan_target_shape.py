"""`plan` with a real preset sizes the preset's own target, never the tiny demo's.

The presets' targets' config.json values below are the public ones (huggingface.co: Qwen/Qwen3-8B,
meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-30B-A3B), written here, not read from the presets: a plan with
no model.target_path must equal the plan with a target directory holding that config.json."""
import json

import numpy as np
import pytest
from helpers_data import write_shard

from dflash_ray.cli import run_command
from dflash_ray.config import compose_config
from dflash_ray.data.plan import target_fields

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16"}
PRESETS = {"qwen3_8b": QWEN3_8B, "llama3_8b": LLAMA31_8B, "qwen3_30b_a3b": QWEN3_30B_A3B}
# the tiny demo target's shape (dflash_ray/conf/model/tiny.yaml): what the old code sized a preset's plan with
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 600, "tie_word_embeddings": True}


def attention_tokens_by_hand(c: dict) -> float:
    """La = a layer's projection parameters / (heads x head_dim) (data/plan.py's rule, by FLOP count)."""
    h, heads, kv, hd, inter = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                               c["intermediate_size"])
    return (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter) / (heads * hd)


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Shards, and the demo's synthesised target where a run of the default name left it (runs/default/target,
    relative to the working directory): the old code read it for a preset with no model.target_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "default" / "target").mkdir(parents=True)
    (tmp_path / "runs" / "default" / "target" / "config.json").write_text(json.dumps(TINY))
    rng = np.random.default_rng(0)
    lengths = np.clip(np.exp(rng.normal(np.log(900), 0.9, size=2000)), 64, 8192).astype(int)
    write_shard(tmp_path / "shards" / "a.parquet", np.arange(2000), lengths)
    return tmp_path, ["data=sharegpt", "cluster=8gpu", f"data.shards={tmp_path / 'shards'}", "data.input=x",
                      "data.tokenizer=y"]


def _plan(args, capsys) -> dict:
    assert run_command("plan", args + ["--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_preset_without_target_path_plans_with_its_own_targets_shape(preset, world, capsys):
    root, args = world
    real = PRESETS[preset]
    (root / "real").mkdir()
    (root / "real" / "config.json").write_text(json.dumps(real))
    given = _plan(args + [f"model={preset}", f"model.target_path={root / 'real'}"], capsys)
    unset = _plan(args + [f"model={preset}"], capsys)
    assert given["attention_tokens"] == pytest.approx(attention_tokens_by_hand(real))
    assert unset["attention_tokens"] == pytest.approx(attention_tokens_by_hand(real))   # not the tiny one's 576
    assert {k: v for k, v in unset.items() if k != "target_shape_from"} == \
           {k: v for k, v in given.items() if k != "target_shape_from"}
    assert unset["target_shape_from"].startswith(f"model.target_config of model={preset}")
    # the text names where the shape came from, and the target's attention length (Qwen3-8B: 47,104)
    assert run_command("plan", args + [f"model={preset}"]) == 0
    out = capsys.readouterr().out
    assert f"target shape: model.target_config of model={preset}" in out
    assert f"L / {attention_tokens_by_hand(real):,.0f})" in out and "L / 576)" not in out
    if preset == "qwen3_8b":
        assert "L / 47,104)" in out


def test_a_target_path_this_machine_cannot_read_is_refused_with_one_line(world, capsys):
    root, args = world
    for preset in ("qwen3_8b", "tiny"):
        rc = run_command("plan", args + [f"model={preset}", f"model.target_path={root / 'nowhere'}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert f"config key 'model.target_path': {root / 'nowhere'} is not a directory with a config.json" in err[0]


def test_a_preset_without_a_shape_of_its_own_asks_for_target_path(world, capsys):
    _, args = world
    rc = run_command("plan", args + ["model=qwen3_8b", "~model.target_config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "config key 'model.target_path' must be set" in err[0], err


def test_an_unresolved_hub_id_is_no_target_and_never_the_tiny_one(world):
    # before hub ids are resolved (at compose time) a hub id names no local directory: the shape is unknown
    assert target_fields(compose_config(["model.target_path=Qwen/Qwen3-8B"])) is None
    assert target_fields(compose_config(["model=qwen3_8b", "model.target_path=Qwen/Qwen3-8B"])) is None
    # a preset left unset: its own shape; the demo (target_path null): its synthesised target's
    assert target_fields(compose_config(["model=qwen3_8b"]))["hidden_size"] == 4096
    assert target_fields(compose_config([]))["hidden_size"] == 64


def test_plan_prints_the_feature_cache_and_the_8b_preset_stays_online_saying_why(world, capsys):
    _, args = world
    out = _plan(args + ["model=qwen3_8b"], capsys)
    cache = out["memory"]["feature_cache"]
    # the corpus's tokens x Qwen3-8B's 5 taps ([1, 9, 17, 25, 33]) x 4096 x 2 bytes (bf16 on GPUs)
    assert cache["bytes"] == out["tokens"] * 5 * 4096 * 2 > 64 * 2**30
    assert cache["mode"] == "online" and "over train.feature_cache_gb=64" in cache["why"]
    small = _plan(args + ["model=qwen3_8b", "train.feature_cache_gb=1000"], capsys)["memory"]["feature_cache"]
    assert small["mode"] in ("hybrid", "online") and ("hybrid" == small["mode"]) == ("GiB free" not in small["why"])
    refused = _plan(args + ["model=qwen3_8b", "train.features=hybrid"], capsys)["memory"]["feature_cache"]
    assert refused["mode"] == "refused" and "config key 'train.features'" in refused["why"]
    assert run_command("plan", args + ["model=qwen3_8b"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("feature cache:")]
    assert len(line) == 1 and "train.features=auto -> online" in line[0] and "5 taps x 4096 x 2 bytes" in line[0]
