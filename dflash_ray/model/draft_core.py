"""The drafter's layers and its inference path, shared by the training drafter (drafter.DFlashDrafter) and the
exported one (modeling_dflash.DFlashDraftModel, loaded by transformers with trust_remote_code). Shipped with
every export: it imports only torch, transformers and its siblings layers.py and attention.py, which
transformers copies beside a remote modeling file because the file imports them relatively.

    context = hidden_norm(fc(concat of the target's tapped layers))   cached per layer as keys/values
    block   = embed([last token, MASK x (B-1)]) at the next B positions, seeing all cached context
    logits  = norm(layers(block)) @ the target's head^T
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from .layers import DrafterLayer


def dflash_fields(config) -> tuple[int, int, list[int]]:
    """(block_size, mask_token_id, target_layer_ids) of a drafter's config: the nested `dflash_config` first,
    then the top-level attributes (the reference's `_draft_value` reads them in this order)."""
    dflash = getattr(config, "dflash_config", None) or {}
    block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
    mask_token_id = int(dflash.get("mask_token_id", getattr(config, "mask_token_id", None)))
    layer_ids = list(dflash.get("target_layer_ids", getattr(config, "target_layer_ids", None)))
    return block_size, mask_token_id, layer_ids


@dataclass
class DraftContextCache:
    """Per-layer context keys/values for inference; context positions 0..length-1."""
    kv: list = field(default_factory=list)
    length: int = 0


class DraftCore:
    """A mixin for an nn.Module: `_build_core(config)` makes the layers, fc, the two norms and RoPE (in this
    order: the parameter names and the initialisation's random draws depend on it); the methods run them. The
    host provides `embed_weight` and `head_weight` (the target's, frozen)."""

    def _build_core(self, config) -> None:
        self.config = config
        self.block_size, self.mask_token_id, self.target_layer_ids = dflash_fields(config)
        self.num_target_layers = int(config.num_target_layers)
        h = config.hidden_size
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)

    def context_hidden(self, context: torch.Tensor) -> torch.Tensor:
        if context.dtype != self.fc.weight.dtype and not torch.is_autocast_enabled(context.device.type):
            context = context.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(context))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits through the frozen head (inference and tests; training uses the chunked loss)."""
        head = self.head_weight
        return (hidden.to(head.dtype) @ head.t()).float()

    def new_cache(self) -> DraftContextCache:
        return DraftContextCache()

    @torch.no_grad()
    def extend_context(self, cache: DraftContextCache, features: torch.Tensor) -> DraftContextCache:
        """Append target features [1, n, n_tap*H] for positions cache.length .. cache.length+n-1."""
        ctx_h = self.context_hidden(features)
        pos = torch.arange(cache.length, cache.length + features.shape[1], device=features.device)[None]
        cos, sin = self.rotary_emb(ctx_h, pos)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx_h, cos, sin)
            if len(cache.kv) <= i:
                cache.kv.append((k, v))
            else:
                pk, pv = cache.kv[i]
                cache.kv[i] = (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        cache.length += features.shape[1]
        return cache

    @torch.no_grad()
    def draft_hidden(self, cache: DraftContextCache, block_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, L, H] of a block [1, L] at positions cache.length.., seeing all cached context."""
        x = self.embed(block_ids)
        pos = torch.arange(cache.length, cache.length + block_ids.shape[1], device=block_ids.device)[None]
        cos, sin = self.rotary_emb(x, pos)
        for layer, kv in zip(self.layers, cache.kv):
            x = layer(x, None, None, None, cos, sin, None, ctx_kv=kv)
        return self.norm(x)
