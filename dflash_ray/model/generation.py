"""Generation with the target, no Ray: train a small target on a corpus (the embedded default's demo
world), and regenerate conversations' assistant turns with the target's own greedy answers (what the
drafter must learn to predict: the target, not the dataset's authors).

Regeneration walks each conversation's assistant turns in order; turn t is generated from the
conversation as regenerated so far (history up to that turn, earlier assistant turns already replaced),
rendered with the tokenizer's chat template and its generation prompt, exactly as a serving engine
renders it. Generation is batched (left-padded, KV cache: `transformers`' `generate`), greedy, and stops
at the template's end-of-turn token or `max_new_tokens`. Problems are counted per reason, never raised.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

TRAINED_MARKER = "dflash_demo_training.json"


def train_causal_lm(model_dir: str, sequences: list[list[int]], *, steps: int, lr: float = 3e-3,
                    tokens_per_batch: int = 4096, pad_id: int = 0, seed: int = 0, log=print) -> dict:
    """Train the causal LM in `model_dir` (in place, on the CPU or wherever it loads) on token sequences:
    next-token cross-entropy on every real token, AdamW, linear warmup over 30 steps, batches of similar
    lengths under a padded-token budget. Writes a marker with the figures; a directory that has one is
    returned as is (trained once, reused by every later run)."""
    from transformers import AutoModelForCausalLM

    marker = Path(model_dir) / TRAINED_MARKER
    if marker.exists():
        return json.loads(marker.read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    by_length = np.argsort([len(s) for s in sequences], kind="stable")
    t0, losses = time.time(), []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            k = int(rng.integers(0, len(by_length)))
            rows, width = [], 0
            while k < len(by_length) and (len(rows) + 1) * max(width, len(sequences[by_length[k]])) <= tokens_per_batch:
                rows.append(sequences[by_length[k]])
                width = max(width, len(rows[-1]))
                k += 1
            if not rows:                                    # one sequence over the budget: train it alone
                rows, width = [sequences[by_length[k - 1 if k else 0]]], len(sequences[by_length[k - 1 if k else 0]])
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for r, seq in enumerate(rows):
                ids[r, :len(seq)] = torch.tensor(seq)
                attn[r, :len(seq)] = 1
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / 30)
            loss = model(input_ids=ids, attention_mask=attn, labels=ids.masked_fill(attn == 0, -100)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    figures = {"steps": steps, "seconds": round(time.time() - t0, 1), "first_loss": losses[0],
               "final_loss": float(np.mean(losses[-20:]))}
    marker.write_text(json.dumps(figures))
    log(f"trained the target {steps} steps in {figures['seconds']} s: loss {figures['first_loss']:.2f} -> "
        f"{figures['final_loss']:.3f} -> {model_dir}")
    return figures


class Regenerator:
    """Regenerates conversations with a target (greedy, batched). Reused across batches of a job."""

    def __init__(self, target_dir: str, tokenizer_dir: str, *, max_new_tokens: int, batch_size: int = 32,
                 device: str | torch.device = "cpu"):
        from dflash_ray.tokenizer import load_tokenizer
        from dflash_ray.model.target import load_target

        self.tok = load_tokenizer(tokenizer_dir)
        self.device = torch.device(device)
        self.model = load_target(target_dir, device=self.device)
        self.max_new_tokens, self.batch_size = int(max_new_tokens), int(batch_size)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eot = self.tok.eos_token_id

    def __call__(self, conversations: list) -> tuple[list, Counter]:
        """Regenerated conversations (None where one failed) and counts by reason: 'regenerated turns',
        'hit max_new_tokens' (kept, without an end-of-turn), 'prompt longer than the target's context',
        'empty or malformed conversation' (the conversation is dropped)."""
        counts = Counter()
        out = [None] * len(conversations)
        history: dict[int, list] = {}
        pending: dict[int, list] = {}
        for i, conv in enumerate(conversations):
            if not _well_formed(conv):
                counts["empty or malformed conversation"] += 1
                continue
            history[i], pending[i] = [], list(conv)
        while pending:
            prompts = {}
            for i in list(pending):
                rest = pending[i]
                turn = next((t for t, m in enumerate(rest) if m["role"] == "assistant"), None)
                if turn is None:                                 # no assistant turn left: done
                    out[i] = history[i] + rest
                    del pending[i]
                    continue
                history[i] += rest[:turn]
                pending[i] = rest[turn + 1:]
                ids = self.tok.apply_chat_template(history[i], tokenize=True, add_generation_prompt=True,
                                                   return_dict=False)
                if len(ids) + 1 > self.max_context:
                    counts["prompt longer than the target's context"] += 1
                    del pending[i], history[i]
                    continue
                prompts[i] = ids
            order = sorted(prompts, key=lambda i: len(prompts[i]))
            for a in range(0, len(order), self.batch_size):
                chunk = order[a:a + self.batch_size]
                for i, (text, stopped) in zip(chunk, self._generate([prompts[i] for i in chunk])):
                    history[i].append({"role": "assistant", "content": text})
                    counts["regenerated turns"] += 1
                    if not stopped:
                        counts["hit max_new_tokens"] += 1
        return out, counts

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]]) -> list[tuple[str, bool]]:
        width = max(len(p) for p in prompts)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(prompts):                          # left padding: generation appends on the right
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        new = min(self.max_new_tokens, self.max_context - width)
        gen = self.model.generate(ids.to(self.device), attention_mask=attn.to(self.device), max_new_tokens=new,
                                  do_sample=False, eos_token_id=self.eot, pad_token_id=pad)[:, width:].tolist()
        results = []
        for row in gen:
            stopped = self.eot in row
            row = row[:row.index(self.eot)] if stopped else [t for t in row if t != pad]
            results.append((self.tok.decode(row), stopped))
        return results


def _well_formed(conv) -> bool:
    return (isinstance(conv, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in conv)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in conv))
