"""Acceptance-length evaluation: greedy speculative decoding of a drafter against its target.

Each cycle the drafter proposes a block [last token, B-1 drafted tokens]; the target verifies the block in
one forward; the leading drafted tokens that equal the target's greedy choices are accepted, plus the
target's own next token ("bonus"). The cycle's acceptance length is accepted + 1 (the reference's count:
`dflash.model.dflash_generate(..., return_stats=True).acceptance_lengths`), and tau is its mean, averaged
per prompt then over prompts as the reference benchmark prints it. Greedy verification means the output
must equal plain greedy decoding of the target; `evaluate_acceptance` checks that too.
"""
from __future__ import annotations

import inspect
import time
from pathlib import Path

import torch

from transformers import DynamicCache

from .export import load_drafter
from .target import load_target


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


class _Timer:
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
                         stop_token_ids=None, block_size: int | None = None, timer: _Timer | None = None):
    """Greedy DFlash decoding of one prompt [1, n]. Returns (output_ids [1, <= n+max_new_tokens],
    acceptance_lengths per cycle). Same control flow and counting as the reference `dflash_generate`."""
    timer = timer or _Timer(input_ids.device)
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
                    timer: _Timer | None = None) -> torch.Tensor:
    """Plain greedy decoding with a KV cache: the output speculative decoding must reproduce."""
    timer = timer or _Timer(input_ids.device)
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


def summarize(per_prompt: list[list[int]], block_size: int) -> dict:
    """tau (mean of per-prompt means, as the reference benchmark), per-cycle mean, and the histogram."""
    all_lengths = [x for lengths in per_prompt for x in lengths]
    means = [sum(x) / len(x) for x in per_prompt if x]
    counts = [all_lengths.count(b) for b in range(block_size + 1)]
    return {
        "tau": sum(means) / len(means) if means else float("nan"),
        "tau_per_cycle": sum(all_lengths) / len(all_lengths) if all_lengths else float("nan"),
        "num_cycles": len(all_lengths),
        "acceptance_histogram": counts,  # index = tokens produced in the cycle (accepted + 1)
        "acceptance_fractions": [c / max(1, len(all_lengths)) for c in counts],
    }


def evaluate_acceptance(drafter_dir: str, target_dir: str, prompts: list[list[int]], max_new_tokens: int,
                        stop_token_ids=None, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, block_size: int | None = None,
                        greedy: dict | None = None) -> dict:
    """Greedy speculative decoding of every prompt; returns tau, the acceptance histogram, the target
    time saved against plain greedy decoding, whether outputs match greedy, and per-prompt lengths.

    'Target time saved' compares the target's forward time only (drafter time excluded): greedy needs
    one target forward per token, speculative decoding one per cycle.

    `greedy`: the "greedy_reference" of an earlier call with the same target, prompts, limits, device and
    dtype (plain greedy decoding's outputs, forward seconds and calls): the target does not change between
    drafters, so its greedy decoding is not repeated (an evaluation during training, the fresh drafter's
    tau beside the trained one's)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = load_target(target_dir, device=device, dtype=dtype)
    head = target.get_output_embeddings().weight
    drafter = load_drafter(drafter_dir, target.get_input_embeddings().weight, head).to(device)
    if dtype is not None or device.type == "cuda":
        # Cast the weights only: .to(dtype) would also round RoPE's inv_freq buffer to bf16, which the
        # reference (loaded with a dtype) keeps in fp32.
        for p in drafter.parameters():
            p.data = p.data.to(target.dtype)
    drafter.eval()
    bs = drafter.block_size if block_size is None else block_size

    spec_timer, greedy_timer = _Timer(device), _Timer(device)
    if greedy is not None:
        if len(greedy["outputs"]) != len(prompts):
            raise ValueError(f"greedy reference of {len(greedy['outputs'])} prompts for {len(prompts)} prompts")
        greedy_timer.seconds, greedy_timer.calls = greedy["seconds"], greedy["calls"]
    per_prompt, matches, new_tokens, greedy_outputs = [], [], 0, []
    for k, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        spec, lengths = speculative_generate(drafter, target, ids, max_new_tokens, stop_token_ids, bs, spec_timer)
        plain = (torch.tensor([greedy["outputs"][k]], dtype=torch.long, device=device) if greedy is not None
                 else greedy_generate(target, ids, max_new_tokens, stop_token_ids, greedy_timer))
        greedy_outputs.append(plain[0].tolist())
        per_prompt.append(lengths)
        matches.append(torch.equal(spec, plain))
        new_tokens += spec.shape[1] - ids.shape[1]

    stats = summarize(per_prompt, bs)
    stats.update(
        drafter=str(Path(drafter_dir)), target=str(Path(target_dir)), block_size=bs,
        num_prompts=len(prompts), new_tokens=new_tokens,
        outputs_match_greedy=all(matches), per_prompt_match=matches,
        per_prompt_acceptance_lengths=per_prompt,
        target_forwards_speculative=spec_timer.calls, target_forwards_greedy=greedy_timer.calls,
        target_seconds_speculative=spec_timer.seconds, target_seconds_greedy=greedy_timer.seconds,
        target_seconds_saved=greedy_timer.seconds - spec_timer.seconds,
        target_tokens_per_s_greedy=new_tokens / greedy_timer.seconds if greedy_timer.seconds else float("nan"),
        target_tokens_per_s_speculative=new_tokens / spec_timer.seconds if spec_timer.seconds else float("nan"),
        greedy_reference={"outputs": greedy_outputs, "seconds": greedy_timer.seconds, "calls": greedy_timer.calls},
    )
    stats["target_time_speedup"] = (greedy_timer.seconds / spec_timer.seconds) if spec_timer.seconds else float("nan")
    return stats
