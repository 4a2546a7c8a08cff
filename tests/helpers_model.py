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
