"""Export a drafter as a Hugging Face directory that the reference `dflash.DFlashDraftModel.from_pretrained`
loads, and load it back here.

config.json: the drafter's Qwen3 fields, `architectures: ["DFlashDraftModel"]`, `num_target_layers`, and
`block_size` / `mask_token_id` / `target_layer_ids` both at top level and under `dflash_config` (the
reference's `_draft_value` reads the nested dict first, then the attribute); RoPE both as
`rope_parameters` (transformers 5) and `rope_theta` / `rope_scaling` (transformers 4). model.safetensors: the
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
    # transformers 5 writes RoPE only as `rope_parameters`; a loader on transformers 4 (a serving image)
    # reads `rope_theta` / `rope_scaling` and would silently fall back to theta 10000. Write both; 5 reads
    # rope_parameters first.
    rope = dict(config.get("rope_parameters") or {})
    if rope:
        config["rope_theta"] = rope.pop("rope_theta", None)
        config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    with open(Path(out_dir) / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    # readable by the serving engine's user too (safetensors writes 0600)
    os.chmod(out_dir, 0o755)
    for name in (WEIGHTS_NAME, "config.json"):
        os.chmod(Path(out_dir) / name, 0o644)


# What must agree for an export's weights to mean the same in another drafter: the target's width and
# vocabulary, the tapped layers, the block and its MASK id (what the weights were trained on), and every
# field that sets a weight's shape.
INIT_FIELDS = ("hidden_size", "vocab_size", "target_layer_ids", "block_size", "mask_token_id", "num_hidden_layers",
               "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias")
_DFLASH_FIELDS = ("target_layer_ids", "block_size", "mask_token_id")


def _field(config, name):
    """A config field as the reference reads it (`_draft_value`: dflash_config first, then top level)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    nested = get("dflash_config") or {}
    value = nested.get(name, get(name)) if name in _DFLASH_FIELDS else get(name)
    return list(value) if isinstance(value, (list, tuple)) else value


def export_mismatch(export_dir: str, config) -> str | None:
    """Why the export in `export_dir` cannot initialise a drafter of `config` (a drafter's Qwen3Config or
    its dict), in one line; None when it can."""
    path = Path(export_dir) / "config.json"
    if not path.is_file() or not (Path(export_dir) / WEIGHTS_NAME).is_file():
        return f"{export_dir} is not an exported drafter (no config.json and {WEIGHTS_NAME})"
    exported = json.loads(path.read_text())
    diffs = [f"{k} {_field(exported, k)} != {_field(config, k)}" for k in INIT_FIELDS
             if _field(exported, k) != _field(config, k)]
    if diffs:
        return f"the export at {export_dir} does not match this run's drafter (export vs run): " + ", ".join(diffs)
    return None


def init_from_export(drafter: DFlashDrafter, export_dir: str) -> DFlashDrafter:
    """Copy an export's weights into `drafter` in place (a warm start), in the drafter's own dtype and
    device; ValueError (one line) when the export does not match the drafter (`export_mismatch`)."""
    from safetensors.torch import load_file

    reason = export_mismatch(export_dir, drafter.config)
    if reason:
        raise ValueError(reason)
    state = load_file(str(Path(export_dir) / WEIGHTS_NAME))
    missing, unexpected = set(drafter.state_dict()) - set(state), set(state) - set(drafter.state_dict())
    if missing or unexpected:
        raise ValueError(f"the export at {export_dir} has other weights than this run's drafter: missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    drafter.load_state_dict(state, strict=True)  # copies into the existing parameters: dtype/device kept
    return drafter


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
