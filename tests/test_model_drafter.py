"""The drafter's training forward and loss, against the reference `dflash.model.DFlashDraftModel`.

The reference runs one block at inference: context features of positions < a, block [x[a], MASK...] at
positions a..a+B-1. Our training forward runs many blocks at once under a mask; for every block it must give
the reference's logits, it must not see context position >= a, and the loss must supervise slot k with
x[a+k]. These are the three bugs that have shipped near-zero-acceptance drafters elsewhere.
"""
import copy
import json
import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn import functional as F

import dflash_ray.model.attention as attention
from dflash.model import DFlashDraftModel
from dflash_ray.model.drafter import DFlashDrafter, DrafterConfig, build_drafter, drafter_config
from dflash_ray.model.export import export_drafter
from dflash_ray.model.loss import (
    chunked_head_ce,
    default_gamma,
    expected_acceptance_length,
    reference_head_ce,
    slot_weights,
)
from dflash_ray.model.target import TargetFeatureExtractor, build_synthetic_target, load_target
from helpers_model import TINY_QWEN3

pytestmark = pytest.mark.rounding
TINY = {**TINY_QWEN3, "num_hidden_layers": 6, "initializer_range": 0.1}
VOCAB, MASK, BLOCK = 300, 299, 8


def _perturb(module, seed, scale=0.1):
    # Random init of the drafter is near-zero (std 0.02); make every weight matter, norms included.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module", params=["untied", "tied"])
def setup(request, tmp_path_factory):
    """A tiny target, a perturbed drafter, the same drafter loaded by the reference, a batch with features."""
    tied = request.param == "tied"
    root = tmp_path_factory.mktemp(request.param)
    tdir = build_synthetic_target({**TINY, "tie_word_embeddings": tied}, VOCAB, str(root / "target"), seed=3)
    target = load_target(tdir)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    cfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=6, mask_token_id=MASK)
    drafter = build_drafter(cfg, target.config, embed, head, seed=0, attention_backend="sdpa")
    _perturb(drafter, seed=1)
    reference = DFlashDraftModel.from_pretrained(export_drafter(drafter, str(root / "drafter"))).eval()

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, MASK, (2, 40), generator=g)
    lengths = torch.tensor([40, 29])
    loss_mask = torch.zeros(2, 40, dtype=torch.long)
    loss_mask[0, 10:25] = 1
    loss_mask[0, 30:40] = 1          # two assistant turns
    loss_mask[1, 6:29] = 1
    ids[1, 29:] = 0                  # right padding
    context = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids)
    return dict(target=target, drafter=drafter, reference=reference, ids=ids, lengths=lengths,
                loss_mask=loss_mask, context=context, tied=tied)


def _reference_block_logits(s, b, anchor, block_len=BLOCK, reference=None):
    """The reference's inference logits for slots 1..L-1 of the block at `anchor` of sample b."""
    reference = s["reference"] if reference is None else reference
    block = torch.full((1, block_len), MASK)
    block[0, 0] = s["ids"][b, anchor]
    noise = F.embedding(block, s["target"].model.embed_tokens.weight)
    with torch.no_grad():
        hidden = reference(
            target_hidden=s["context"][b:b + 1, :anchor], noise_embedding=noise,
            position_ids=torch.arange(anchor + block_len)[None],
        )[:, 1 - block_len:]
        return reference.compute_logits(hidden, s["target"].lm_head)[0]


def _valid_anchors(s, b):
    lm, n = s["loss_mask"][b].bool(), int(s["lengths"][b])
    return [a for a in range(1, n - 1) if lm[a] and lm[a + 1]]


