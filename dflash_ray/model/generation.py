"""Generation with the target, no Ray: train a small target on a corpus (the embedded default's demo
world), and regenerate conversations' assistant turns with the target's own greedy answers (what the
drafter must learn to predict: the target, not the dataset's authors).

Regeneration walks each conversation's assistant turns in order; turn t is generated from the
conversation as regenerated so far (history up to that turn, earlier assistant turns already replaced),
rendered as the deployment renders it: `rendering` (data/supervision.py's Rendering, passed in by the
caller: the model layer imports no data code) is the chat template with the deployment's template
arguments and the row's tools, the one path `prepare` supervises with. Generation is batched (left-padded,
KV cache: `transformers`' `generate`), greedy, and stops at any end token the model declares (the
tokenizer's eos and every eos of the model's generation_config: Qwen3 lists <|im_end|> and <|endoftext|>)
or at `max_new_tokens`. The answer is decoded from exactly the generated ids before the end token, and
stored as the message whose supervision in `prepare` is exactly that text and its end token
(Rendering.assistant_message).

Greedy loops: a small target's greedy answer often repeats itself until the cap (SmolLM2-135M: 268 of 1,476
turns), and a batch runs to its longest row, so those rows held the batch to the cap. With
on_max_tokens="drop" (such a turn would be dropped at the cap anyway), a row whose generated tail is periodic
(the last max(3p, `loop_min_span`) tokens repeat with a period p <= `loop_max_period`) stops there, and its
turn is dropped as a greedy loop, counted. A turn that ends with an end token before its tail ever repeats
so is unchanged: token for token the greedy answer. With "keep" nothing is stopped early.

A conversation ends early, its turns so far kept (counted by reason; dropped whole when no assistant turn is
left): at a turn that hit the cap (on_max_tokens="drop"; "keep" keeps it, without an end token, and goes
on), at a greedy loop (with "drop"), at a turn the template cannot render as generated, at a prompt longer
than the target's context, and after the first turn where the target calls a tool or the recorded
conversation goes on with tool results (the recorded results no longer answer what the target did). Problems are counted, never raised.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from transformers import StoppingCriteria

from dflash_ray.config import RegenerateConfig

TRAINED_MARKER = "dflash_demo_training.json"


def train_causal_lm(model_dir: str, sequences: list[list[int]], *, steps: int, lr: float = 3e-3,
                    tokens_per_batch: int = 4096, pad_id: int = 0, seed: int = 0, log=print, on_step=None) -> dict:
    """Train the causal LM in `model_dir` (in place, on the CPU or wherever it loads) on token sequences:
    next-token cross-entropy on every real token, AdamW, linear warmup over 30 steps, batches of similar
    lengths under a padded-token budget. Writes a marker with the figures; a directory that has one is
    returned as is (trained once, reused by every later run). `on_step(steps done)`: called after each step
    (the caller's progress)."""
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
            if on_step is not None:
                on_step(step + 1)
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    figures = {"steps": steps, "seconds": round(time.time() - t0, 1), "first_loss": losses[0],
               "final_loss": float(np.mean(losses[-20:]))}
    marker.write_text(json.dumps(figures))
    log(f"trained the target {steps} steps in {figures['seconds']} s: loss {figures['first_loss']:.2f} -> "
        f"{figures['final_loss']:.3f} -> {model_dir}")
    return figures


ON_MAX_TOKENS = ("drop", "keep")
LOCAL_ENGINES = ("batched", "continuous")   # the engines a Regenerator runs in its own process (transformers)
PAGE_TOKENS = 64        # the continuous engine's KV-cache page (transformers' default 256 wastes memory on short turns)
LOOP_MIN_SPAN = 32      # tokens a loop must fill before it stops a row: no sentence of real text repeats so
LOOP_MAX_PERIOD = 64    # the longest repeated unit looked for (a sentence or two)


class LoopStop(StoppingCriteria):
    """A transformers stopping criterion: per row, whether the tokens generated so far (after `start`) end in
    a loop, the last n = max(3p, min_span) of them periodic with a period p <= max_period. Records the length
    at which each row was first found looping (`first`), since generate goes on calling it on finished rows."""

    def __init__(self, start: int, rows: int, min_span: int = LOOP_MIN_SPAN, max_period: int = LOOP_MAX_PERIOD):
        self.start, self.min_span, self.max_period = start, min_span, max_period
        self.first: list[int | None] = [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        gen = input_ids[:, self.start:]
        t = gen.shape[1]
        looping = torch.zeros(gen.shape[0], dtype=torch.bool, device=gen.device)
        for p in range(1, self.max_period + 1):
            n = max(3 * p, self.min_span)
            if n > t:   # n grows with p: no longer period fits yet
                break
            tail = gen[:, -n:]
            looping |= (tail[:, p:] == tail[:, :-p]).all(dim=1)
        for r in torch.nonzero(looping).flatten().tolist():
            if self.first[r] is None:
                self.first[r] = t
        return looping


def end_token_ids(tok, model) -> list[int]:
    """Every token id that ends a turn: the tokenizer's eos and each eos of the model's generation_config
    (an int or a list), in that order, once each."""
    ids = [tok.eos_token_id]
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += declared if isinstance(declared, (list, tuple)) else [declared]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def declared_end_token_ids(tok, target_dir: str) -> list[int] | None:
    """end_token_ids for a target directory without loading its weights (its generation_config.json, when it
    has one): what eval and the held-out tau stop decoding at, as regeneration does. None without a tokenizer."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    if tok is None:
        return None
    try:
        config = GenerationConfig.from_pretrained(str(target_dir))
    except (OSError, ValueError):   # no generation_config.json: the tokenizer's eos only
        config = None
    return end_token_ids(tok, SimpleNamespace(generation_config=config)) or None


class TurnWalk:
    """Conversations walked turn by turn by the module's rules, whatever generates the answers: `prompts()` gives
    the prompt ids of every conversation waiting on a turn (one turn depth at a time), `answer(i, ...)` applies
    what was generated for conversation i, `result()` is (regenerated conversations or None, counts by reason).
    The engines of Regenerator and the jobs that batch turns over a cluster (runtime/jobs/regenerate.py) share it."""

    def __init__(self, rendering, conversations: list, tools: list | None, *, max_context: int, on_max_tokens: str,
                 end_texts: tuple):
        self.rendering, self.max_context, self.on_max_tokens, self.end_texts = rendering, max_context, on_max_tokens, end_texts
        self.counts = Counter()
        self.tools = list(tools) if tools is not None else [None] * len(conversations)
        self.out: list = [None] * len(conversations)
        self.history: dict[int, list] = {}
        self.pending: dict[int, list] = {}
        self.waiting: dict[int, list[int]] = {}
        self.texts: dict[int, str] = {}     # the waiting prompts as rendered text (what a server is sent)
        for i, conv in enumerate(conversations):
            if not _well_formed(conv):
                self.counts["empty or malformed conversation"] += 1
                continue
            self.history[i], self.pending[i] = [], list(conv)

    def finished(self) -> list[int]:
        """The conversations finished so far (in order), whether kept (`out[i]`) or left without a turn (None)."""
        return [i for i in range(len(self.out)) if i not in self.pending]

    def prompts(self) -> dict[int, list[int]]:
        """The prompt ids of the next turn of every conversation still waiting on one (conversations without a turn
        left, or whose prompt cannot be rendered or is over the context, are finished here)."""
        self.waiting, self.texts = {}, {}
        for i in list(self.pending):
            rest = self.pending[i]
            turn = next((t for t, m in enumerate(rest) if m["role"] == "assistant"), None)
            if turn is None:                                 # no assistant turn left: done
                self._finish(i, self.history[i] + rest, early=False)
                continue
            self.history[i] += rest[:turn]
            self.pending[i] = rest[turn + 1:]
            try:
                text, ids = self.rendering.prompt_ids(self.history[i], self.tools[i])
            except Exception:                                # the template's own errors (jinja2)
                self.counts["chat template failed"] += 1
                self._finish(i, self.history[i], early=True)
                continue
            if len(ids) + 1 > self.max_context:
                self.counts["prompt longer than the target's context"] += 1
                self._finish(i, self.history[i], early=True)
                continue
            self.waiting[i], self.texts[i] = ids, text
        return dict(self.waiting)

    def answer(self, i: int, text: str, stopped: bool, capped_by: str) -> None:
        """What was generated for conversation i's waiting turn: `text` (decoded from the ids before the end
        token), `stopped` (at an end token), `capped_by` (when not stopped: 'max_new_tokens', 'the target's
        context', 'a greedy loop'; or why the engine gave no answer, e.g. a server's error, counted as it says)."""
        del self.waiting[i]
        if capped_by == "a greedy loop":
            self.counts["turns dropped: a greedy loop"] += 1
            self._finish(i, self.history[i], early=True)
            return
        if capped_by.startswith("error:"):
            self.counts[f"turns dropped: {capped_by[len('error:'):].strip()}"] += 1
            self._finish(i, self.history[i], early=True)
            return
        if not stopped:
            self.counts[f"hit {capped_by}"] += 1
            if self.on_max_tokens == "drop":
                self.counts[f"turns dropped: hit {capped_by}"] += 1
                self._finish(i, self.history[i], early=True)
                return
        ends = self.end_texts if stopped else self.end_texts + ("",)
        message = self.rendering.assistant_message(self.history[i], self.tools[i], text, ends)
        if message is None:
            self.counts["turns dropped: the chat template does not render them as generated"] += 1
            self._finish(i, self.history[i], early=True)
            return
        self.history[i].append(message)
        self.counts["regenerated turns"] += 1
        if not stopped:
            self.counts[f"turns kept without an end token: hit {capped_by}"] += 1
        if self.rendering.calls_a_tool(text):
            self.counts["stopped at the target's first tool call"] += 1
            self._finish(i, self.history[i], early=True)
        elif self.pending[i] and self.pending[i][0]["role"] == "tool":
            self.counts["stopped before recorded tool results (the target called no tool)"] += 1
            self._finish(i, self.history[i], early=True)

    def _finish(self, i: int, messages: list, early: bool) -> None:
        """Conversation i ends with `messages`; early: cut after its last kept assistant turn (the source's
        assistant turns not reached are counted)."""
        rest = self.pending.pop(i)
        if early:
            self.counts["assistant turns not reached (the conversation ended early)"] += sum(
                m["role"] == "assistant" for m in rest)
            last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            messages = messages[:last + 1] if last is not None else []
        if any(m["role"] == "assistant" for m in messages):
            self.out[i] = messages
        else:
            self.counts["conversations left without an assistant turn"] += 1
        del self.history[i]

    def result(self) -> tuple[list, Counter]:
        return self.out, self.counts


class Regenerator:
    """Regenerates conversations with a target (greedy by default, batched). Reused across batches of a job."""

    def __init__(self, target_dir: str, rendering, *, max_new_tokens: int,
                 batch_size: int = RegenerateConfig.batch_size, on_max_tokens: str = RegenerateConfig.on_max_tokens,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 loop_min_span: int = LOOP_MIN_SPAN, loop_max_period: int = LOOP_MAX_PERIOD,
                 engine: str = RegenerateConfig.engine, sampling: dict | None = None):
        from dflash_ray.model.target import load_target

        if on_max_tokens not in ON_MAX_TOKENS:
            raise ValueError(f"on_max_tokens: {on_max_tokens!r} is not one of {', '.join(ON_MAX_TOKENS)}")
        if engine not in LOCAL_ENGINES:
            raise ValueError(f"engine: {engine!r} is not one of {', '.join(LOCAL_ENGINES)}")
        # batched: generate() over batches of like-length prompts, each running to its longest row (a greedy
        # loop ends a row early); continuous: transformers' continuous batching (generate_batch), batch_size
        # rows in flight, a finished row's slot taken by the next prompt at once
        self.engine = engine
        self.rendering, self.tok = rendering, rendering.tok
        self.device = torch.device(device)
        self.model = load_target(target_dir, device=self.device, dtype=dtype)
        self.max_new_tokens, self.batch_size = int(max_new_tokens), int(batch_size)
        self.on_max_tokens = on_max_tokens
        # see the module's doc; loop_max_period=0: loops run to the cap
        self.loops = (loop_min_span, loop_max_period) if on_max_tokens == "drop" and loop_max_period > 0 else None
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.ends = end_token_ids(self.tok, self.model)
        self.end_texts = tuple(self.tok.decode([t]) for t in self.ends)
        self.sampling = sampling_options(sampling)
        self.calls = 0   # generate calls so far: a sampled run seeds each with regenerate.seed + its number

    def __call__(self, conversations: list, tools: list | None = None) -> tuple[list, Counter]:
        """Regenerated conversations (None where none is left) and counts by reason. `tools`: each
        conversation's tool definitions (None: none)."""
        walk = TurnWalk(self.rendering, conversations, tools, max_context=self.max_context,
                        on_max_tokens=self.on_max_tokens, end_texts=self.end_texts)
        while prompts := walk.prompts():
            order = sorted(prompts, key=lambda i: len(prompts[i]))
            step = self.batch_size if self.engine == "batched" else max(len(order), 1)   # continuous: all at once
            for a in range(0, len(order), step):
                chunk = order[a:a + step]
                results, generated = self._generate([prompts[i] for i in chunk])
                walk.counts["generated tokens"] += generated
                for i, (text, stopped, capped_by) in zip(chunk, results):
                    walk.answer(i, text, stopped, capped_by)
        return walk.result()

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]]) -> tuple[list[tuple[str, bool, str]], int]:
        """(text, stopped at an end token, what capped it: 'max_new_tokens' or 'the target's context') per
        prompt, and the tokens generated (end tokens included); text is decoded from exactly the ids
        generated before the end token."""
        from transformers import GenerationConfig, StoppingCriteriaList

        width = max(len(p) for p in prompts)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.ends[0]
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(prompts):                          # left padding: generation appends on the right
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        new = min(self.max_new_tokens, self.max_context - width)
        capped_by = "max_new_tokens" if new == self.max_new_tokens else "the target's context"
        # a config of its own: greedy (or regenerate.temperature's sampling), whatever the model's generation_config says
        s = self.sampling
        sample = dict(do_sample=True, temperature=s["temperature"], top_p=s["top_p"]) if s["temperature"] > 0 else \
            dict(do_sample=False)
        config = GenerationConfig(max_new_tokens=new, eos_token_id=self.ends, pad_token_id=pad, **sample)
        self.calls += 1
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if s["seed"] is not None:   # a sampled run's draws: the seed and this call's number
                torch.manual_seed(s["seed"] + self.calls)
            if self.engine == "continuous":
                gen = self._generate_continuous(prompts, new, config)
                firsts = [first_loop(row, *self.loops) if self.loops else None for row in gen]
            else:
                loops = LoopStop(width, len(prompts), *self.loops) if self.loops else None
                gen = self.model.generate(ids.to(self.device), attention_mask=attn.to(self.device),
                                          generation_config=config,
                                          stopping_criteria=StoppingCriteriaList([loops]) if loops else None)[:, width:].tolist()
                firsts = loops.first if loops else [None] * len(gen)
        ends, results, generated = set(self.ends), [], 0
        for r, row in enumerate(gen):
            stop = next((k for k, t in enumerate(row) if t in ends), None)
            looped = firsts[r]
            if looped is not None and (stop is None or looped <= stop):   # (found after an end token: padding)
                results.append(("", False, "a greedy loop"))
                generated += looped
                continue
            # a row that never stopped generated `new` tokens: generate pads only after a row's end token
            body = row if stop is None else row[:stop]
            results.append((self.tok.decode(body), stop is not None, capped_by))
            generated += len(row) if stop is None else stop + 1
        return results, generated

    def _generate_continuous(self, prompts: list[list[int]], new: int, config) -> list[list[int]]:
        """Each prompt's generated ids by transformers' continuous batching, in the prompts' order. The KV cache
        is sized here (pages for batch_size rows of the longest prompt plus `new`): left to itself it sizes
        from the device's free memory, which on a CPU means many GiB allocated for each call."""
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        slots = max(1, min(self.batch_size, len(prompts)))
        pages = -(-(max(len(p) for p in prompts) + new) // PAGE_TOKENS)
        cb = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=slots * pages + 1, max_requests_per_batch=slots,
                                      max_batch_tokens=max(slots, 2048), use_cuda_graph=False, allow_block_sharing=False)
        out = self.model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                                        progress_bar=False, warmup=False)
        by_order = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[1]))   # req_<n>, as added
        for o in by_order:
            if o.error:
                raise RuntimeError(f"continuous batching failed on a prompt: {o.error}")
        return [list(o.generated_tokens) for o in by_order]


