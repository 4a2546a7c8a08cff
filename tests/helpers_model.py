"""Shared by the model tests."""

# The tiny Qwen3 shape every model test builds on; each file sets its depth and tying.
TINY_QWEN3 = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256)


def reference_acceptance_lengths(drafter_dir, target_dir, prompts, max_new_tokens, stop_token_ids, monkeypatch):
    """Per-prompt acceptance lengths from the reference `dflash_generate` (the oracle for tau)."""
    import time

    import dflash.model as reference
    import torch

    from dflash_ray.model.target import load_target

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # it times with CUDA syncs otherwise
    model = reference.DFlashDraftModel.from_pretrained(drafter_dir).eval()
    target = load_target(target_dir)
    return [reference.dflash_generate(model, target, torch.tensor([p]), max_new_tokens, stop_token_ids,
                                      return_stats=True).acceptance_lengths for p in prompts]


def tiny_step_drafter(root, vocab: int = 300, mask: int = 299, block: int = 4):
    """A one-layer drafter (SDPA) on a synthesised 4-layer tiny target, and its context width: what the
    step tests train."""
    from dflash_ray.model.drafter import DrafterConfig, build_drafter
    from dflash_ray.model.target import build_synthetic_target, load_target

    target = load_target(build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 4}, vocab,
                                                str(root / "target"), seed=3))
    cfg = DrafterConfig(num_draft_layers=1, block_size=block, num_anchors=8, mask_token_id=mask)
    drafter = build_drafter(cfg, target.config, target.model.embed_tokens.weight, target.lm_head.weight, seed=0,
                            attention_backend="sdpa")
    return drafter, drafter.config.hidden_size * len(drafter.config.dflash_config["target_layer_ids"])



def train_row(position: int, ids, mask, lengths, ctx, *, bucket: int = 0, epoch_batches: int = 10):
    """A plan batch as a trainer receives it (stream rows.TrainRow): tokens, loss mask, lengths and its
    context features (a tensor [rows, width, features]), encoded as the stream encodes them."""
    import numpy as np

    from dflash_ray.runtime.stream.rows import TrainRow, encode_features, token_row

    context, dtype = encode_features(ctx)
    scalars = dict(index=position, epoch=0, position=position, epoch_batches=epoch_batches, bucket=bucket,
                   num_tokens=int(np.sum(lengths)))
    cols = token_row(scalars, 1, ids, mask, lengths)
    return TrainRow.from_batch({**cols, "context": context[None], "context_dtype": np.array([dtype])})


def step_optimizer(drafter):
    """The run's own optimizer and schedule (warmup: the learning rate changes every step)."""
    from dflash_ray.config import TrainConfig
    from dflash_ray.runtime.training.model import make_optimizer

    return make_optimizer(TrainConfig(lr=1e-3, warmup_ratio=0.5), drafter, schedule_steps=8)


def trainable_weights(drafter):
    return [p.detach().clone() for p in drafter.trainable_parameters()]
