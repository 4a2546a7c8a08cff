"""train.loss=distill: the target's next-token top-k as the drafter's soft labels.

Oracles: the target's own Hugging Face forward (its logits, softmax and topk written out here) for the
top-k the target actors compute; a dense cross-entropy against the scattered label distribution
(log_softmax over the full vocabulary) for the chunked loss and its gradient; the hard labels for the
alignment of soft labels with block slots (slot k of anchor a learns the target's prediction at a+k-1).
"""
import numpy as np
import pytest
import torch

from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.model.loss import chunked_head_ce, mix_soft_labels, reference_head_ce
from dflash_ray.model.target import (TargetFeatureExtractor, build_synthetic_target, load_feature_extractor,
                                     load_target)
from dflash_ray.runtime.stream.feature_cache import FeatureCache, cache_bytes, soft_label_key
from dflash_ray.runtime.stream.rows import decode_soft_labels, encode_soft_labels
from helpers_model import TINY_QWEN3

pytestmark = pytest.mark.rounding

VOCAB, MASK, BLOCK = 300, 299, 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    tdir = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 4, "initializer_range": 0.2}, VOCAB,
                                  str(root / "target"), seed=3)
    target = load_target(tdir)
    cfg = DrafterConfig(num_draft_layers=1, block_size=BLOCK, num_anchors=5, mask_token_id=MASK)
    drafter = build_drafter(cfg, target.config, target.model.embed_tokens.weight, target.lm_head.weight, seed=0,
                            attention_backend="sdpa")
    with torch.no_grad():   # weights that matter (the seeded init is near zero)
        g = torch.Generator().manual_seed(1)
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, MASK, (2, 24), generator=g)
    lengths = torch.tensor([24, 19])
    ids[1, 19:] = 0
    loss_mask = torch.zeros(2, 24, dtype=torch.long)
    loss_mask[0, 4:24] = 1
    loss_mask[1, 3:19] = 1
    context = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids)
    return dict(tdir=tdir, target=target, drafter=drafter, ids=ids, lengths=lengths, loss_mask=loss_mask,
                context=context)


def test_soft_label_loss_and_gradient_equal_dense_cross_entropy():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    weights = torch.rand(37, generator=g)
    ids = torch.randint(0, 50, (37, 4), generator=g)      # duplicates within a row included
    probs = torch.rand(37, 4, generator=g)
    loss, correct = chunked_head_ce(hidden, head, labels, weights, 8, ids, probs)
    (gh,) = torch.autograd.grad(loss * 1.7, hidden)
    h2 = hidden.detach().clone().requires_grad_(True)
    ref, ref_correct = reference_head_ce(h2, head, labels, weights, ids, probs)
    (gr,) = torch.autograd.grad(ref * 1.7, h2)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, gr, rtol=1e-4, atol=1e-5)
    assert torch.equal(correct, ref_correct)


def test_a_one_hot_soft_label_is_the_hard_cross_entropy():
    g = torch.Generator().manual_seed(1)
    hidden, head = torch.randn(20, 8, generator=g), torch.randn(30, 8, generator=g)
    labels, weights = torch.randint(0, 30, (20,), generator=g), torch.rand(20, generator=g)
    hard, _ = chunked_head_ce(hidden, head, labels, weights, 7)
    ref, _ = reference_head_ce(hidden, head, labels, weights)
    # hard_weight 1: the target's top-k gets no mass, the label all of it
    ids, probs = mix_soft_labels(torch.randint(0, 30, (20, 3), generator=g), torch.rand(20, 3, generator=g), labels, 1.0)
    soft, _ = chunked_head_ce(hidden, head, labels, weights, 7, ids, probs)
    torch.testing.assert_close(hard, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(soft, ref, rtol=1e-5, atol=1e-5)


def test_mix_renormalises_the_top_k_and_adds_the_hard_label():
    ids, probs = mix_soft_labels(torch.tensor([[5, 7]]), torch.tensor([[0.3, 0.1]]), torch.tensor([5]), 0.2)
    assert ids.tolist() == [[5, 7, 5]]
    # 0.3 / 0.4 and 0.1 / 0.4 of the 0.8 left to the target, 0.2 to the label
    torch.testing.assert_close(probs, torch.tensor([[0.6, 0.2, 0.2]]))


def test_target_top_k_is_the_targets_own_distribution(world, tmp_path):
    extract = load_feature_extractor(world["tdir"], world["drafter"].target_layer_ids, top_k=5)
    ids, lengths = world["ids"], world["lengths"]
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    feats, top_ids, top_probs = extract.features_and_top_k(ids, attn)
    with torch.no_grad():
        logits = world["target"](ids, attention_mask=attn).logits.float()
    p = torch.softmax(logits, dim=-1)
    want_p, want_ids = p.topk(5, dim=-1)
    for b, n in enumerate(lengths.tolist()):   # positions inside each row (padding's values are not used)
        assert torch.equal(top_ids[b, :n].long(), want_ids[b, :n])
        torch.testing.assert_close(top_probs[b, :n], want_p[b, :n], rtol=1e-5, atol=1e-6)
    # the features are the extractor's without the head
    plain = load_feature_extractor(world["tdir"], world["drafter"].target_layer_ids)(ids, attn)
    torch.testing.assert_close(feats, plain)
    assert top_ids.dtype == torch.int32 and top_probs.dtype == torch.float32


def test_slot_k_learns_the_prediction_at_a_plus_k_minus_1(world):
    """Soft labels that put all mass on the next token (position p: x[p+1]) train exactly what the hard labels
    train; shifted one position, they do not."""
    d, s = world["drafter"], world
    ids = s["ids"]
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)      # position p predicts x[p+1]
    one = torch.ones(ids.shape + (1,))
    args = (ids, s["loss_mask"], s["context"], s["lengths"])
    hard = d.training_loss(*args, torch.Generator().manual_seed(4))
    soft = d.training_loss(*args, torch.Generator().manual_seed(4), (nxt[..., None], one), 0.0)
    torch.testing.assert_close(soft.loss_sum, hard.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(soft.slot_correct, hard.slot_correct) and soft.weight_sum == hard.weight_sum
    shifted = torch.cat([ids[:, 2:], ids[:, :2]], dim=1)   # position p would predict x[p+2]: wrong
    off = d.training_loss(*args, torch.Generator().manual_seed(4), (shifted[..., None], one), 0.0)
    assert abs(float(off.loss_sum.detach()) - float(hard.loss_sum.detach())) > 1e-2


def test_soft_labels_encode_and_decode_and_cache(tmp_path):
    ids = torch.tensor([[[3, 9], [40000, 1]]], dtype=torch.int32)
    probs = torch.tensor([[[0.5, 0.25], [0.125, 1e-7]]])
    enc = encode_soft_labels(ids, probs)
    assert enc.dtype == np.int32 and enc.shape == (1, 2, 4)
    back_ids, back_p = decode_soft_labels(enc)
    assert back_ids.tolist() == ids.tolist() and torch.equal(back_p, probs)
    cache = FeatureCache(tmp_path, soft_label_key("k", 2))
    cache.put(7, enc[0])
    assert np.array_equal(cache.get(7, 2), enc[0]) and cache.dir.name == "k-top2"
    # 8 bytes a token per k beside the features' taps x hidden x 2 (bf16)
    assert cache_bytes(10, 2, 4, "bfloat16", top_k=3) == 10 * (2 * 4 * 2 + 24)
