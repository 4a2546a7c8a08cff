"""The model layer: the frozen target and its feature capture, the DFlash drafter, its loss, export and
acceptance-length evaluation. Plain PyTorch + transformers; no Ray here (the runtime wraps these)."""
from .drafter import DFlashDrafter, DrafterConfig, build_drafter, drafter_config
from .evaluate import evaluate_acceptance, greedy_generate, speculative_generate
from .export import export_drafter, load_drafter
from .loss import LossOutput, default_gamma, expected_acceptance_length
from .target import (
    TargetFeatureExtractor,
    build_synthetic_target,
    default_mask_token_id,
    default_target_layer_ids,
    load_embed_and_head,
    load_target,
)

__all__ = [
    "DFlashDrafter", "DrafterConfig", "LossOutput", "TargetFeatureExtractor", "build_drafter", "build_synthetic_target",
    "default_gamma", "default_mask_token_id", "default_target_layer_ids", "drafter_config",
    "evaluate_acceptance", "expected_acceptance_length", "export_drafter", "greedy_generate",
    "load_drafter", "load_embed_and_head", "load_target", "speculative_generate",
]
