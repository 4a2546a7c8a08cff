"""The export as serving loaders read it: config.json holds every field the reference `dflash` loader reads
(the list is derived from the reference's source by parsing it, not from the export), and the DFlash fields
are right for each real preset's target shape (built tiny: the preset's depth, a tiny width).

SGLang's and vLLM's loaders cannot run here (no GPU, not installed); `ENGINE_FIELDS` is copied by hand from
their source as read while this was written (docs/serving.md, "Serving it"), so it is a record, not an oracle.
"""
import ast
import inspect
import json

import pytest
import torch

import dflash.model as reference_module
from dflash.model import DFlashDraftModel
from dflash_ray.config import compose_config
from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.model.export import export_drafter
from dflash_ray.model.target import (
    build_synthetic_target,
    default_mask_token_id,
    default_target_layer_ids,
    load_embed_and_head,
    load_target,
)

VOCAB = 300

# The reference's optional fields whose absence means "off" (its defaults): the export may leave them out.
OFF_WHEN_ABSENT = {"final_logit_softcapping", "output_multiplier", "input_embedding_scale", "is_causal"}

# The presets' targets at a tiny width and their real depth (what decides the taps); family structure kept.
SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=256, tie_word_embeddings=False)
PRESET_TARGETS = {
    "qwen3_8b": dict(SMALL, num_hidden_layers=36, rope_theta=1e6),
    "llama3_8b": dict(SMALL, model_type="llama", num_hidden_layers=32, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3_30b_a3b": dict(SMALL, model_type="qwen3_moe", num_hidden_layers=48, moe_intermediate_size=16,
                          num_experts=4, num_experts_per_tok=2, rope_theta=1e6),
}
# By hand, round(1 + i*(L-4)/4) for i = 0..4: L = 36, 32, 48.
EXPECTED_TAPS = {"qwen3_8b": [1, 9, 17, 25, 33], "llama3_8b": [1, 8, 15, 22, 29], "qwen3_30b_a3b": [1, 12, 23, 34, 45]}
EXPECTED_DEPTH = {"qwen3_8b": 36, "llama3_8b": 32, "qwen3_30b_a3b": 48}
# Tokenizer lengths of the families against the tiny vocabulary: Qwen's tokenizers leave spare embedding
# rows (Qwen3: 151669 of 151936), Llama 3's fills every row.
TOKENIZER_LEN = {"qwen3_8b": VOCAB - 10, "llama3_8b": VOCAB, "qwen3_30b_a3b": VOCAB - 10}
EXPECTED_MASK = {"qwen3_8b": VOCAB - 10, "llama3_8b": VOCAB - 1, "qwen3_30b_a3b": VOCAB - 10}

# Fields SGLang's DFlash loader (python/sglang/srt/models/dflash.py, speculative/dflash_utils.py) and vLLM's
# (vllm/model_executor/models/qwen3_dflash.py, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) read at the
# top level of config.json without a usable default; the DFlash ones they read from `dflash_config` first.
ENGINE_FIELDS = {"architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "attention_bias", "rms_norm_eps", "intermediate_size", "hidden_act",
                 "max_position_embeddings", "rope_parameters", "vocab_size", "num_target_layers"}
ENGINE_DFLASH_FIELDS = {"block_size", "target_layer_ids", "mask_token_id"}


