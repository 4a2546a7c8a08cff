"""Acceptance-length evaluation of an exported drafter against its target: every prompt decoded greedily by
speculative decoding (speculative.py: a cycle's acceptance length is accepted + 1, the reference's count), tau
the mean per prompt, then over prompts as the reference benchmark prints it. Greedy verification means the output
must equal plain greedy decoding of the target; `evaluate_acceptance` checks that too.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .export import load_drafter
from .speculative import ForwardTimer, greedy_generate, speculative_generate  # noqa: F401  (greedy_generate: re-exported)
from .target import load_target


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

    spec_timer, greedy_timer = ForwardTimer(device), ForwardTimer(device)
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
