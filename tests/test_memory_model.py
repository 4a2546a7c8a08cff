"""The memory model `dflash-ray plan` prints: its parts against hand counts and a real drafter, and the
warning when a step would not fit the device."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import Qwen3Config

from dflash_ray.cli import run_command
from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.sizing.memory import GIB, Shape, drafter_params, drafter_step_memory, target_actor_memory

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000}


def test_parameter_count_equals_a_real_drafters():
    fields = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=6, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=32, vocab_size=300, tie_word_embeddings=True)
    embed = torch.zeros(300, 96)
    drafter = build_drafter(DrafterConfig(num_draft_layers=2, block_size=4, num_anchors=8), Qwen3Config(**fields),
                            embed, embed, seed=0)
    real = sum(p.numel() for p in drafter.trainable_parameters())
    assert drafter_params(Shape.of(fields), 2, len(drafter.target_layer_ids)) == real


def test_qwen3_8b_parts_by_hand():
    shape = Shape.of(QWEN3_8B)
    # a layer: q,o 2*4096*4096 + k,v 2*4096*1024 + MLP 3*4096*12288 + q/k norms 2*128 + 2 norms 2*4096
    assert shape.layer_params() == 33_554_432 + 8_388_608 + 150_994_944 + 256 + 8_192
    params = 5 * shape.layer_params() + 5 * 4096 * 4096 + 2 * 4096           # + fc (5 taps) + two norms
    m = drafter_step_memory(shape, draft_layers=5, taps=5, block_tokens=8192, context_tokens=16384, gpu=True,
                            frozen_bytes=2)
    assert (m["weights"], m["gradients"], m["optimizer"]) == (4 * params, 4 * params, 8 * params)
    assert m["frozen_embed_head"] == 2 * 151936 * 4096 * 2                      # untied bf16 embedding + head
    assert m["context_features"] == 16384 * 5 * 4096 * 2
    assert m["dense_mask"] == 0                                                 # flex attention's block mask
    assert m["total"] == sum(v for k, v in m.items() if k != "total")
    # a target actor loads the embedding and layers 0..33 (last tap 33), no head, in bf16
    t = target_actor_memory(shape, last_tap=33, taps=5, tokens=16384, weight_bytes=2)
    assert t["weights"] == 2 * (151936 * 4096 + 34 * shape.layer_params())


def test_checkpointing_the_layers_and_the_anchor_budget_shrink_the_step():
    shape = Shape.of(QWEN3_8B)
    kw = dict(draft_layers=5, taps=5, context_tokens=16384, gpu=True, frozen_bytes=2)
    full = drafter_step_memory(shape, block_tokens=8192, **kw)["activations"]
    assert drafter_step_memory(shape, block_tokens=8192, recompute_layers=True, **kw)["activations"] < full / 2
    assert drafter_step_memory(shape, block_tokens=4096, **kw)["activations"] < full


@pytest.fixture(scope="module")
def qwen3_8b_world(tmp_path_factory):
    """A Qwen3-8B config.json (no weights: `plan` reads only the shape) and shards of long-tailed chat
    lengths with 70% supervised tokens."""
    root = tmp_path_factory.mktemp("q8")
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(json.dumps(QWEN3_8B))
    rng = np.random.default_rng(0)
    n = 4000
    lengths = np.clip(np.exp(rng.normal(np.log(900), 0.9, size=n)), 64, 8192).astype(np.int32)
    (root / "shards").mkdir()
    pq.write_table(pa.table({
        "sample_id": pa.array(np.arange(n)),
        "input_ids": pa.array([np.zeros(1, np.int32)] * n, type=pa.list_(pa.int32())),
        "loss_mask": pa.array([np.zeros(1, np.int8)] * n, type=pa.list_(pa.int8())),
        "num_tokens": pa.array(lengths),
        "num_supervised": pa.array((lengths * 0.7).astype(np.int32)),
    }), root / "shards" / "part-00000.parquet")
    return [f"model.target_path={root / 'target'}", f"data.shards={root / 'shards'}", "model=qwen3_8b",
            "data=sharegpt", "data.tokenizer=unused", "cluster=8gpu"]


def test_plan_prints_the_memory_model_and_flat_drafter_memory_with_the_anchor_budget(qwen3_8b_world, capsys):
    assert run_command("plan", qwen3_8b_world + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mem = out["memory"]
    assert mem["warnings"] == [] and mem["drafter_bucket_max_over_min"] < 1.1
    assert mem["drafter"]["total"] < 60 * GIB
    # without the per-batch anchor budget the short-row batches carry ~48 rows x 512 anchors
    assert run_command("plan", qwen3_8b_world + ["--json", "model.anchors_per_batch=null"]) == 0
    loose = json.loads(capsys.readouterr().out)["memory"]
    assert loose["drafter_bucket_max_over_min"] > 3 and loose["drafter"]["total"] > 139 * GIB
    assert any("more than its 139.0 GiB" in w for w in loose["warnings"])


def test_plan_warns_when_a_share_of_the_gpu_is_too_small(qwen3_8b_world, capsys):
    assert run_command("plan", qwen3_8b_world + ["cluster.device_memory_gb=30"]) == 0  # drafter ~39 GiB
    lines = capsys.readouterr().out.splitlines()
    warnings = [x for x in lines if x.startswith("WARNING")]
    assert len(warnings) == 1 and "the drafter step needs" in warnings[0] and "train.recompute_layers" in warnings[0]


def test_moe_targets_count_their_experts_and_the_drafter_its_own_sizes():
    qwen3_30b_a3b = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                     "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                     "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    shape = Shape.of(qwen3_30b_a3b)
    # q,o 2*2048*4096 + k,v 2*2048*512 + 128 experts x 3*2048*768 + router 2048*128 + norms 2*128 + 2*2048
    assert shape.layer_params() == 16_777_216 + 2_097_152 + 603_979_776 + 262_144 + 256 + 4_096
    # the target actor holds layers 0..45 (last tap 45) and the embedding: ~28.9B parameters in bf16
    t = target_actor_memory(shape, last_tap=45, taps=5, tokens=16384, weight_bytes=2)
    assert t["weights"] == 2 * (151936 * 2048 + 46 * shape.layer_params())
    # its drafter is dense at the target's intermediate_size, or the config's own sizes
    dense = shape.drafter()
    assert dense.experts == 0 and dense.layer_params() == 16_777_216 + 2_097_152 + 3 * 2048 * 6144 + 256 + 4_096
    small = shape.drafter(intermediate=1024, heads=16, kv_heads=4)
    assert small.layer_params() == 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 1024 + 256 + 4_096