def _config_reads(source: str, skip_classes=()) -> tuple[set, dict]:
    """Config fields a source reads: `config.X` / `self.config.X` / `<obj>.config.X` (required), and
    `getattr(config, "X"[, default])` / `_draft_value(config, "X"[, default])` (optional when a default
    is given: {name: default source})."""
    def is_config(node):
        return (isinstance(node, ast.Name) and node.id == "config") or (
            isinstance(node, ast.Attribute) and node.attr == "config")

    required, optional = set(), {}

    class Visitor(ast.NodeVisitor):
        def visit_ClassDef(self, node):
            if node.name not in skip_classes:
                self.generic_visit(node)

        def visit_Call(self, node):
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if (name in ("getattr", "_draft_value") and len(node.args) >= 2 and is_config(node.args[0])
                    and isinstance(node.args[1], ast.Constant)):
                key = node.args[1].value
                default = node.args[2] if len(node.args) > 2 else (node.keywords[0].value if node.keywords else None)
                if default is None:
                    required.add(key)
                else:
                    optional[key] = ast.unparse(default)
            self.generic_visit(node)

        def visit_Attribute(self, node):
            if is_config(node.value):
                required.add(node.attr)
            self.generic_visit(node)

    Visitor().visit(ast.parse(source))
    return required, optional


def reference_fields() -> tuple[set, dict]:
    """What `dflash.DFlashDraftModel` (and `dflash_generate`) read from the drafter's config: its module
    (without the DFlash2 classes, another architecture), and the transformers classes it builds on
    (Qwen3MLP, Qwen3RotaryEmbedding)."""
    from transformers.models.qwen3 import modeling_qwen3

    required, optional = _config_reads(inspect.getsource(reference_module),
                                       skip_classes=("DFlash2DraftModel", "CandidateSelector",
                                                     "GroupedDynamicCausalConv"))
    for cls in (modeling_qwen3.Qwen3MLP, modeling_qwen3.Qwen3RotaryEmbedding):
        r, o = _config_reads(inspect.getsource(cls))
        required |= r
        optional.update(o)
    return required, optional


def test_the_parser_finds_what_the_reference_reads():
    """The derived list is not empty or trivially small: fields every DFlash loader needs are in it."""
    required, optional = reference_fields()
    assert {"hidden_size", "num_hidden_layers", "intermediate_size", "rope_parameters", "num_target_layers",
            "mask_token_id", "rms_norm_eps"} <= required
    assert {"block_size", "target_layer_ids", "head_dim", "dflash_config", "layer_types", "is_causal"} <= set(optional)
    assert len(required | set(optional)) >= 20


@pytest.fixture(scope="module", params=sorted(PRESET_TARGETS))
def preset_export(request, tmp_path_factory):
    """The preset's drafter, configured as resolve_spec configures it, on a tiny target of the preset's
    family and depth, exported."""
    preset = request.param
    root = tmp_path_factory.mktemp(preset)
    tdir = build_synthetic_target(PRESET_TARGETS[preset], VOCAB, str(root / "target"), seed=0)
    target = load_target(tdir)
    m = compose_config([f"model={preset}"]).model
    depth = int(target.config.num_hidden_layers)
    tokenizer = type("Tok", (), {"mask_token_id": None, "__len__": lambda self: TOKENIZER_LEN[preset]})()
    taps = m.target_layer_ids or default_target_layer_ids(depth, int(m.num_draft_layers))
    cfg = DrafterConfig(num_draft_layers=int(m.num_draft_layers), block_size=int(m.block_size),
                        num_anchors=int(m.num_anchors), target_layer_ids=tuple(taps),
                        mask_token_id=default_mask_token_id(VOCAB, tokenizer),
                        anchors_per_batch=m.anchors_per_batch)
    embed, head = load_embed_and_head(tdir)
    drafter = build_drafter(cfg, target.config, embed, head, seed=0)
    out = export_drafter(drafter, str(root / "drafter"))
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    return dict(preset=preset, target=target, drafter=drafter, dir=out, config=config)


def test_export_holds_every_field_the_reference_reads(preset_export):
    config = preset_export["config"]
    required, optional = reference_fields()
    nested = config["dflash_config"]
    missing = [k for k in sorted(required | set(optional))
               if k not in config and k not in nested and k not in OFF_WHEN_ABSENT]
    assert not missing, missing
    # the optional ones present must mean what the drafter trained: full, non-causal attention, no scaling
    assert config.get("is_causal") is None
    assert config["layer_types"] == ["full_attention"] * config["num_hidden_layers"]
    assert config.get("output_multiplier", 1.0) == 1.0 and config.get("input_embedding_scale", 1.0) == 1.0
    assert not config.get("final_logit_softcapping")
    # head_dim written, not left to the reference's hidden // heads default
    assert config["head_dim"] == preset_export["target"].config.head_dim


