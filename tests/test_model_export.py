"""Export writes what the reference `dflash.DFlashDraftModel.from_pretrained` loads, and loads back bit for bit."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from dflash.model import DFlashDraftModel
from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.model.export import SHIPPED, export_drafter, load_drafter
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

    for name in ("model.safetensors", "config.json", "README.md", "modeling_dflash.py", "draft_core.py"):
        assert stat.S_IMODE(os.stat(f"{exported['dir']}/{name}").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(exported["dir"]).st_mode) == 0o755


# ----------------------------------------------------------------------------- the model card and hub fields
CARD = {"target": None,  # set per test: a Hugging Face cache snapshot of Qwen/Qwen3-8B
        "data": "ShareGPT, regenerated by the target (1,000 conversations)", "steps": 1234, "epochs": 6,
        "heldout_tau": {"initial": {"tau": 1.0, "prompts": 16}, "trained": {"tau": 3.6312, "prompts": 16}}}


def _snapshot(root):
    """A directory shaped like huggingface_hub's cache snapshot of Qwen/Qwen3-8B (what a hub id resolves to)."""
    d = root / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def _serve_commands(text):
    import re

    sglang = re.search(r"python -m sglang\.launch_server (.+?)\n\s*(.+?)\n", text)
    vllm = re.search(r"vllm serve (\S+) --speculative-config '(.+?)'", text)
    return " ".join(sglang.groups()).replace("\\", " ").split(), vllm.group(1), json.loads(vllm.group(2))


def test_export_writes_a_model_card_hub_loaders_read(exported, tmp_path):
    from huggingface_hub import ModelCard

    from dflash_ray.model.export import read_card_facts

    card = {**CARD, "target": _snapshot(tmp_path)}
    out = export_drafter(exported["drafter"], str(tmp_path / "carded"), card=card)
    assert sorted(os.listdir(out)) == sorted(["README.md", "config.json", "model.safetensors", *SHIPPED])
    loaded = ModelCard.load(f"{out}/README.md")
    meta = loaded.data.to_dict()
    assert meta["library_name"] == "dflash" and meta["base_model"] == "Qwen/Qwen3-8B"
    assert {"dflash", "speculative-decoding"} <= set(meta["tags"])
    text = loaded.text
    # what the drafter is, from its config (block 10, taps 1, 4, 6 of 8 layers, MASK 298, 3 layers)
    assert "| target layers tapped | 1, 4, 6 (of 8;" in text
    assert "| block size | 10 (the anchor token + 9 MASK positions" in text
    assert "| MASK token id | 298 |" in text and "| drafter | 3 Qwen3 decoder layers, hidden 32, float32;" in text
    # the run's facts
    assert f"| target | `{card['target']}` (hub: `Qwen/Qwen3-8B`) |" in text
    assert "| training data | ShareGPT, regenerated by the target (1,000 conversations) |" in text
    assert "| training steps | 1,234 |" in text and "| epochs | 6 |" in text
    assert "| held-out tau | 3.63 on 16 prompts (freshly initialised drafter: 1.00 on 16 prompts)" in text
    assert "not recorded" not in text
    # the serve commands: the target's hub id, the export's absolute path, vLLM's token count = block - 1
    sglang, vllm_target, spec = _serve_commands(text)
    path = str((tmp_path / "carded").resolve())
    assert sglang == ["--model-path", "Qwen/Qwen3-8B", "--speculative-algorithm", "DFLASH",
                      "--speculative-draft-model-path", path]
    assert vllm_target == "Qwen/Qwen3-8B"
    assert spec == {"method": "dflash", "model": path, "num_speculative_tokens": 10 - 1}
    assert f'DFlashDraftModel.from_pretrained("{path}")' in text
    # the facts read back from the front matter (push rewrites the card with them)
    assert read_card_facts(out) == card


def test_a_card_without_the_runs_facts_says_so(exported):
    from huggingface_hub import ModelCard

    loaded = ModelCard.load(f"{exported['dir']}/README.md")
    assert "base_model" not in loaded.data.to_dict()  # no target named: no hub relation claimed
    for row in ("target", "training data", "training steps", "held-out tau"):
        assert f"| {row} | not recorded |" in loaded.text, row


def test_a_local_target_is_not_claimed_as_a_hub_model(exported, tmp_path, monkeypatch):
    from huggingface_hub import ModelCard

    from dflash_ray.model.export import target_hub_id

    local = tmp_path / "models" / "my-target"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # "models/my-target" is shaped like a hub id, but it is a directory here
    assert target_hub_id("models/my-target") is None and target_hub_id("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert target_hub_id(str(local)) is None
    assert target_hub_id(str(exported["root"] / "target")) is None
    out = export_drafter(exported["drafter"], str(tmp_path / "d"), card={"target": str(local), "heldout_tau": 2.5})
    loaded = ModelCard.load(f"{out}/README.md")
    assert "base_model" not in loaded.data.to_dict()
    assert f"--model-path {local} " in loaded.text and "| held-out tau | 2.50 (" in loaded.text


def test_an_unknown_card_field_fails_and_writes_nothing(exported, tmp_path):
    with pytest.raises(ValueError, match=r"unknown fields \['stpes'\]"):
        export_drafter(exported["drafter"], str(tmp_path / "typo"), card={"stpes": 10})
    assert not (tmp_path / "typo").exists()


def test_write_model_card_rewrites_the_card_only(exported, tmp_path):
    from dflash_ray.model.export import write_model_card

    out = export_drafter(exported["drafter"], str(tmp_path / "d"), card={**CARD, "target": "Qwen/Qwen3-8B"})
    before = {n: open(f"{out}/{n}", "rb").read() for n in ("config.json", "model.safetensors")}
    write_model_card(out, {**CARD, "target": "Qwen/Qwen3-8B", "repo_id": "someone/qwen3-8b-dflash"})
    assert {n: open(f"{out}/{n}", "rb").read() for n in before} == before
    text = open(f"{out}/README.md").read()
    _, _, spec = _serve_commands(text)
    assert spec["model"] == "someone/qwen3-8b-dflash" and str(tmp_path) not in text


@pytest.mark.parametrize("dtype, name", [(None, "float32"), (torch.bfloat16, "bfloat16")])
def test_config_has_the_fields_hub_loaders_read(exported, tmp_path, dtype, name):
    """architectures (the reference picks its class by it, SGLang and vLLM map it), model_type (AutoConfig),
    dtype and torch_dtype (transformers 5 and 4) equal to the weights' dtype; auto_map to the code the export
    ships (transformers' AutoModel path; the reference builds DFlashDraftModel itself and ignores it)."""
    from transformers import AutoConfig

    out = export_drafter(exported["drafter"], str(tmp_path / name), dtype=dtype)
    with open(f"{out}/config.json") as f:
        cfg = json.load(f)
    with safe_open(f"{out}/model.safetensors", framework="pt") as f:
        stored = {str(f.get_tensor(k).dtype).replace("torch.", "") for k in f.keys()}
    assert stored == {name} and cfg["dtype"] == cfg["torch_dtype"] == name
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}   # the shipped code (test_export_remote_code)
    auto = AutoConfig.from_pretrained(out)  # what the reference's loader reads first
    assert type(auto).__name__ == "Qwen3Config" and auto.architectures == ["DFlashDraftModel"]
    assert auto.dtype == getattr(torch, name)
