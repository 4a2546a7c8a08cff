"""The optimizer step without Ray (runtime/training/step.py), its LR schedule (runtime/training/model.py) and the row
schema (runtime/stream/rows.py), in one process.

The step's loss is sum(loss_sum) / sum(weight_sum) over every batch of the step: the expected update is
computed here from the drafter's own training loss with plain autograd, independently of train_step's
accumulation, division and stats vector."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dflash_ray.model.drafter import DrafterConfig
from dflash_ray.model.target import build_synthetic_target, load_target
from dflash_ray.runtime.stream.rows import FILLER, TrainRow, decode_features, encode_features, token_row
from dflash_ray.runtime.training.model import LossModule, lr_lambda
from dflash_ray.runtime.training.step import StepStats, batch_seed, train_step
from helpers_model import TINY_QWEN3, tiny_step_drafter

VOCAB, MASK, BLOCK = 300, 299, 4


@pytest.fixture(scope="module")
def drafter_and_width(tmp_path_factory):
    return tiny_step_drafter(tmp_path_factory.mktemp("step"), VOCAB, MASK, BLOCK)


def make_row(index, position, rows, width, features, seed, epoch=0, bucket=0, filler=False) -> TrainRow:
    """A trainer row as the stream delivers it (the same encode path as the target actor)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (rows, width), generator=g).numpy().astype(np.int32)
    mask = np.ones((rows, width), np.int8)
    mask[:, : width // 4] = 0                             # a prompt, then the supervised answer
    lengths = np.full(rows, width)
    context, dtype = encode_features(torch.randn(rows, width, features, generator=g))
    scalars = dict(index=index, epoch=epoch, position=FILLER if filler else position, epoch_batches=10,
                   bucket=FILLER if filler else bucket, num_tokens=0 if filler else int(lengths.sum()))
    cols = token_row(scalars, 1, ids, mask, lengths)
    return TrainRow.from_batch({**cols, "context": context[None], "context_dtype": np.array([dtype])})


def sgd(drafter):
    opt = torch.optim.SGD(drafter.trainable_parameters(), lr=0.5)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def test_step_update_is_global_loss_sum_over_global_weight_sum(drafter_and_width):
    """Two batches of very different sizes in one step (grad_accum 2): the update follows
    (loss_sum_1 + loss_sum_2) / (weight_sum_1 + weight_sum_2), not the mean of per-batch means."""
    base, features = drafter_and_width
    small = make_row(0, 3, rows=1, width=12, features=features, seed=1, bucket=0)
    large = make_row(1, 4, rows=6, width=48, features=features, seed=2, bucket=3)

    # expected: plain autograd on the same losses, same anchors (same per-batch generators)
    ref = copy.deepcopy(base)
    parts = []
    for row in (small, large):
        ids, mask, ctx, lengths = row.tensors("cpu")
        g = torch.Generator().manual_seed(batch_seed(0, row.epoch, row.position))
        parts.append(ref.training_loss(ids, mask, ctx, lengths, g))
    w = [float(p.weight_sum) for p in parts]
    assert max(w) > 4 * min(w)                             # the sizes really differ
    global_loss = (parts[0].loss_sum + parts[1].loss_sum) / (parts[0].weight_sum + parts[1].weight_sum)
    params = ref.trainable_parameters()
    grads = torch.autograd.grad(global_loss, params, retain_graph=True)
    expected = [p.detach() - 0.5 * g for p, g in zip(params, grads)]
    # what a per-batch normalisation would do instead: it must be told apart from the expected update
    mean_of_means = (parts[0].loss_sum / parts[0].weight_sum + parts[1].loss_sum / parts[1].weight_sum) / 2
    wrong = torch.autograd.grad(mean_of_means, params)
    gap = max(float((g - h).abs().max()) for g, h in zip(grads, wrong))
    assert 0.5 * gap > 1e-4

    drafter = copy.deepcopy(base)
    opt, sched = sgd(drafter)
    result = train_step(LossModule(drafter), drafter, opt, sched, [small, large], rank=0, workers=1,
                        batches_per_step=2, seed=0, grad_clip=0.0, device="cpu")
    assert result.loss == pytest.approx(float(global_loss.detach()), rel=1e-6)
    assert result.weight_sum == pytest.approx(sum(w))
    for p, e in zip(drafter.trainable_parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)
    assert result.positions == [3, 4] and result.buckets == [0, 3] and result.epoch == 0
    # tau on the step's blocks: 1 + leading correct slots per block, over both batches
    blocks = sum(int(p.num_blocks) for p in parts)
    assert result.train_tau == pytest.approx(1 + sum(float(p.prefix_correct.sum()) for p in parts) / blocks)
    assert result.batch_tokens == [12, 6 * 48] and result.tokens == 12 + 6 * 48
    # the drafter's unit: the anchors the sampler draws for each batch (same generators) x block size
    anchors = 0
    for row in (small, large):
        ids, mask, ctx, lengths = row.tensors("cpu")
        _, valid = ref.sample_anchors(mask, lengths, torch.Generator().manual_seed(batch_seed(0, row.epoch, row.position)))
        anchors += int(valid.sum())
    assert anchors > 0 and result.block_tokens == anchors * base.block_size


def test_filler_last_micro_step_trains_nothing(drafter_and_width):
    """An epoch's last step padded with a filler: the update equals the step of the real batch alone,
    and the filler shows as FILLER in the step's record."""
    base, features = drafter_and_width
    real = make_row(0, 9, rows=2, width=16, features=features, seed=5)
    filler = make_row(1, 0, rows=1, width=18, features=features, seed=6, filler=True)
    alone, padded = copy.deepcopy(base), copy.deepcopy(base)
    o1, s1 = sgd(alone)
    o2, s2 = sgd(padded)
    r1 = train_step(LossModule(alone), alone, o1, s1, [real], rank=0, workers=1, batches_per_step=1, seed=0,
                    grad_clip=0.0, device="cpu")
    r2 = train_step(LossModule(padded), padded, o2, s2, [real, filler], rank=0, workers=1, batches_per_step=2,
                    seed=0, grad_clip=0.0, device="cpu")
    assert r2.loss == pytest.approx(r1.loss) and r2.positions == [9, FILLER] and r2.tokens == r1.tokens
    for a, b in zip(alone.trainable_parameters(), padded.trainable_parameters()):
        torch.testing.assert_close(a, b)


def test_step_stats_sum_over_ranks_assembles_the_step():
    """Each rank packs only its own batches; the element-wise sum (what all_reduce does) is the step."""
    block, per_step = 4, 4       # 2 workers x grad_accum 2: batch j = micro_step * 2 + rank
    ranks = []
    for rank in range(2):
        s = StepStats.zeros(block, per_step)
        for a in range(2):
            j = a * 2 + rank
            s.batch_epoch[j] = 1
            if j == 3:
                continue                                   # batch 3 is a filler
            s.batch_position[j], s.batch_bucket[j], s.batch_tokens[j] = 20 + j, j % 3, 100 * (j + 1)
            s.loss_sum += 1.0 + j
            s.weight_sum += 2.0
            s.tokens += 100 * (j + 1)
            s.slot_correct += np.array([1, 0, 1])
            s.slot_count += np.array([1, 1, 1])
            s.prefix_correct += np.array([1, 0, 0])
            s.num_blocks += 1
        ranks.append(s.pack())
    total = StepStats.unpack(ranks[0] + ranks[1], block, per_step)
    assert total.batch_position.tolist() == [20, 21, 22, FILLER]
    assert total.batch_bucket.tolist() == [0, 1, 2, FILLER]
    assert total.batch_tokens.tolist() == [100, 200, 300, 0]
    assert total.batch_epoch.tolist() == [1, 1, 1, 1]
    assert (total.loss_sum, total.weight_sum, total.tokens) == (1.0 + 2.0 + 3.0, 6.0, 600.0)  # batches 0..2
    assert total.slot_correct.tolist() == [3, 0, 3] and total.slot_count.tolist() == [3, 3, 3]
    assert total.prefix_correct.tolist() == [3, 0, 0] and total.num_blocks == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_round_trip_through_the_row_encoding(dtype):
    x = torch.randn(2, 5, 6).to(dtype)
    array, name = encode_features(x)
    assert array.dtype == (np.int16 if dtype == torch.bfloat16 else np.float32)   # numpy has no bf16
    y = decode_features(array, name)
    assert y.dtype == dtype and torch.equal(y, x)
    with pytest.raises(ValueError, match="float16"):
        decode_features(array, "float16")


def test_batch_seed_is_a_pure_function_of_the_batch():
    """The same in another process and whatever the global RNGs hold; distinct across batches."""
    np.random.seed(123)
    torch.manual_seed(5)
    here = [batch_seed(0, 1, 7), batch_seed(3, 0, 0)]
    out = subprocess.run([sys.executable, "-c", "from dflash_ray.runtime.training.step import batch_seed;"
                          "print(batch_seed(0, 1, 7), batch_seed(3, 0, 0))"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "99"})
    assert [int(x) for x in out.stdout.split()] == here
    assert len({batch_seed(0, e, p) for e in range(3) for p in range(50)}) == 150
    assert batch_seed(0, 1, 7) != batch_seed(1, 1, 7)


@pytest.mark.parametrize("tied", [True, False])
def test_run_drafter_is_the_seeded_drafter_on_its_device(tmp_path, tied):
    """build_run_drafter: the target's embedding/head read from its files (tying kept), the run's drafter
    config, the run's seed; equal to a drafter built by hand the former way (on the CPU, seeded)."""
    from types import SimpleNamespace

    from dflash_ray.model.drafter import DFlashDrafter, drafter_config
    from dflash_ray.runtime.training.model import build_run_drafter

    target_dir = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 4, "tie_word_embeddings": tied},
                                        VOCAB, str(tmp_path / "target"), seed=4)
    target = load_target(target_dir)
    cfg = DrafterConfig(num_draft_layers=1, block_size=BLOCK, num_anchors=8, mask_token_id=MASK)
    spec = SimpleNamespace(target_path=target_dir, drafter=cfg, seed=17, init_from=None,
                           train=SimpleNamespace(recompute_layers=tied))  # the run's activation checkpointing
    state = torch.get_rng_state()
    drafter = build_run_drafter(spec, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(17)
        by_hand = DFlashDrafter(drafter_config(target.config, 1, BLOCK, MASK), target.model.embed_tokens.weight,
                                target.lm_head.weight, num_anchors=8)
    assert drafter.tied == by_hand.tied == tied
    for name, value in by_hand.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], value), name
    assert torch.equal(drafter.head_weight, target.lm_head.weight)
    assert all(p.device.type == "cpu" for p in drafter.parameters())
    assert drafter.recompute_layers == tied


def test_the_optimizer_is_the_fused_adamw_on_cuda_only(drafter_and_width):
    """The H200 figures were measured with the fused AdamW kernel: the runtime takes the same path on CUDA
    (not runnable here: no GPU) and torch's default on the CPU, whose runs stay bit-identical to before."""
    from types import SimpleNamespace

    from dflash_ray.runtime.training.model import adamw_fused, make_optimizer

    assert adamw_fused("cuda") is True and adamw_fused("cpu") is None
    drafter = copy.deepcopy(drafter_and_width[0])
    opt, _ = make_optimizer(SimpleNamespace(lr=1e-3, weight_decay=0.0, warmup_ratio=0.0), drafter, 10)
    assert isinstance(opt, torch.optim.AdamW) and not opt.defaults["fused"]


def test_lr_schedule_warmup_then_cosine_to_zero():
    f = lr_lambda(100, 0.04)
    assert [round(f(s), 3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert f(52) == pytest.approx(0.5, abs=0.02) and f(100) == pytest.approx(0.0, abs=1e-9)
    assert all(f(s) >= f(s + 1) for s in range(4, 100))
