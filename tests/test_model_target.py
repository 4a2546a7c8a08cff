"""Target side of the model layer: layer-id formula, feature capture against the reference, frozen loading,
embedding/head loading that honours tie_word_embeddings."""
import json

import pytest
import torch

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


@pytest.mark.parametrize("layer_ids", [[1, 3], [1, 5]])
def test_feature_extractor_loads_only_the_layers_it_runs(target_dirs, layer_ids):
    full = load_target(target_dirs["untied"])
    pruned = load_feature_extractor(target_dirs["untied"], layer_ids)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(pruned(ids), TargetFeatureExtractor(full, layer_ids)(ids), rtol=0, atol=1e-6)
    assert len(pruned.decoder.layers) == max(layer_ids) + 1  # later layers never loaded
    assert isinstance(pruned.target.lm_head, torch.nn.Identity)  # the untied head is gone
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in full.parameters())


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
