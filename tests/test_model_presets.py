"""The real presets (qwen3_8b, llama3_8b, qwen3_30b_a3b), targets other than dense Qwen3 (Llama, Qwen3-MoE),
the drafter's architecture knobs and the warm start (`model.init_from`).

Targets are tiny models of the presets' families built from configs (nothing downloaded); expected values
come from the recipe's numbers, the reference package (`dflash.model`) and hand computation, not from the
code under test.
"""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from dflash.model import DFlashDraftModel, build_target_layer_ids, extract_context_feature
from dflash_ray.config import compose_config
from dflash_ray.errors import UserError
from dflash_ray.model.drafter import DrafterConfig, build_drafter, drafter_config
from dflash_ray.model.export import export_drafter, init_from_export
from dflash_ray.model.target import (
    TargetFeatureExtractor,
    build_synthetic_target,
    load_embed_and_head,
    load_feature_extractor,
    load_target,
)

VOCAB = 300
MASK = 299
BLOCK = 8

# Tiny stand-ins of the presets' target families: the structure that matters (MoE experts, llama3 RoPE
# scaling, untied head), a width a CPU runs in milliseconds.
TINY_MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, rope_theta=1e6,
                initializer_range=0.1, tie_word_embeddings=False)
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rope_theta=500000.0, initializer_range=0.1, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
FAMILIES = {"qwen3_moe": TINY_MOE, "llama": TINY_LLAMA}


# ----------------------------------------------------------------------------- presets
# The recipe's drafter and schedule, from its published numbers (not read from the preset files): every valid anchor up
# to 512 a row (no thinning), the drafter's memory bounded by the plan's block-token budget instead.
RECIPE = dict(num_draft_layers=5, block_size=16, num_anchors=512, anchors_per_batch=None,
              max_block_tokens_per_batch=16384)


@pytest.mark.parametrize("preset", ["qwen3_8b", "llama3_8b", "qwen3_30b_a3b"])
def test_real_presets_compose_with_the_recipe_and_six_epochs(preset, capsys):
    from omegaconf import OmegaConf

    from dflash_ray.cli import run_command

    cfg = compose_config([f"model={preset}"])
    assert cfg.model.name == preset
    assert {k: cfg.model[k] for k in RECIPE} == RECIPE
    assert "model.target_path" in OmegaConf.missing_keys(cfg)  # required: a local or hub directory
    assert cfg.train.epochs == 6
    assert cfg.model.init_from is None and cfg.model.drafter_intermediate_size is None
    assert compose_config([f"model={preset}", "train.epochs=2"]).train.epochs == 2  # the command line wins
    assert compose_config([f"model={preset}", "data=sharegpt"]).train.epochs == 6
    assert run_command("plan", ["--cfg", "job", f"model={preset}"]) == 0
    assert f"name: {preset}" in capsys.readouterr().out


def test_the_demo_and_the_default_keep_their_epochs():
    assert compose_config([]).train.epochs == 10                     # tiny: the demo's own schedule
    assert compose_config(["model=tiny"]).train.epochs == 10


@pytest.mark.parametrize("key", ["drafter_intermediate_size", "drafter_num_attention_heads",
                                 "drafter_num_key_value_heads"])
def test_drafter_knobs_are_typed_and_bounded(key):
    for preset in ("qwen3_8b", "llama3_8b", "qwen3_30b_a3b"):
        assert compose_config([f"model={preset}", f"model.{key}=8"]).model[key] == 8
    with pytest.raises(UserError, match=f"config key 'model.{key}': must be >= 1"):
        compose_config(["model=llama3_8b", f"model.{key}=0"])
    with pytest.raises(UserError, match=f"config key 'model.{key}'"):
        compose_config(["model=llama3_8b", f"model.{key}=wide"])
    # tiny.yaml does not list the new keys: there they are added with `+` (the schema types them)
    assert compose_config([f"+model.{key}=8"]).model[key] == 8


# The presets' targets at full size, as config objects only (no weights): what the drafter copies.
LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=True)