def test_training_logits_equal_reference_inference(setup):
    s = setup
    anchors = []
    for b in range(2):
        valid = _valid_anchors(s, b)
        anchors.append([valid[0], valid[1], valid[len(valid) // 2], valid[-2], valid[-1]])
    anchors = torch.tensor(anchors)
    with torch.no_grad():
        logits = s["drafter"].logits(s["drafter"](s["ids"], s["context"], anchors))
    assert logits.shape == (2, 5, BLOCK, VOCAB)
    assert logits.std() > 0.3  # logits large enough that a wrong context or position would show
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            ref = _reference_block_logits(s, b, a)
            diff = (logits[b, n, 1:] - ref).abs().max().item()
            assert diff < 1e-4, f"sample {b} anchor {a}: max abs diff {diff}"


def test_untied_head_is_the_lm_head(setup):
    s = setup
    d = s["drafter"]
    assert d.tied == s["tied"]
    assert torch.equal(d.head_weight, s["target"].lm_head.weight)
    if not s["tied"]:
        assert not torch.equal(d.head_weight, d.embed_weight)


def _blocks_with_context_perturbed(s, anchors, b, start):
    ctx = s["context"].clone()
    ctx[b, start:] = torch.randn_like(ctx[b, start:]) * 5
    with torch.no_grad():
        return s["drafter"].logits(s["drafter"](s["ids"], ctx, anchors))


def _leaks(s, anchors):
    """Blocks whose logits change when context positions >= their anchor change (should be none), and
    blocks whose logits do NOT change when position anchor-1 changes (the check's own power)."""
    with torch.no_grad():
        base = s["drafter"].logits(s["drafter"](s["ids"], s["context"], anchors))
    leaks, blind = [], []
    for b in range(anchors.shape[0]):
        for n, a in enumerate(anchors[b].tolist()):
            if (_blocks_with_context_perturbed(s, anchors, b, a)[b, n] - base[b, n]).abs().max() > 1e-6:
                leaks.append((b, a))
            if (_blocks_with_context_perturbed(s, anchors, b, a - 1)[b, n] - base[b, n]).abs().max() < 1e-4:
                blind.append((b, a))
    return leaks, blind


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_block_never_sees_context_at_or_after_its_anchor(setup, backend, monkeypatch):
    s = setup
    monkeypatch.setattr(s["drafter"], "attention_backend", backend)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    anchors = torch.tensor([[5, 12, 31], [7, 20, 26]])
    leaks, blind = _leaks(s, anchors)
    assert leaks == [] and blind == []


def test_leak_check_catches_a_one_position_leak(setup, monkeypatch):
    """The check above must fail for the classic bug: a mask that lets the block see position a."""
    s = setup
    rule = attention.block_visible

    def leaky(q_idx, kv_idx, anchors_b, ctx_len, block_size):
        anchor = anchors_b[q_idx // block_size]
        return rule(q_idx, kv_idx, anchors_b, ctx_len, block_size) | ((kv_idx < ctx_len) & (kv_idx == anchor))

    monkeypatch.setattr(attention, "block_visible", leaky)
    leaks, _ = _leaks(s, torch.tensor([[5, 12, 31], [7, 20, 26]]))
    assert len(leaks) == 6


def test_blocks_do_not_see_each_other(setup):
    s = setup
    anchors = torch.tensor([[10, 11, 30], [6, 7, 20]])
    ids2 = s["ids"].clone()
    ids2[0, 11] = (ids2[0, 11] + 1) % MASK  # block 1's anchor token; also block 0's label, never its input
    with torch.no_grad():
        a = s["drafter"].logits(s["drafter"](s["ids"], s["context"], anchors))
        b = s["drafter"].logits(s["drafter"](ids2, s["context"], anchors))
    assert torch.equal(a[0, 0], b[0, 0]) and torch.equal(a[0, 2], b[0, 2]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0, 1], b[0, 1])


def test_flex_split_and_sdpa_agree(setup):
    """Same numbers from the three kernels. (torch 2.13 has no FlexAttention backward on the CPU, so the CPU
    trains through the split kernel: 'auto' picks it; the GPU's flex backward is torch's own, tested upstream.)"""
    s = setup
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    d = s["drafter"]
    anchors = torch.tensor([[3, 12, 33], [7, 8, 26]])
    results = {}
    with torch.no_grad():
        for backend in ("sdpa", "flex", "split"):
            d.attention_backend = backend
            results[backend] = d(s["ids"], s["context"], anchors)
    d.attention_backend = "sdpa"
    torch.testing.assert_close(results["flex"], results["sdpa"], rtol=0, atol=1e-5)
    torch.testing.assert_close(results["split"], results["sdpa"], rtol=0, atol=1e-5)
    assert attention.resolve_backend("auto", torch.device("cpu")) == "split"
    assert attention.resolve_backend("auto", torch.device("cuda")) == "flex"


def test_anchor_sampling(setup):
    s = setup
    d = s["drafter"]
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(5):
        anchors, valid = d.sample_anchors(s["loss_mask"], s["lengths"], g)
        assert anchors.shape[1] == d.num_anchors
        for b in range(2):
            chosen = anchors[b][valid[b]].tolist()
            assert chosen == sorted(set(chosen)) and len(chosen) == d.num_anchors
            assert set(chosen) <= set(_valid_anchors(s, b))
        seen.add(tuple(anchors.flatten().tolist()))
    assert len(seen) > 1  # resampled every step
    a1, _ = d.sample_anchors(s["loss_mask"], s["lengths"], torch.Generator().manual_seed(7))
    a2, _ = d.sample_anchors(s["loss_mask"], s["lengths"], torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2)
    # Fewer valid positions than num_anchors: all of them, padded with invalid anchors.
    few = torch.zeros_like(s["loss_mask"])
    few[0, 20:23] = 1
    anchors, valid = d.sample_anchors(few, s["lengths"], g)
    assert anchors[0][valid[0]].tolist() == [20, 21] and not valid[1].any()


def _reference_loss(s, anchors, valid, reference=None):
    """Loss parts recomputed by hand from the reference's logits and labels x[a+k]: weighted CE, per-slot
    argmax hits, blocks whose slots 1..k all hit, and each block's run of leading hits (what greedy
    verification would accept)."""
    gamma = default_gamma(BLOCK)
    loss, wsum, blocks, runs = 0.0, 0.0, 0, []
    correct, count, prefix = torch.zeros(BLOCK - 1), torch.zeros(BLOCK - 1), torch.zeros(BLOCK - 1)
    for b in range(anchors.shape[0]):
        n_tok = int(s["lengths"][b])
        for a in anchors[b][valid[b]].tolist():
            ref = _reference_block_logits(s, b, a, reference=reference)
            run, leading = True, 0
            for k in range(1, BLOCK):
                if a + k >= n_tok or not s["loss_mask"][b, a + k]:
                    break                      # slots after the first unsupervised one are not trained
                w = math.exp(-(k - 1) / gamma)
                label = s["ids"][b, a + k]
                loss += w * F.cross_entropy(ref[k - 1][None], label[None]).item()
                wsum += w
                hit = bool(ref[k - 1].argmax() == label)
                correct[k - 1] += hit
                count[k - 1] += 1
                run = run and hit
                prefix[k - 1] += run
                leading += run
            blocks += bool(s["loss_mask"][b, a + 1])  # slot 1 supervised
            runs.append(leading)
    return dict(loss=loss, wsum=wsum, correct=correct, count=count, prefix=prefix, blocks=blocks,
                acceptance=1 + sum(runs) / len(runs))


def _assert_loss_matches(out, ref):
    assert math.isclose(out.loss_sum.item(), ref["loss"], rel_tol=1e-5)
    assert math.isclose(out.weight_sum.item(), ref["wsum"], rel_tol=1e-6)
    assert out.slot_correct.tolist() == ref["correct"].tolist()
    assert out.slot_count.tolist() == ref["count"].tolist()
    assert out.prefix_correct.tolist() == ref["prefix"].tolist()
    assert int(out.num_blocks) == ref["blocks"]
    assert math.isclose(out.measured_acceptance_length(), ref["acceptance"], rel_tol=1e-12)


def test_anchor_rule_needs_context_and_two_supervised_tokens(setup, monkeypatch):
    """Anchor a needs loss_mask[a] and loss_mask[a+1], a + 1 < length, and a >= 1 (anchor 0 would draft
    with no context), here with loss_mask[0] and [1] set and the mask running past the length."""
    d = setup["drafter"]
    lm = torch.zeros(2, 12, dtype=torch.long)
    lm[0, [0, 1, 2, 4, 6, 7, 8, 11]] = 1
    lm[1] = 1
    lengths = torch.tensor([12, 9])
    monkeypatch.setattr(d, "num_anchors", 64)  # room for every valid anchor: the full set comes back
    anchors, valid = d.sample_anchors(lm, lengths, torch.Generator().manual_seed(0))
    assert anchors[0][valid[0]].tolist() == [1, 6, 7]           # not 0, 2, 4, 8 (next unmasked) or 11
    assert anchors[1][valid[1]].tolist() == [1, 2, 3, 4, 5, 6, 7]  # not 0, nor 8 (a + 1 = length)
    monkeypatch.setattr(d, "num_anchors", 3)  # sampled: anchor 0 is never drawn, every valid one is
    g = torch.Generator().manual_seed(0)
    drawn = set()
    for _ in range(20):
        anchors, valid = d.sample_anchors(lm, lengths, g)
        assert valid.all()
        drawn.update(anchors[1].tolist())
    assert drawn == {1, 2, 3, 4, 5, 6, 7}


def test_loss_equals_weighted_ce_on_reference_logits(setup):
    """loss_sum / weight_sum / slot counts recomputed from the reference's logits and labels x[a+k]."""
    s = setup
    d = s["drafter"]
    out = d.training_loss(s["ids"], s["loss_mask"], s["context"], s["lengths"], torch.Generator().manual_seed(5))
    anchors, valid = d.sample_anchors(s["loss_mask"], s["lengths"], torch.Generator().manual_seed(5))
    ref = _reference_loss(s, anchors, valid)
    assert out.loss_sum.requires_grad
    _assert_loss_matches(out, ref)
    assert ref["count"][0] == ref["blocks"] == 2 * d.num_anchors
    assert ref["count"][-1] < ref["count"][0]  # sequence ends and turn ends mask slots


def test_supervision_stops_at_the_first_unsupervised_slot(setup):
    """Sample 0 has assistant turns at 10..24 and 30..39. The block at anchor 23 supervises slot 1 (x24)
    only: x25..29 is a user turn, and x30 (slot 7), supervised again, lies beyond what inference drafts.
    The block at 12 supervises all 7 slots (x13..19); sample 1 (tokens 6..28) ends inside the block at 26."""
    s, d = setup, setup["drafter"]
    anchors = torch.tensor([[23, 12], [26, 6]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    hidden = d(s["ids"], s["context"], anchors)
    out = d.block_loss(hidden, s["ids"], s["loss_mask"], s["lengths"], anchors, valid)
    # slot k counts blocks whose slots 1..k are all supervised: [23, 12, 26, 6] -> 4, 3, 2, 2, 2, 2, 2
    assert out.slot_count.tolist() == [4, 2 + 1, 2, 2, 2, 2, 2]
    assert int(out.num_blocks) == 4


def test_nan_in_padded_context_does_not_reach_the_loss(setup):
    """Masked keys still add 0 x value: the padded context (sample 1, positions >= 29) is zeroed first."""
    s, d = setup, setup["drafter"]
    poisoned = s["context"].clone()
    poisoned[1, 29:] = float("nan")
    outs = [d.training_loss(s["ids"], s["loss_mask"], ctx, s["lengths"], torch.Generator().manual_seed(0))
            for ctx in (s["context"], poisoned)]
    assert torch.isfinite(outs[1].loss_sum)
    assert outs[1].loss_sum.item() == pytest.approx(outs[0].loss_sum.item(), rel=1e-6)


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    """The setup's drafter after 20 Adam steps on the setup's batch, and the reference loading it: it then
    gets some slots right and some wrong, so the hit counts below compare something other than zeros."""
    s = setup
    d = copy.deepcopy(s["drafter"])
    d.num_anchors = 64  # every valid anchor, every step
    opt = torch.optim.Adam(d.trainable_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = d.training_loss(s["ids"], s["loss_mask"], s["context"], s["lengths"], g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    d.num_anchors = s["drafter"].num_anchors
    d.zero_grad()
    path = export_drafter(d, str(tmp_path_factory.mktemp("trained") / "drafter"))
    return d, DFlashDraftModel.from_pretrained(path).eval()


def test_hit_counts_of_a_partly_trained_drafter_equal_reference_counts(setup, trained):
    """slot_correct, prefix_correct, num_blocks and the measured acceptance length, against counts taken
    by hand from the reference's argmax, for a drafter that is right on some slots and wrong on others."""
    s = setup
    d, reference = trained
    with torch.no_grad():
        out = d.training_loss(s["ids"], s["loss_mask"], s["context"], s["lengths"], torch.Generator().manual_seed(5))
    anchors, valid = d.sample_anchors(s["loss_mask"], s["lengths"], torch.Generator().manual_seed(5))
    ref = _reference_loss(s, anchors, valid, reference)
    # The setup must make every count informative: hits and misses, and a hit after a miss in some
    # block (so prefix_correct differs from slot_correct), and an acceptance length between 1 and B.
    assert 0 < ref["correct"].sum() < ref["count"].sum()
    assert (ref["prefix"] < ref["correct"]).any() and ref["prefix"][0] > 0
    assert 1.5 < ref["acceptance"] < BLOCK - 1
    _assert_loss_matches(out, ref)


def test_only_trainable_weights_get_gradients(setup):
    s = setup
    d = s["drafter"]
    names = {n for n, _ in d.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert set(d.state_dict()) == names
    assert "embed_weight" in d._ddp_params_and_buffers_to_ignore
    d.zero_grad()
    out = d.training_loss(s["ids"], s["loss_mask"], s["context"], s["lengths"], torch.Generator().manual_seed(0))
    (out.loss_sum / out.weight_sum).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())
    assert not d.embed_weight.requires_grad and d.embed_weight.grad is None
    d.zero_grad()


def test_checkpointed_layers_give_the_same_loss_and_gradients_and_keep_less(setup):
    """train.recompute_layers recomputes each layer in backward: the same numbers, fewer saved tensors
    (counted with saved-tensor hooks: the memory model's claim that a layer then keeps only its input).
    SDPA only: flex attention has no backward on the CPU (the CUDA path runs in benchmarks/gpu_check.py)."""
    backend = "sdpa"
    d = setup["drafter"]
    s = setup
    saved = {}

    def run(flag):
        d.zero_grad()
        d.recompute_layers, d.attention_backend = flag, backend
        count = [0]

        def pack(t):
            count[0] += t.numel() * t.element_size()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = d.training_loss(s["ids"], s["loss_mask"], s["context"], s["lengths"],
                                      torch.Generator().manual_seed(3))
            saved[flag] = count[0]
            (out.loss_sum / out.weight_sum).backward()
        finally:
            d.recompute_layers, d.attention_backend = False, "auto"
        return out.loss_sum.detach(), {n: p.grad.clone() for n, p in d.named_parameters()}

    loss0, grads0 = run(False)
    loss1, grads1 = run(True)
    d.zero_grad()
    torch.testing.assert_close(loss1, loss0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], msg=n)
    assert saved[True] < 0.5 * saved[False]


def test_chunked_head_ce_matches_full_ce():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    weights = torch.rand(37, generator=g)
    loss, correct = chunked_head_ce(hidden, head, labels, weights, chunk_rows=8)
    (grad,) = torch.autograd.grad(loss * 3.0, hidden)
    ref_loss, ref_correct = reference_head_ce(hidden, head, labels, weights)
    (ref_grad,) = torch.autograd.grad(ref_loss * 3.0, hidden)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert torch.equal(correct, ref_correct)


def test_default_gamma_is_the_recipe_and_linear_between():
    """7 / 5 / 4 for B = 16 / 10 / 8 (the DFlash recipe); other B on the line through the neighbouring
    recipe points (slope 1/2 up to B = 10, 1/3 from there, both extended outwards), clamped at 1.
    Values worked out by hand from that rule."""
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(9) == 4.5                       # 4 + 1/2
    assert default_gamma(12) == pytest.approx(17 / 3)    # 5 + 2/3
    assert default_gamma(13) == pytest.approx(6.0)       # 5 + 3/3
    assert default_gamma(15) == pytest.approx(20 / 3)    # 5 + 5/3
    assert default_gamma(32) == pytest.approx(37 / 3)    # 5 + 22/3
    assert default_gamma(4) == 2.0 and default_gamma(3) == 1.5 and default_gamma(2) == 1.0  # 4 - (8-B)/2
    assert default_gamma(1) == 1.0                       # 0.5, clamped


def test_gamma_weights_and_acceptance_helpers():
    w = slot_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0 and math.isclose(w[7].item(), math.exp(-1), rel_tol=1e-6)  # k=8
    assert expected_acceptance_length([1.0] * 15) == 16.0
    assert expected_acceptance_length([0.0] * 15) == 1.0
    assert math.isclose(expected_acceptance_length([0.5, 0.5, 1.0]), 1 + 0.5 + 0.25 + 0.25)


def test_build_drafter_answers_the_config_nulls_by_rule(setup):
    """None in the typed config: the reference formula's layers, the recipe's gamma, the last row as mask."""
    target = setup["target"]
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    d = build_drafter(DrafterConfig(num_draft_layers=3, block_size=16, num_anchors=4), target.config, embed, head)
    assert isinstance(d, DFlashDrafter) and len(d.layers) == 3
    # round(1 + i * (6 - 4) / (3 - 1)) for i = 0, 1, 2 on the 6-layer target; gamma 7 for B = 16
    assert d.target_layer_ids == [1, 2, 3] and d.loss_gamma == 7.0 and d.mask_token_id == VOCAB - 1
    d = build_drafter(DrafterConfig(num_draft_layers=2, block_size=4, num_anchors=4, target_layer_ids=(0, 4),
                                    loss_gamma=2.5, mask_token_id=5), target.config, embed, head)
    assert d.target_layer_ids == [0, 4] and d.loss_gamma == 2.5 and d.block_size == 4 and d.mask_token_id == 5
    with pytest.raises(TypeError, match="DrafterConfig"):
        build_drafter({"num_draft_layers": 2, "block_size": 4, "num_anchors": 4}, target.config, embed, head)


def _built_the_former_way(cfg, target_config, embed, head, seed):
    """build_drafter before it took a device: constructed on the CPU under a forked, seeded CPU RNG."""
    config = drafter_config(target_config, cfg.num_draft_layers, cfg.block_size, cfg.mask_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DFlashDrafter(config, embed, head, num_anchors=cfg.num_anchors)


def test_build_drafter_on_the_cpu_device_keeps_the_seeded_weights(setup):
    """device='cpu': the weights the former CPU build gave for the seed, equal for equal seeds, and the
    global RNG untouched (every rank and the step-0 export rebuild the same drafter from the seed)."""
    target = setup["target"]
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    cfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=6, mask_token_id=MASK)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = build_drafter(cfg, target.config, embed, head, seed=11, device="cpu")
    b = build_drafter(cfg, target.config, embed, head, seed=11, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    other = build_drafter(cfg, target.config, embed, head, seed=12, device="cpu")
    former = _built_the_former_way(cfg, target.config, embed, head, seed=11)
    assert list(a.state_dict()) == list(former.state_dict())
    for name, value in former.state_dict().items():
        assert torch.equal(a.state_dict()[name], value), name
        assert torch.equal(b.state_dict()[name], value), name
    assert not torch.equal(other.fc.weight, a.fc.weight)
    for x, y in zip(a.buffers(), former.buffers()):  # RoPE frequencies, the frozen embedding/head
        assert torch.equal(x, y)
    assert a.tied == setup["tied"] and a.embed_weight.data_ptr() == embed.data_ptr()  # not copied on the CPU


def test_build_drafter_allocates_on_the_device_not_first_on_the_cpu():
    """A ~200M-parameter drafter (Qwen3-8B width, one layer) built on the 'meta' device: every parameter and
    buffer there, the tied embedding/head moved as one tensor, and the process's peak RSS barely moves
    (built on the CPU and then moved it would grow by its 0.8 GB of fp32 weights)."""
    code = """
import json, resource, torch
from transformers import Qwen3Config
from dflash_ray.model.drafter import DrafterConfig, build_drafter
torch.set_num_threads(1)
target = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=1024)
embed = torch.zeros(1024, 4096)
cfg = DrafterConfig(num_draft_layers=1, block_size=16, num_anchors=8, target_layer_ids=(1, 9, 17, 25, 33))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
d = build_drafter(cfg, target, embed, embed, seed=0, device="meta")
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
devices = {t.device.type for t in list(d.parameters()) + list(d.buffers())}
print(json.dumps(dict(grown_mb=grown, params=sum(p.numel() for p in d.parameters()), devices=sorted(devices),
                      tied=d.tied, own_head=hasattr(d, "lm_head_weight"))))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["params"] > 2e8 and out["devices"] == ["meta"] and out["tied"] and not out["own_head"]
    assert out["grown_mb"] < 200, f"peak RSS grew {out['grown_mb']} MB"


def test_bf16_autocast_step_runs_and_agrees(setup):
    """The GPU recipe's dtypes (bf16 target tensors and features, autocast, fp32 master weights), on the CPU."""
    s = setup
    d = s["drafter"]
    target = s["target"]
    embed = target.model.embed_tokens.weight.to(torch.bfloat16)
    head = embed if s["tied"] else target.lm_head.weight.to(torch.bfloat16)
    bf16 = DFlashDrafter(d.config, embed, head, num_anchors=d.num_anchors, attention_backend="sdpa")
    assert bf16.tied == s["tied"]
    bf16.load_state_dict(d.state_dict())
    args = (s["ids"], s["loss_mask"], s["context"].to(torch.bfloat16), s["lengths"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bf16.training_loss(*args, torch.Generator().manual_seed(3))
    (out.loss_sum / out.weight_sum).backward()
    assert all(p.grad is not None and p.dtype == torch.float32 for p in bf16.parameters())
    ref = d.training_loss(s["ids"], s["loss_mask"], s["context"], s["lengths"], torch.Generator().manual_seed(3))
    assert torch.equal(out.slot_count, ref.slot_count)
    assert math.isclose(out.loss.item(), ref.loss.item(), rel_tol=0.03)
    d.zero_grad()


def test_anchor_quota_by_hand():
    """Caps first; over the batch budget, shares in proportion to valid anchors (largest remainders)."""
    from dflash_ray.model.drafter import anchor_quota

    assert anchor_quota([3, 10, 600], 512, None) == [3, 10, 512]
    assert anchor_quota([3, 10, 600], 512, 1000) == [3, 10, 512]             # under the budget: caps only
    # 30 short rows of 100 valid anchors and a budget of 600: 20 each (the same density as a long row)
    assert anchor_quota([100] * 30, 512, 600) == [20] * 30
    # 100 / 300 / 600 valid, budget 100: exact shares 10 / 30 / 60
    assert anchor_quota([100, 300, 600], 512, 100) == [10, 30, 60]
    # 1 / 1 / 1 valid, budget 2: shares 2/3 each -> the leftover goes to the first rows (ties by index)
    assert anchor_quota([1, 1, 1], 512, 2) == [1, 1, 0]
    # 10 / 1000 / 1000 valid, cap 40, budget 60: shares 0.30 / 29.85 / 29.85 -> 0 / 30 / 30
    assert anchor_quota([10, 1000, 1000], 40, 60) == [0, 30, 30]
    # a row capped below its share hands the rest on: 10 / 1000 / 100 valid, cap 40, budget 70 -> shares
    # 0.63 / 63.1 / 6.31; row 1 stops at 40, the 24 left go round rows 0 and 2 until row 0 reaches its 10
    assert anchor_quota([10, 1000, 100], 40, 70) == [10, 40, 20]


def test_a_batch_anchor_budget_bounds_blocks_and_keeps_density(setup):
    """With anchors_per_batch the drafter trains at most that many blocks per batch, spread by valid anchors."""
    s, d = setup, copy.deepcopy(setup["drafter"])
    d.num_anchors, d.anchors_per_batch = 64, 12
    anchors, valid = d.sample_anchors(s["loss_mask"], s["lengths"], torch.Generator().manual_seed(0))
    per_row = valid.sum(1).tolist()
    assert sum(per_row) == 12
    # valid anchors: sample 0 has 14 + 9 = 23 (a in 10..23 and 30..38), sample 1 has 22 (a in 6..27)
    assert per_row == [6, 6]                           # 12 x 23/45 = 6.13, 12 x 22/45 = 5.87 -> 6, 6
