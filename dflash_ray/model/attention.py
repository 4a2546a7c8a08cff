"""The training attention mask, and two kernels that apply it with the same numbers.

Layout of one sample in the training forward: keys/values are [context 0..S-1 ; N blocks of B tokens],
queries are the N*B block tokens. Block n (anchor a_n) may see

    context positions kv < a_n          (strictly: the target has not produced a_n's features yet)
    its own B tokens, in both directions

and nothing else. Seeing context position a_n would let slot 1 copy x[a_n + 1] out of the target's
features: training loss collapses, inference acceptance collapses. `block_visible` is the only place the
rule is written; both kernels call it, and the tests check it from the outside.

Kernels: FlexAttention with a block mask (sparse, what runs on the GPU, compiled there), and SDPA with a
dense boolean mask (small CPU shapes). Eager FlexAttention also runs on the CPU; a test checks the two agree.
"""
from __future__ import annotations

import functools

import torch
from torch.nn import functional as F


def block_visible(q_idx, kv_idx, anchors_b, ctx_len: int, block_size: int):
    """True where block query q_idx may attend to key kv_idx. anchors_b: the sample's anchors [N] (or
    anchors[b] gathered per query). Works elementwise on broadcast index tensors and inside flex's vmap."""
    block = q_idx // block_size
    anchor = anchors_b[block]
    in_context = (kv_idx < ctx_len) & (kv_idx < anchor)
    own_block = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == block)
    return in_context | own_block


def dense_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean [B, 1, N*block, S + N*block] mask for SDPA (True = attend)."""
    batch_size, n = anchors.shape
    q = torch.arange(n * block_size, device=anchors.device)
    kv = torch.arange(ctx_len + n * block_size, device=anchors.device)
    rows = [block_visible(q[:, None], kv[None, :], anchors[b], ctx_len, block_size) for b in range(batch_size)]
    return torch.stack(rows)[:, None]


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int):
    from torch.nn.attention.flex_attention import create_block_mask

    batch_size, n = anchors.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return block_visible(q_idx, kv_idx, anchors[b], ctx_len, block_size)

    q_len = n * block_size
    return create_block_mask(mask_mod, batch_size, None, q_len, ctx_len + q_len, device=anchors.device)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=None: token-budget batches change (context, anchors) shapes every step; after the first
    # recompile dynamo switches to dynamic shapes instead of one kernel per shape up to the recompile
    # limit (past which flex falls back to eager and materialises the scores). Not run on a GPU here.
    return torch.compile(flex_attention, dynamic=None)


def _common_dtype(q, k, v):
    # Under autocast the q/k norms (fp32 weights) promote q and k to fp32 while v stays bf16.
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    else:
        dtype = v.dtype
    return q.to(dtype), k.to(dtype), v.to(dtype)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"attention backend must be 'auto', 'flex' or 'sdpa', got {backend!r}")
    return backend


def training_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, backend: str = "auto"):
    """The mask for one training forward, built once and shared by all layers: a BlockMask (flex) or a
    boolean tensor (sdpa). anchors [B, N]; padding anchors are 0 (they see no context; zero loss weight)."""
    if resolve_backend(backend, anchors.device) == "sdpa":
        return dense_mask(anchors, ctx_len, block_size)
    return flex_block_mask(anchors, ctx_len, block_size)


def attend(q, k, v, mask=None):
    """q [B, heads, Q, D], k/v [B, kv_heads, K, D] -> [B, heads, Q, D].

    mask None: every key visible (inference: the block sees all cached context and itself, as the
    reference's unmasked path); a boolean tensor: SDPA; a BlockMask: FlexAttention (compiled on CUDA
    unless already inside a compiled region)."""
    q, k, v = _common_dtype(q, k, v)
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    from torch.nn.attention.flex_attention import flex_attention

    kernel = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        kernel = _compiled_flex()
    return kernel(q, k, v, block_mask=mask, enable_gqa=True)