def test_full_size_preset_targets_give_dense_drafters_of_their_width():
    from transformers import LlamaConfig, Qwen3MoeConfig

    llama = drafter_config(LlamaConfig(**LLAMA31_8B), 5, 16, 128255).to_dict()
    assert (llama["hidden_size"], llama["intermediate_size"], llama["num_attention_heads"],
            llama["num_key_value_heads"], llama["head_dim"], llama["vocab_size"]) == (4096, 14336, 32, 8, 128, 128256)
    assert llama["target_layer_ids"] == [1, 8, 15, 22, 29] and llama["num_target_layers"] == 32  # round(1+7i)
    assert llama["rope_parameters"]["rope_theta"] == 500000.0 and llama["rope_parameters"]["rope_type"] == "llama3"
    assert llama["tie_word_embeddings"] is False

    moe = drafter_config(Qwen3MoeConfig(**QWEN3_30B_A3B), 5, 16, 151669).to_dict()
    assert (moe["hidden_size"], moe["intermediate_size"], moe["num_attention_heads"], moe["num_key_value_heads"],
            moe["head_dim"], moe["vocab_size"]) == (2048, 6144, 32, 4, 128, 151936)  # the dense MLP width, not 768
    assert moe["target_layer_ids"] == [1, 12, 23, 34, 45] and moe["num_target_layers"] == 48  # round(1+11i)
    assert moe["model_type"] == "qwen3" and moe["num_hidden_layers"] == 5
    assert not any(k in moe for k in ("num_experts", "moe_intermediate_size", "num_experts_per_tok"))
    assert build_target_layer_ids(48, 5) == moe["target_layer_ids"]


def test_preset_mask_ids_by_the_tokenizers_length():
    from dflash_ray.model.target import default_mask_token_id

    # Qwen3's tokenizer holds 151669 tokens (< 151936 rows); Llama 3's fills all 128256 rows.
    assert default_mask_token_id(151936, _Tok(151669)) == 151669
    assert default_mask_token_id(128256, _Tok(128256)) == 128255


class _Tok:
    mask_token_id = None

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


# ----------------------------------------------------------------------------- MoE and Llama targets
@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_synthetic_target(fields, VOCAB, str(root / name), seed=5) for name, fields in FAMILIES.items()}


def test_synthetic_targets_are_of_their_family(family_dirs):
    moe, llama = load_target(family_dirs["qwen3_moe"]), load_target(family_dirs["llama"])
    assert type(moe).__name__ == "Qwen3MoeForCausalLM" and moe.config.num_experts == 4
    assert type(moe.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert llama.config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layer_ids", [[0, 2], [1, 3], [3, 1, 1]])  # 3 = the last layer: HF returns it normed
def test_features_equal_reference_for_moe_and_llama(family_dirs, family, layer_ids):
    target = load_target(family_dirs[family])
    ids = torch.randint(0, VOCAB, (2, 27), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    ours = TargetFeatureExtractor(target, layer_ids)(ids, attention_mask=mask)
    with torch.no_grad():
        ref = extract_context_feature(target(ids, attention_mask=mask, output_hidden_states=True).hidden_states,
                                      layer_ids)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1, :18], ref[1, :18], rtol=0, atol=1e-5)
    # the target actors' loader (decoder only, layers after the last tap never read) gives the same
    part = load_feature_extractor(family_dirs[family], layer_ids)
    assert len(part.decoder.layers) == max(layer_ids) + 1
    torch.testing.assert_close(part(ids, attention_mask=mask)[0], ref[0], rtol=0, atol=1e-5)


def test_sliding_window_moe_target_is_refused(tmp_path):
    """Qwen3-MoE slides every layer when use_sliding_window is set (no layer_types): not supported."""
    d = build_synthetic_target({**TINY_MOE, "use_sliding_window": True, "sliding_window": 8}, VOCAB, str(tmp_path))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        TargetFeatureExtractor(load_target(d), [1])(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.rounding
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_drafter_trains_on_moe_and_llama_targets(family_dirs, family):
    target = load_target(family_dirs[family])
    embed, head = load_embed_and_head(family_dirs[family])
    drafter = build_drafter(DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=6, mask_token_id=MASK),
                            target.config, embed, head, seed=0, attention_backend="sdpa")
    assert drafter.config.intermediate_size == FAMILIES[family]["intermediate_size"]
    assert drafter.layers[0].mlp.up_proj.weight.shape == (FAMILIES[family]["intermediate_size"], 64)
    assert not drafter.tied and torch.equal(drafter.head_weight, target.lm_head.weight)
    ids = torch.randint(0, MASK, (2, 32), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([32, 25])
    loss_mask = torch.zeros(2, 32, dtype=torch.long)
    loss_mask[0, 8:] = 1
    loss_mask[1, 5:25] = 1
    context = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        out = drafter.training_loss(ids, loss_mask, context, lengths, torch.Generator().manual_seed(0))
        loss = out.loss_sum / out.weight_sum
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.trainable_parameters())
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses


# ----------------------------------------------------------------------------- architecture knobs
@pytest.fixture(scope="module")
def knob_export(family_dirs, tmp_path_factory):
    """A drafter on the Llama target with a smaller MLP and fewer heads, perturbed, exported."""
    target = load_target(family_dirs["llama"])
    embed, head = load_embed_and_head(family_dirs["llama"])
    cfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=6, mask_token_id=MASK,
                        intermediate_size=40, num_attention_heads=2, num_key_value_heads=1)
    drafter = build_drafter(cfg, target.config, embed, head, seed=0, attention_backend="sdpa")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    out = export_drafter(drafter, str(tmp_path_factory.mktemp("knobs") / "drafter"))
    return dict(target=target, drafter=drafter, dir=out, embed=embed, head=head)