def sampling_options(sampling: dict | None) -> dict:
    """regenerate.temperature / top_p / seed as the engines take them: temperature 0 (the default) is greedy, the
    answer a drafter served at temperature 0 must predict."""
    s = dict(sampling or {})
    return {"temperature": float(s.get("temperature") or 0.0), "top_p": float(s.get("top_p") or 1.0),
            "seed": None if s.get("seed") is None else int(s["seed"])}


def first_loop(row: list[int], min_span: int = LOOP_MIN_SPAN, max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The length at which LoopStop would first find `row` (generated ids) looping, or None: the same rule,
    applied after the fact (the continuous engine takes no stopping criteria). The first t whose last
    n = max(3p, min_span) ids repeat with a period p: their last n - p ids each equal the one p before."""

    x = np.asarray(row, dtype=np.int64)
    best = None
    for p in range(1, max_period + 1):
        n = max(3 * p, min_span)
        if n > x.size:
            break
        eq = np.concatenate([np.zeros(p, bool), x[p:] == x[:-p]])   # eq[k]: x[k] == x[k - p]
        # run[k]: matches ending at k in a row; the tail of t = k + 1 ids is periodic when run[k] >= n - p
        idx = np.arange(x.size)
        last_miss = np.maximum.accumulate(np.where(eq, -1, idx))
        hit = np.flatnonzero((idx - last_miss >= n - p) & (idx + 1 >= n))
        if hit.size and (best is None or hit[0] + 1 < best):
            best = int(hit[0]) + 1
    return best


def _well_formed(conv) -> bool:
    return (isinstance(conv, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in conv)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in conv))
