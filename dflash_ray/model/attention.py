"""The training attention mask, and two kernels that apply it with the same numbers.

Layout of one sample in the training forward: keys/values are [context 0..S-1 ; N blocks of B tokens],
queries are the N*B block tokens. Block n (anchor a_n) may see

    context positions kv < a_n          (strictly: the target has not produced a_n's features yet)
    its own B tokens, in both directions

and nothing else. Seeing context position a_n would let slot 1 copy x[a_n + 1] out of the target's
features: training loss collapses, inference acceptance collapses. `block_visible` is the only place the
rule is written; both kernels call it, and the tests check it from the outside.

Kernels: FlexAttention with a block mask (sparse, what runs on the GPU, compiled there); on the CPU the
split kernel (`split_attend`: the context part under its anchor mask and each block's own B x B part, one
softmax over both: no work on the N*B block keys a query never sees, 6x fewer scores than the dense mask at
SmolLM2's shapes and a 2-3x faster layer); and SDPA with a dense boolean mask (the plain reference).
Eager FlexAttention also runs on the CPU; tests check all of them agree.
The BlockMask's tiles are derived from the anchors (`block_tiles`), not by evaluating the rule densely;
tests/test_model_attention.py checks them against `dense_mask` tile by tile.
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


FLEX_TILE = 128  # flex's default sparse block: a BlockMask describes [128 queries x 128 keys] tiles


def _tile_bounds(count: int, length: int, tile: int, device):
    """Start and end (exclusive, clipped to `length`) of each of `count` tiles, int64 [count]."""
    start = torch.arange(count, device=device) * tile
    return start, (start + tile).clamp(max=length)


def block_tiles(anchors: torch.Tensor, ctx_len: int, block_size: int, tile: int = FLEX_TILE):
    """Which [tile x tile] tiles of the training mask hold a visible pair (`partial`: flex applies
    `block_visible` inside them) and which hold only visible pairs (`full`: flex skips the mask_mod),
    as boolean [B, q_tiles, kv_tiles], derived from the anchors alone: never a [queries x keys] tensor.

    `block_visible` in tile terms, for query tile i (its rows belong to drafter blocks n_lo..n_hi):
      context  kv < min(ctx_len, a_n): some row sees key tile j when its start is below the largest
               anchor, every row sees all of it when its end is at most the smallest anchor
      own      kv in [S + n*B, S + (n+1)*B): the query tile's own blocks span [S + n_lo*B, S + (n_hi+1)*B);
               all rows see all of a key tile only when one drafter block holds the whole query tile
    A tile that runs past the sequence end is never full (as create_block_mask pads it with False)."""
    batch_size, n = anchors.shape
    device = anchors.device
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    q0, q1 = _tile_bounds(q_tiles, q_len, tile, device)
    k0, k1 = _tile_bounds(kv_tiles, kv_len, tile, device)
    k0, k1 = k0[None, None, :], k1[None, None, :]                      # [1, 1, kv_tiles]

    # Anchor of every query row, rows past q_len clamped onto the last row (same tile, same block):
    # O(B x queries), as the block tokens' own activations.
    rows = torch.arange(q_tiles * tile, device=device).clamp(max=q_len - 1)
    per_row = anchors.gather(1, (rows // block_size).expand(batch_size, -1)).view(batch_size, q_tiles, tile)
    a_min = per_row.amin(-1)[:, :, None]                                # [B, q_tiles, 1]
    a_max = per_row.amax(-1)[:, :, None]
    n_lo, n_hi = q0 // block_size, (q1 - 1) // block_size
    own_lo = (ctx_len + n_lo * block_size)[None, :, None]              # [1, q_tiles, 1]
    own_hi = (ctx_len + (n_hi + 1) * block_size)[None, :, None]
    one_block = (n_lo == n_hi)[None, :, None]

    context_any = (k0 < ctx_len) & (k0 < a_max)
    own_any = (k1 > own_lo) & (k0 < own_hi)
    context_all = (k0 >= ctx_len) | (k1.clamp(max=ctx_len) <= a_min)
    own_all = (k1 <= ctx_len) | (one_block & (k0.clamp(min=ctx_len) >= own_lo) & (k1 <= own_hi))
    whole_tile = ((q1 - q0) == tile)[None, :, None] & ((k1 - k0) == tile)
    full = whole_tile & context_all & own_all
    partial = (context_any | own_any) & ~full
    return partial, full


def _ordered(tiles: torch.Tensor):
    """[B, q_tiles, kv_tiles] booleans -> BlockMask's (num_blocks [B, 1, q_tiles], indices [B, 1, q_tiles,
    kv_tiles]) int32: each row's listed key tiles first, ascending."""
    num = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None].contiguous(), order[:, None].contiguous()


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, tile: int = FLEX_TILE):
    """The BlockMask of `block_visible`, built from tile indices (`block_tiles`): memory
    O(B x q_tiles x kv_tiles), where torch's create_block_mask evaluates the mask_mod densely
    (B x queries x keys booleans, ~2 GB a step for short-row batches at Qwen3-8B's shape)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch_size, n = anchors.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return block_visible(q_idx, kv_idx, anchors[b], ctx_len, block_size)

    partial, full = block_tiles(anchors, ctx_len, block_size, tile)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    q_len = n * block_size
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(q_len, ctx_len + q_len))


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
        return "flex" if device.type == "cuda" else "split"
    if backend not in ("flex", "sdpa", "split"):
        raise ValueError(f"attention backend must be 'auto', 'flex', 'split' or 'sdpa', got {backend!r}")
    return backend


class SplitMask:
    """The split kernel's form of the rule: which context keys each block query sees ([B, Q, S] booleans,
    `block_visible`'s context part); a block's own B keys are all visible by construction."""

    def __init__(self, anchors: torch.Tensor, ctx_len: int, block_size: int):
        n = anchors.shape[1]
        q = torch.arange(n * block_size, device=anchors.device)
        kv = torch.arange(ctx_len, device=anchors.device)
        self.context = torch.stack([block_visible(q[:, None], kv[None, :], anchors[b], ctx_len, block_size)
                                    for b in range(anchors.shape[0])])
        self.ctx_len, self.block_size = ctx_len, block_size


def split_attend(q, k, v, mask: SplitMask):
    """`block_visible` in two parts, one softmax: each query's scores over the context (masked to keys
    before its anchor) and over its own block's B keys, concatenated per block. q [B, heads, N*bs, D],
    k/v [B, kv_heads, S + N*bs, D] (context first) -> [B, heads, N*bs, D]. Softmax in fp32, as SDPA."""
    batch, heads, q_len, dim = q.shape
    kv_heads, s, bs = k.shape[1], mask.ctx_len, mask.block_size
    group, n = heads // kv_heads, q_len // bs
    q = q.reshape(batch, kv_heads, group, q_len, dim) * dim ** -0.5    # GQA: query heads grouped by key head
    k_ctx, v_ctx = k[:, :, None, :s], v[:, :, None, :s]                  # [B, kv, 1, S, D]
    k_own = k[:, :, None, s:].reshape(batch, kv_heads, 1, n, bs, dim)
    v_own = v[:, :, None, s:].reshape(batch, kv_heads, 1, n, bs, dim)
    ctx_scores = (q @ k_ctx.transpose(-1, -2)).float()                  # [B, kv, G, Q, S]
    ctx_scores = ctx_scores.masked_fill(~mask.context[:, None, None], float("-inf"))
    own_scores = (q.reshape(batch, kv_heads, group, n, bs, dim) @ k_own.transpose(-1, -2)).float()  # [.., N, bs, bs]
    probs = torch.cat([ctx_scores.reshape(batch, kv_heads, group, n, bs, s), own_scores], -1).softmax(-1)
    probs = probs.to(v.dtype)
    out = (probs[..., :s].reshape(batch, kv_heads, group, q_len, s) @ v_ctx
           + (probs[..., s:] @ v_own).reshape(batch, kv_heads, group, q_len, dim))
    return out.reshape(batch, heads, q_len, dim)


def training_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, backend: str = "auto"):
    """The mask for one training forward, built once and shared by all layers: a BlockMask (flex), the
    split kernel's context mask (split) or a boolean tensor (sdpa). anchors [B, N]; padding anchors are 0
    (they see no context; zero loss weight)."""
    backend = resolve_backend(backend, anchors.device)
    if backend == "sdpa":
        return dense_mask(anchors, ctx_len, block_size)
    if backend == "split":
        return SplitMask(anchors, ctx_len, block_size)
    return flex_block_mask(anchors, ctx_len, block_size)


def attend(q, k, v, mask=None):
    """q [B, heads, Q, D], k/v [B, kv_heads, K, D] -> [B, heads, Q, D].

    mask None: every key visible (inference: the block sees all cached context and itself, as the
    reference's unmasked path); a boolean tensor: SDPA; a SplitMask: the split kernel; a BlockMask:
    FlexAttention (compiled on CUDA unless already inside a compiled region)."""
    q, k, v = _common_dtype(q, k, v)
    if isinstance(mask, SplitMask):
        return split_attend(q, k, v, mask)
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    from torch.nn.attention.flex_attention import flex_attention

    kernel = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        kernel = _compiled_flex()
    return kernel(q, k, v, block_mask=mask, enable_gqa=True)
