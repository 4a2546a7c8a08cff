"""Qwen3-style drafter decoder layer: GQA attention with q/k norms and RoPE, then a SwiGLU MLP. The norms, the MLP
and rotate_half are transformers' Qwen3 modules, as in the reference DFlash model.

The one DFlash twist is in the attention: keys/values are [k/v_proj(context); k/v_proj(block)] with the
layer's own projections, and queries come from the block only. The context (the target's features after
`fc` + `hidden_norm`) is the same tensor for every layer; it is never transformed by the layers.
Parameter names match the reference `dflash.model.DFlashDraftModel`, so state dicts are interchangeable.
"""
from __future__ import annotations

import torch
from torch import nn

from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

from .attention import attend


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D]; cos/sin [B, L, D] for the same positions. One tensor at a time (transformers'
    apply_rotary_pos_emb takes q and k together): context keys are rotated alone, once, for the cache."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DrafterAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V, [B, kv_heads, L, D], for tokens x [B, L, H] at the positions of cos/sin.

        Every op is per token, so context K/V can be computed once and cached at inference."""
        batch_size, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch_size, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch_size, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask) -> torch.Tensor:
        """x: block tokens [B, Q, H] (already input-normed); ctx_k/ctx_v: context K/V [B, kv, S, D];
        cos/sin for the block positions; mask: the visibility rule (attention.training_mask) or None."""
        batch_size, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch_size, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.keys_values(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)  # context first, as the reference (and its KV cache) orders them
        v = torch.cat([ctx_v, v_blk], dim=2)
        out = attend(q, k, v, mask)  # [B, heads, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch_size, q_len, -1))


class DrafterLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx_h, ctx_cos, ctx_sin, cos, sin, mask, ctx_kv=None) -> torch.Tensor:
        """ctx_h: the shared context [B, S, H] at ctx_cos/ctx_sin positions, or ctx_kv: its cached K/V."""
        if ctx_kv is None:
            ctx_kv = self.self_attn.keys_values(ctx_h, ctx_cos, ctx_sin)
        x = x + self.self_attn(self.input_layernorm(x), *ctx_kv, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
