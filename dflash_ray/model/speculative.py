"""Greedy DFlash speculative decoding of one prompt against its target, and plain greedy decoding (the output
it must equal). Shipped with every export beside modeling_dflash.py (transformers' trust_remote_code copies a
modeling file's relative imports): it imports only torch and transformers, and reads from the drafter only
`block_size`, `mask_token_id`, `target_layer_ids`, `new_cache`, `extend_context`, `draft_hidden` and `logits`
(draft_core.DraftCore), so the training package's drafter and the exported one decode by the same code.

Each cycle the drafter proposes a block [last token, B-1 drafted tokens]; the target verifies the block in
one forward; the leading drafted tokens that equal the target's greedy choices are accepted, plus the
target's own next token ("bonus"). The cycle's acceptance length is accepted + 1 (the reference's count:
`dflash.model.dflash_generate(..., return_stats=True).acceptance_lengths`).
"""
from __future__ import annotations

import inspect
import time

import torch

from transformers import DynamicCache


def _tapped(hidden_states, layer_ids):
    # hidden_states[i + 1] is decoder layer i's output: the reference's extract_context_feature.
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _cache_kwarg(target) -> str:
    # transformers 5 renamed `past_key_values` to `cache` (the old name warns until it is removed).
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _crop(cache, length: int):
    # transformers 5 crops by a negative count of tokens to remove.
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class ForwardTimer:
    """Wall time of the target's forwards (synchronised on CUDA so the time is the GPU's)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds, self.calls = 0.0, 0

    def __call__(self, fn, *args, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


@torch.inference_mode()
def speculative_generate(drafter, target, input_ids: torch.Tensor, max_new_tokens: int,
                         stop_token_ids=None, block_size: int | None = None, timer: ForwardTimer | None = None):
    """Greedy DFlash decoding of one prompt [1, n]. Returns (output_ids [1, <= n+max_new_tokens],
    acceptance_lengths per cycle). Same control flow and counting as the reference `dflash_generate`."""
    timer = timer or ForwardTimer(input_ids.device)
    bs = drafter.block_size if block_size is None else block_size
    n = input_ids.shape[1]
    max_length = n + max_new_tokens
    device = input_ids.device
    output = torch.full((1, max_length + 1), drafter.mask_token_id, dtype=torch.long, device=device)
    output[:, :n] = input_ids
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()  # lets sliding-window layers roll back, as the reference does
    draft_cache = drafter.new_cache()
    stops = torch.tensor(stop_token_ids or [], dtype=torch.long, device=device)

    kw = _cache_kwarg(target)
    out = timer(target, input_ids, position_ids=torch.arange(n, device=device)[None], **{kw: cache},
                use_cache=True, logits_to_keep=1, output_hidden_states=True)
    output[:, n] = out.logits[:, -1].argmax(-1)
    new_features = _tapped(out.hidden_states, drafter.target_layer_ids)  # positions 0..n-1

    lengths = []
    start = n
    stopped = bool(torch.isin(output[:, start], stops).any())
    while start + 1 < max_length and not stopped:
        verify = min(bs, max_length - start)
        block = output[:, start:start + verify].clone()
        if verify > 1:
            drafter.extend_context(draft_cache, new_features)
            hidden = drafter.draft_hidden(draft_cache, block)[:, 1:]
            block[:, 1:] = drafter.logits(hidden).argmax(-1)
        out = timer(target, block, position_ids=torch.arange(start, start + verify, device=device)[None],
                    **{kw: cache}, use_cache=True, output_hidden_states=verify > 1)
        posterior = out.logits.argmax(-1)
        accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
        output[:, start:start + accepted + 1] = block[:, :accepted + 1]
        output[:, start + accepted + 1] = posterior[:, accepted]
        produced = min(accepted + 1, max_length - start - 1)
        hits = torch.isin(output[0, start + 1:start + produced + 1], stops).nonzero()
        if hits.numel() > 0:
            produced, stopped = int(hits[0, 0]) + 1, True
        start += produced
        _crop(cache, start)  # drop the target's KV of rejected block tokens
        lengths.append(produced)
        if verify > 1:
            new_features = _tapped(out.hidden_states, drafter.target_layer_ids)[:, :produced]
    return output[:, :min(start + 1, max_length)], lengths


@torch.inference_mode()
def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids=None,
                    timer: ForwardTimer | None = None) -> torch.Tensor:
    """Plain greedy decoding with a KV cache: the output speculative decoding must reproduce."""
    timer = timer or ForwardTimer(input_ids.device)
    stops = set(stop_token_ids or [])
    cache = DynamicCache(config=target.config)
    kw = _cache_kwarg(target)
    ids = input_ids
    step_in = input_ids
    for _ in range(max_new_tokens):
        pos = torch.arange(ids.shape[1] - step_in.shape[1], ids.shape[1], device=ids.device)[None]
        out = timer(target, step_in, position_ids=pos, **{kw: cache}, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        step_in = nxt
        if int(nxt) in stops:
            break
    return ids
