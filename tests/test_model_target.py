"""Target side of the model layer: layer-id formula, feature capture against the reference, frozen loading,
embedding/head loading that honours tie_word_embeddings."""
import json

import pytest
import torch

import dflash_ray.model.target as target_module
from dflash.model import build_target_layer_ids, extract_context_feature
from dflash_ray.model.target import (
    TargetFeatureExtractor,
    build_synthetic_target,
    default_mask_token_id,
    default_target_layer_ids,
    load_embed_and_head,
    load_feature_extractor,
    load_target,
)
from helpers_model import TINY_QWEN3

pytestmark = pytest.mark.rounding

TINY = {**TINY_QWEN3, "num_hidden_layers": 6, "initializer_range": 0.1}
VOCAB = 300


@pytest.fixture(scope="module")
def target_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    tied = build_synthetic_target({**TINY, "tie_word_embeddings": True}, VOCAB, str(root / "tied"), seed=0)
    untied = build_synthetic_target({**TINY, "tie_word_embeddings": False}, VOCAB, str(root / "untied"), seed=1)
    return {"tied": tied, "untied": untied}


def test_default_layer_ids_match_reference_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    for layers in (4, 6, 12, 28, 36, 64):
        for draft in (1, 2, 3, 5, 8):
            assert default_target_layer_ids(layers, draft) == build_target_layer_ids(layers, draft)


def test_synthetic_target_is_seeded_and_loads_frozen(target_dirs, tmp_path):
    again = build_synthetic_target({**TINY, "tie_word_embeddings": True}, VOCAB, str(tmp_path / "again"), seed=0)
    a, b = load_target(target_dirs["tied"]), load_target(again)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    other = load_target(target_dirs["untied"])
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert a.config.vocab_size == VOCAB and a.dtype == torch.float32
    assert not a.training and not any(p.requires_grad for p in a.parameters())


@pytest.mark.parametrize("layer_ids", [[1, 3], [0, 2, 4], [1, 5], [3, 3]])
def test_features_equal_reference_extract_context_feature(target_dirs, layer_ids):
    target = load_target(target_dirs["untied"])
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding on the second sample
    ours = TargetFeatureExtractor(target, layer_ids)(ids, attention_mask=mask)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    ref = extract_context_feature(out.hidden_states, layer_ids)  # layer 5 = last: HF gives it post-norm
    assert ours.shape == (2, 23, len(layer_ids) * TINY["hidden_size"])
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1, :15], ref[1, :15], rtol=0, atol=1e-5)


def test_extractor_skips_later_layers_and_the_head(target_dirs):
    target = load_target(target_dirs["tied"])
    calls = []
    for i, layer in enumerate(target.model.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.append(i))
    target.lm_head.register_forward_hook(lambda *_: calls.append("lm_head"))
    target.model.norm.register_forward_hook(lambda *_: calls.append("norm"))
    TargetFeatureExtractor(target, [1, 3])(torch.randint(0, VOCAB, (1, 9)))
    assert calls == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        TargetFeatureExtractor(target, [1, 6])


@pytest.fixture(params=["device_map", "host"])
def load_path(request, monkeypatch):
    """Both ways a target loads: straight onto the device (device_map, needs accelerate), and the fallback
    when accelerate is missing (CPU, then moved). Yields the device_map each from_pretrained call got."""
    from transformers import AutoModel, AutoModelForCausalLM

    calls = []
    for cls in (AutoModel, AutoModelForCausalLM):
        real = cls.from_pretrained.__func__

        def spy(klass, *args, _real=real, **kwargs):
            calls.append(kwargs.get("device_map"))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    if request.param == "host":
        monkeypatch.setattr(target_module, "can_load_on_device", lambda: False)
        monkeypatch.setattr(target_module, "_warned_host_load", False)
    else:
        assert target_module.can_load_on_device()  # accelerate is a dependency
    yield request.param, calls


@pytest.mark.parametrize("layer_ids", [[1, 3], [1, 5]])
def test_feature_extractor_loads_only_the_layers_it_runs(target_dirs, layer_ids, load_path):
    with torch.no_grad():  # the oracle: the full model's hidden states, loaded the plain HF way
        from transformers import Qwen3ForCausalLM

        full = Qwen3ForCausalLM.from_pretrained(target_dirs["untied"]).eval()
    path, calls = load_path
    pruned = load_feature_extractor(target_dirs["untied"], layer_ids, device="cpu")
    assert calls == ([{"": torch.device("cpu")}] if path == "device_map" else [None])
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = extract_context_feature(full(ids, output_hidden_states=True).hidden_states, layer_ids)
    torch.testing.assert_close(pruned(ids), ref, rtol=0, atol=1e-5)
    assert len(pruned.decoder.layers) == max(layer_ids) + 1  # later layers never loaded
    assert not hasattr(pruned.target, "lm_head")  # the decoder alone: the untied head is never built
    names = {n for n, _ in pruned.target.named_parameters()}
    assert not any(n.startswith("lm_head") or f"layers.{max(layer_ids) + 1}." in n for n in names)
    assert {p.device.type for p in pruned.parameters()} == {"cpu"} and not pruned.target.training
    assert not any(p.requires_grad for p in pruned.parameters())


def test_load_target_on_either_path_gives_the_same_frozen_model(target_dirs, load_path):
    from transformers import Qwen3ForCausalLM

    path, calls = load_path
    model = load_target(target_dirs["untied"], device="cpu")
    assert calls == ([{"": torch.device("cpu")}] if path == "device_map" else [None])
    plain = Qwen3ForCausalLM.from_pretrained(target_dirs["untied"])
    assert list(model.state_dict()) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_without_accelerate_the_host_load_is_said_once(target_dirs, monkeypatch, caplog):
    monkeypatch.setattr(target_module, "can_load_on_device", lambda: False)
    monkeypatch.setattr(target_module, "_warned_host_load", False)
    with caplog.at_level("WARNING", logger=target_module.__name__):
        load_feature_extractor(target_dirs["tied"], [1, 3])
        load_target(target_dirs["tied"])
    lines = [r for r in caplog.records if r.name == target_module.__name__]
    assert len(lines) == 1 and "accelerate" in lines[0].getMessage()


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_embed_and_head_loaded_alone_honour_tying(target_dirs, kind):
    embed, head = load_embed_and_head(target_dirs[kind])
    target = load_target(target_dirs[kind])
    assert torch.equal(embed, target.model.embed_tokens.weight)
    assert torch.equal(head, target.lm_head.weight)
    with open(f"{target_dirs[kind]}/config.json") as f:
        tied = json.load(f)["tie_word_embeddings"]
    assert tied == (kind == "tied")
    assert (head is embed) == tied
    if not tied:
        assert not torch.equal(head, embed)


def test_default_mask_token_id():
    class Tok:
        mask_token_id = None

        def __len__(self):
            return 151669

    assert default_mask_token_id(151936, Tok()) == 151669
    Tok.mask_token_id = 7
    assert default_mask_token_id(151936, Tok()) == 7
    assert default_mask_token_id(300) == 299


def test_model_layer_imports_no_ray():
    import subprocess
    import sys

    code = "import sys, dflash_ray.model; sys.exit(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