def test_dflash_fields_are_right_for_the_preset(preset_export):
    preset, config = preset_export["preset"], preset_export["config"]
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_target_layers"] == EXPECTED_DEPTH[preset]
    for where in (config, config["dflash_config"]):
        assert where["block_size"] == 16
        assert where["mask_token_id"] == EXPECTED_MASK[preset]
        assert where["target_layer_ids"] == EXPECTED_TAPS[preset]
    assert config["num_hidden_layers"] == 5 and config["model_type"] == "qwen3"
    assert not any(k in config for k in ("num_experts", "moe_intermediate_size", "num_experts_per_tok"))
    reference, info = DFlashDraftModel.from_pretrained(preset_export["dir"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert reference.target_layer_ids == EXPECTED_TAPS[preset] and reference.block_size == 16
    assert reference.mask_token_id == EXPECTED_MASK[preset]
    assert reference.fc.in_features == 5 * 32 and not reference.layers[0].self_attn.is_causal


def test_rope_is_written_for_transformers_4_and_5(preset_export):
    """rope_parameters (transformers 5) and rope_theta / rope_scaling (4, which a serving image may run)
    both give the target's RoPE."""
    config, fields = preset_export["config"], PRESET_TARGETS[preset_export["preset"]]
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == fields["rope_theta"]
    scaling = fields.get("rope_scaling")
    if scaling is None:
        assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    else:
        assert config["rope_scaling"] == scaling
        assert {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"} == scaling


def test_export_holds_what_sglang_and_vllm_read(preset_export):
    config = preset_export["config"]
    assert ENGINE_FIELDS <= set(config), ENGINE_FIELDS - set(config)
    assert ENGINE_DFLASH_FIELDS <= set(config["dflash_config"])
    # vLLM: a layer is causal when is_causal or dflash_config.causal says so, else when it slides; SGLang:
    # full_attention layers run non-causal (ENCODER_ONLY). The drafter trained non-causal blocks.
    assert config.get("is_causal") is None and "causal" not in config["dflash_config"]
    assert "use_swa" not in config["dflash_config"] and "sliding_attention" not in config["layer_types"]
    # vLLM sizes fc from the taps (target_layer_ids, +1 as its aux-layer ids) x hidden_size
    taps = config["dflash_config"]["target_layer_ids"]
    assert preset_export["drafter"].fc.in_features == len(taps) * config["hidden_size"]
    assert config["vocab_size"] == preset_export["target"].config.vocab_size  # vLLM's draft_vocab_size default


def test_reference_and_export_logits_agree_for_the_preset(preset_export):
    """The reference runs the exported preset drafter to the same logits as ours (one block)."""
    from torch.nn import functional as F

    from dflash_ray.model.target import TargetFeatureExtractor

    d, target = preset_export["drafter"], preset_export["target"]
    reference = DFlashDraftModel.from_pretrained(preset_export["dir"]).eval()
    ids = torch.randint(0, VOCAB - 10, (1, 24), generator=torch.Generator().manual_seed(0))
    context = TargetFeatureExtractor(target, d.target_layer_ids)(ids)
    a = 7
    with torch.no_grad():
        ours = d.logits(d(ids, context, torch.tensor([[a]])))[0, 0, 1:]
        block = torch.full((1, 16), d.mask_token_id)
        block[0, 0] = ids[0, a]
        hidden = reference(target_hidden=context[:, :a], noise_embedding=F.embedding(block, d.embed_weight),
                           position_ids=torch.arange(a + 16)[None])[:, -15:]
        ref = reference.compute_logits(hidden, target.lm_head)[0]
    assert (ours - ref).abs().max() < 1e-4
