"""Export writes what the reference `dflash.DFlashDraftModel.from_pretrained` loads, and loads back bit for bit."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from dflash.model import DFlashDraftModel
from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.model.export import export_drafter, load_drafter
from dflash_ray.model.target import build_synthetic_target, load_embed_and_head, load_target
from helpers_model import TINY_QWEN3

TINY = {**TINY_QWEN3, "num_hidden_layers": 8, "tie_word_embeddings": False}
VOCAB = 300


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    tdir = build_synthetic_target(TINY, VOCAB, str(root / "target"), seed=0)
    target = load_target(tdir)
    embed, head = load_embed_and_head(tdir)
    cfg = DrafterConfig(num_draft_layers=3, block_size=10, num_anchors=8, target_layer_ids=(1, 4, 6), mask_token_id=298)
    drafter = build_drafter(cfg, target.config, embed, head, seed=0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = export_drafter(drafter, str(root / "drafter"))
    return dict(target=target, embed=embed, head=head, drafter=drafter, dir=out, root=root)


def test_config_has_the_dflash_fields(exported):
    with open(f"{exported['dir']}/config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 10 and cfg["mask_token_id"] == 298
    assert cfg["target_layer_ids"] == [1, 4, 6] and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"block_size": 10, "mask_token_id": 298, "target_layer_ids": [1, 4, 6]}
    assert cfg["model_type"] == "qwen3" and cfg["num_hidden_layers"] == 3
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size"):
        assert cfg[key] == getattr(exported["target"].config, key), key


def test_weight_names_are_the_reference_names(exported):
    with safe_open(f"{exported['dir']}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
    reference = DFlashDraftModel.from_pretrained(exported["dir"])
    assert names == set(reference.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.2.self_attn.k_norm.weight", "layers.1.mlp.down_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_reference_loads_every_weight(exported):
    reference, info = DFlashDraftModel.from_pretrained(exported["dir"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert reference.block_size == 10 and reference.mask_token_id == 298
    assert reference.target_layer_ids == [1, 4, 6]
    ours = exported["drafter"].state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, ours[name]), name


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_round_trip_is_bit_for_bit(exported, dtype, tmp_path):
    drafter = exported["drafter"]
    out = export_drafter(drafter, str(tmp_path / "d"), dtype=dtype)
    loaded = load_drafter(out, exported["embed"], exported["head"])
    assert (loaded.block_size, loaded.mask_token_id, loaded.target_layer_ids, loaded.num_target_layers) == (
        10, 298, [1, 4, 6], 8)
    expected = {k: (v if dtype is None else v.to(dtype)) for k, v in drafter.state_dict().items()}
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name
    assert loaded.head_weight is not loaded.embed_weight and torch.equal(loaded.head_weight, exported["head"])
    if dtype is None:  # same weights, same function
        ids = torch.randint(0, 290, (1, 20))
        ctx = torch.randn(1, 20, 3 * 32)
        anchors = torch.tensor([[4, 9]])
        with torch.no_grad():
            assert torch.equal(drafter(ids, ctx, anchors), loaded(ids, ctx, anchors))
        # Exporting the loaded drafter again gives identical files.
        again = export_drafter(loaded, str(tmp_path / "again"))
        with open(f"{out}/model.safetensors", "rb") as a, open(f"{again}/model.safetensors", "rb") as b:
            assert a.read() == b.read()


def test_target_dtype_reads_what_the_checkpoint_declares(tmp_path):
    from dflash_ray.model.target import target_dtype

    for key, value, want in (("dtype", "bfloat16", torch.bfloat16), ("torch_dtype", "float16", torch.float16),
                             (None, None, torch.float32)):
        d = tmp_path / str(key)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3", **({key: value} if key else {})}))
        assert target_dtype(str(d)) == want


def test_export_files_are_readable_by_others(exported):
    import stat

    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE(os.stat(f"{exported['dir']}/{name}").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(exported["dir"]).st_mode) == 0o755