def test_knobs_set_the_drafter_shape_and_keep_head_dim(knob_export):
    d = knob_export["drafter"]
    attn, mlp = d.layers[0].self_attn, d.layers[0].mlp
    assert mlp.gate_proj.weight.shape == (40, 64) and mlp.down_proj.weight.shape == (64, 40)
    assert attn.q_proj.weight.shape == (2 * 16, 64) and attn.k_proj.weight.shape == (1 * 16, 64)
    assert attn.o_proj.weight.shape == (64, 2 * 16) and d.fc.weight.shape == (64, 2 * 64)
    with open(f"{knob_export['dir']}/config.json") as f:
        cfg = json.load(f)
    assert (cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["hidden_size"]) == (40, 2, 1, 16, 64)


def test_reference_loads_the_knobbed_export_and_its_logits_are_ours(knob_export):
    s = knob_export
    reference, info = DFlashDraftModel.from_pretrained(s["dir"], output_loading_info=True)
    reference.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, MASK, (1, 30), generator=torch.Generator().manual_seed(4))
    context = TargetFeatureExtractor(s["target"], s["drafter"].target_layer_ids)(ids)
    anchors = [5, 13, 21]
    with torch.no_grad():
        ours = s["drafter"].logits(s["drafter"](ids, context, torch.tensor([anchors])))[0]
        assert ours.std() > 0.3
        for n, a in enumerate(anchors):
            block = torch.full((1, BLOCK), MASK)
            block[0, 0] = ids[0, a]
            hidden = reference(target_hidden=context[:, :a], noise_embedding=F.embedding(block, s["embed"]),
                               position_ids=torch.arange(a + BLOCK)[None])[:, 1 - BLOCK:]
            ref = reference.compute_logits(hidden, s["target"].lm_head)[0]
            assert (ours[n, 1:] - ref).abs().max() < 1e-4, a


def test_knobs_are_checked(family_dirs):
    target = load_target(family_dirs["llama"])
    with pytest.raises(ValueError, match="not a multiple"):
        drafter_config(target.config, 2, BLOCK, MASK, num_attention_heads=3)  # the target's 2 kv heads
    with pytest.raises(ValueError, match="intermediate_size"):
        drafter_config({k: v for k, v in target.config.to_dict().items() if k != "intermediate_size"}, 2, BLOCK, MASK)
    assert drafter_config(target.config, 2, BLOCK, MASK, num_attention_heads=6).num_attention_heads == 6


def test_run_spec_checks_the_knobs_against_the_target(family_dirs):
    from transformers import AutoConfig

    from dflash_ray.runtime.spec import _check_drafter_shape

    tcfg = AutoConfig.from_pretrained(family_dirs["llama"])
    cfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=6, mask_token_id=MASK, num_attention_heads=3)
    with pytest.raises(UserError, match="^config key 'model.drafter_num_key_value_heads': the drafter's 3 attention"):
        _check_drafter_shape(cfg, tcfg, None)
    fine = DrafterConfig(2, BLOCK, 6, mask_token_id=MASK, num_key_value_heads=1)
    assert _check_drafter_shape(fine, tcfg, None) is None


# ----------------------------------------------------------------------------- warm start
def _run_spec(target_dir, cfg, init_from, seed=11):
    return SimpleNamespace(target_path=target_dir, drafter=cfg, seed=seed, init_from=init_from,
                           train=SimpleNamespace(recompute_layers=False))


def test_warm_start_gives_the_export_weights(knob_export, family_dirs):
    from dflash_ray.runtime.training.model import build_run_drafter

    cfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=6, mask_token_id=MASK,
                        intermediate_size=40, num_attention_heads=2, num_key_value_heads=1)
    exported = knob_export["drafter"].state_dict()
    fresh = build_run_drafter(_run_spec(family_dirs["llama"], cfg, None), torch.device("cpu")).state_dict()
    assert not any(torch.equal(fresh[k], exported[k]) for k in exported if k.endswith("proj.weight"))
    warm = build_run_drafter(_run_spec(family_dirs["llama"], cfg, knob_export["dir"]), torch.device("cpu"))
    for name, value in exported.items():
        assert torch.equal(warm.state_dict()[name], value), name
    assert warm.recompute_layers is False and warm.block_size == BLOCK


