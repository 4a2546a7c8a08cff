"""Acceptance-length evaluation: same acceptance lengths and outputs as the reference `dflash_generate`,
outputs equal plain greedy decoding, and a drafter trained here on target-generated data is accepted."""
import time

import pytest
import torch

import dflash.model as reference
from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.model.evaluate import evaluate_acceptance, greedy_generate, summarize
from dflash_ray.model.export import export_drafter
from dflash_ray.model.target import (
    TargetFeatureExtractor,
    build_synthetic_target,
    load_embed_and_head,
    load_target,
)
from helpers_model import TINY_QWEN3

TINY = {**TINY_QWEN3, "num_hidden_layers": 4, "tie_word_embeddings": True}
VOCAB, MASK, BLOCK = 300, 299, 8
# The reference passes `past_key_values`, which transformers 5 deprecates in favour of `cache`.
pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"), pytest.mark.rounding]


@pytest.fixture(autouse=True)
def cpu_timer(monkeypatch):
    # The reference times with torch.cuda.synchronize when return_stats=True; on the CPU use plain time.
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)


def _reference_run(drafter_dir, target, prompts, max_new_tokens, stop_token_ids=None):
    model = reference.DFlashDraftModel.from_pretrained(drafter_dir).eval()
    runs = [reference.dflash_generate(model, target, torch.tensor([p]), max_new_tokens, stop_token_ids,
                                      return_stats=True) for p in prompts]
    return [r.acceptance_lengths for r in runs], [r.output_ids for r in runs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target, a random drafter, and a drafter trained briefly on the target's greedy outputs."""
    root = tmp_path_factory.mktemp("eval")
    tdir = build_synthetic_target(TINY, VOCAB, str(root / "target"), seed=0)
    target = load_target(tdir)
    embed, head = load_embed_and_head(tdir)
    cfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=16, mask_token_id=MASK)
    random_drafter = build_drafter(cfg, target.config, embed, head, seed=0)
    random_dir = export_drafter(random_drafter, str(root / "random"))

    # Target-regenerated data: greedy continuations of random prompts (random targets fall into loops,
    # which a drafter can learn in a few dozen steps).
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, MASK, (6,), generator=g) for _ in range(12)]
    ids = torch.stack([greedy_generate(target, p[None], 34)[0] for p in prompts])
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :6] = 0
    lengths = torch.full((len(ids),), ids.shape[1])
    drafter = build_drafter(cfg, target.config, embed, head, seed=0)
    context = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(60):
        batch = torch.randint(0, len(ids), (6,), generator=gen)
        out = drafter.training_loss(ids[batch], loss_mask[batch], context[batch], lengths[batch], gen)
        loss = out.loss_sum / out.weight_sum
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((loss.item(), out.measured_acceptance_length()))
    trained_dir = export_drafter(drafter, str(root / "trained"))
    eval_prompts = [p.tolist() for p in prompts[:3]] + [torch.randint(0, MASK, (9,), generator=g).tolist()]
    return dict(target=target, tdir=tdir, random_dir=random_dir, trained_dir=trained_dir,
                prompts=eval_prompts, history=history)


def test_random_drafter_matches_reference_and_greedy(pair):
    stats = evaluate_acceptance(pair["random_dir"], pair["tdir"], pair["prompts"], max_new_tokens=20)
    lengths, _ = _reference_run(pair["random_dir"], pair["target"], pair["prompts"], 20)
    assert stats["per_prompt_acceptance_lengths"] == lengths
    assert stats["outputs_match_greedy"] is True
    assert stats["new_tokens"] == 4 * 20
    assert sum(stats["acceptance_histogram"]) == stats["num_cycles"] == stats["target_forwards_speculative"] - 4


def test_training_raises_acceptance_and_matches_reference(pair):
    first_loss, _ = pair["history"][0]
    last_loss, last_tau = pair["history"][-1]
    assert last_loss < first_loss and last_tau > 2.0
    stats = evaluate_acceptance(pair["trained_dir"], pair["tdir"], pair["prompts"], max_new_tokens=30)
    lengths, outputs = _reference_run(pair["trained_dir"], pair["target"], pair["prompts"], 30)
    assert stats["per_prompt_acceptance_lengths"] == lengths
    assert stats["outputs_match_greedy"] is True
    assert stats["tau"] > 2.0, stats["per_prompt_acceptance_lengths"]
    assert stats["target_forwards_speculative"] < stats["target_forwards_greedy"]
    assert stats["tau"] == pytest.approx(sum(sum(x) / len(x) for x in lengths) / len(lengths))


def test_stop_tokens_match_reference(pair):
    prompt = pair["prompts"][0]
    greedy = greedy_generate(pair["target"], torch.tensor([prompt]), 30)[0].tolist()
    stop = greedy[len(prompt) + 11]
    for drafter_dir in (pair["random_dir"], pair["trained_dir"]):
        stats = evaluate_acceptance(drafter_dir, pair["tdir"], [prompt], 30, stop_token_ids=[stop])
        lengths, outputs = _reference_run(drafter_dir, pair["target"], [prompt], 30, [stop])
        assert stats["per_prompt_acceptance_lengths"] == lengths
        assert stats["outputs_match_greedy"] is True
        assert stats["new_tokens"] == outputs[0].shape[1] - len(prompt)
        assert outputs[0][0, -1].item() == stop


def test_summarize_counts_like_the_reference_benchmark():
    s = summarize([[1, 3, 8], [2]], block_size=8)
    assert s["tau"] == pytest.approx(((1 + 3 + 8) / 3 + 2) / 2)
    assert s["tau_per_cycle"] == pytest.approx(14 / 4)
    assert s["acceptance_histogram"] == [0, 1, 1, 1, 0, 0, 0, 0, 1]
