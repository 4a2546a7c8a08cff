"""Export a drafter as a Hugging Face directory that the reference `dflash.DFlashDraftModel.from_pretrained`
loads, and load it back here.

config.json: the drafter's Qwen3 fields, `architectures: ["DFlashDraftModel"]`, `num_target_layers`, and
`block_size` / `mask_token_id` / `target_layer_ids` both at top level and under `dflash_config` (the
reference's `_draft_value` reads the nested dict first, then the attribute). model.safetensors: the
trainable weights under the reference's names (layers.N.self_attn.q_proj.weight, fc.weight,
hidden_norm.weight, norm.weight, ...). The target's embedding and head are not exported: they are the target's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from transformers import Qwen3Config

from ..atomic import atomic_dir
from .drafter import DFlashDrafter

WEIGHTS_NAME = "model.safetensors"


def export_drafter(drafter: DFlashDrafter, out_dir: str, dtype: torch.dtype | None = None) -> str:
    """Write config.json + model.safetensors to out_dir (replacing it whole); dtype None keeps the
    parameters' dtype."""
    drafter = getattr(drafter, "module", drafter)  # unwrap DDP
    with atomic_dir(out_dir) as tmp:  # complete or absent; no stale files from an earlier export
        _write_export(drafter, tmp, dtype)
    return out_dir


def _write_export(drafter: DFlashDrafter, out_dir, dtype) -> None:
    from safetensors.torch import save_file

    state = {
        name: (t.detach().to(dtype) if dtype is not None else t.detach()).cpu().contiguous()
        for name, t in drafter.state_dict().items()
    }
    save_file(state, str(Path(out_dir) / WEIGHTS_NAME), metadata={"format": "pt"})

    config = drafter.config.to_dict()
    config.update(
        architectures=["DFlashDraftModel"],
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        target_layer_ids=list(drafter.target_layer_ids),
        num_target_layers=drafter.num_target_layers,
        dflash_config={"block_size": drafter.block_size, "mask_token_id": drafter.mask_token_id,
                       "target_layer_ids": list(drafter.target_layer_ids)},
        dtype=str(next(iter(state.values())).dtype).replace("torch.", ""),
    )
    with open(Path(out_dir) / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    # readable by the serving engine's user too (safetensors writes 0600)
    os.chmod(out_dir, 0o755)
    for name in (WEIGHTS_NAME, "config.json"):
        os.chmod(Path(out_dir) / name, 0o644)


def load_drafter(out_dir: str, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 **drafter_kwargs) -> DFlashDrafter:
    """Rebuild a DFlashDrafter from an exported directory (weights restored exactly, in their saved dtype)."""
    from safetensors.torch import load_file

    config = Qwen3Config.from_pretrained(out_dir)
    state = load_file(str(Path(out_dir) / WEIGHTS_NAME))
    drafter = DFlashDrafter(config, embed_weight, head_weight, **drafter_kwargs)
    # assign=True adopts the saved tensors as they are (dtype included); the frozen buffers are untouched.
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter.eval()