def test_warm_start_keeps_the_runs_dtype(knob_export, tmp_path):
    """A bf16 export starts an fp32 run: the values are the export's, the parameters stay fp32."""
    bf16 = export_drafter(knob_export["drafter"], str(tmp_path / "bf16"), dtype=torch.bfloat16)
    d = build_drafter(DrafterConfig(2, BLOCK, 6, mask_token_id=MASK, intermediate_size=40, num_attention_heads=2,
                                    num_key_value_heads=1), knob_export["target"].config, knob_export["embed"],
                      knob_export["head"], seed=1)
    init_from_export(d, bf16)
    w = d.layers[1].mlp.up_proj.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, knob_export["drafter"].layers[1].mlp.up_proj.weight.to(torch.bfloat16).float())


@pytest.mark.parametrize("change,field", [
    (dict(block_size=16), "block_size 8 != 16"),
    (dict(target_layer_ids=(0, 2)), "target_layer_ids [1, 1] != [0, 2]"),
    (dict(mask_token_id=298), "mask_token_id 299 != 298"),
    (dict(intermediate_size=48), "intermediate_size 40 != 48"),
])
def test_a_mismatching_export_is_refused_in_one_line(knob_export, family_dirs, change, field):
    from dflash_ray.runtime.training.model import build_run_drafter

    base = dict(num_draft_layers=2, block_size=BLOCK, num_anchors=6, mask_token_id=MASK, intermediate_size=40,
                num_attention_heads=2, num_key_value_heads=1)
    cfg = DrafterConfig(**{**base, **change})
    with pytest.raises(UserError) as e:
        build_run_drafter(_run_spec(family_dirs["llama"], cfg, knob_export["dir"]), torch.device("cpu"))
    msg = str(e.value)
    assert msg.startswith("config key 'model.init_from': ") and "\n" not in msg and field in msg, msg


@pytest.mark.parametrize("other,field", [(dict(hidden_size=32), "hidden_size 64 != 32"),
                                         (dict(vocab_size=500), "vocab_size 300 != 500")])
def test_the_driver_refuses_an_export_of_another_target(knob_export, family_dirs, other, field):
    """resolve_spec's check, before any worker starts: the run's target against the export's."""
    from transformers import AutoConfig, LlamaConfig

    from dflash_ray.runtime.spec import _check_drafter_shape

    cfg = DrafterConfig(2, BLOCK, 6, mask_token_id=MASK, intermediate_size=40, num_attention_heads=2,
                        num_key_value_heads=1)
    same = AutoConfig.from_pretrained(family_dirs["llama"])
    assert _check_drafter_shape(cfg, same, knob_export["dir"]) == str(knob_export["dir"])
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    with pytest.raises(UserError, match=r"^config key 'model.init_from': .*" + field):
        _check_drafter_shape(cfg, LlamaConfig(**{**fields, "vocab_size": VOCAB, **other}), knob_export["dir"])


def test_init_from_a_directory_that_is_no_export(tmp_path, knob_export):
    shutil.copy(f"{knob_export['dir']}/config.json", tmp_path / "config.json")  # weights missing
    with pytest.raises(ValueError, match="is not an exported drafter"):
        init_from_export(knob_export["drafter"], str(tmp_path))


def test_the_70b_preset_scales_the_seed_runs_rates_by_the_work_per_token(tmp_path):
    """The capacity model's seed-run rates were measured on Qwen3-8B: for Llama-3.3-70B they scale by the
    decoder parameters a token passes through (target: all layers; drafter: 5 layers + fc), by hand."""
    from dflash_ray.sizing.capacity import capacity_report

    def layer(h, q_heads, kv_heads, head_dim, inter):   # q,o + k,v + SwiGLU
        return 2 * h * q_heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter

    q8, l70 = layer(4096, 32, 8, 128, 12288), layer(8192, 64, 8, 128, 28672)
    t_scale = 36 * q8 / (80 * l70)
    d_scale = (5 * q8 + 5 * 4096 ** 2) / (5 * l70 + 5 * 8192 ** 2)
    cfg = compose_config(["model=llama3_70b", "data=sharegpt", "cluster=8gpu", f"run.root={tmp_path}"])
    cap = capacity_report(cfg, {"block_tokens_per_token": 3.91, "tokens": 0})["capacity"]
    assert cap["target_tokens_per_gpu"] == pytest.approx(25300 / 6 * t_scale)
    assert cap["drafter_block_tokens_per_gpu"] == pytest.approx(25300 * 3.91 / 2 * d_scale)
    assert 0.10 < t_scale < 0.11 and 0.22 < d_scale < 0.23
    same = capacity_report(compose_config(["model=qwen3_8b", "data=sharegpt", "cluster=8gpu", f"run.root={tmp_path}"]),
                           {"block_tokens_per_token": 3.91, "tokens": 0})["capacity"]
    assert same["target_tokens_per_gpu"] == 25300 / 6                      # the seed run's own shape: as measured
