"""The embedded default's data: a generated conversation corpus with learnable answers, and a byte-level
BPE tokenizer with a ChatML chat template trained on it (built locally: nothing is downloaded)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dflash_ray.config import SyntheticConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
          "tau upsilon phi chi psi omega red green blue cyan magenta yellow black white north south east "
          "west river stone cloud fire water earth wind light shadow").split()


def _task(rng: np.random.Generator, target_words: int) -> tuple[str, str]:
    """A user request and its deterministic answer, about `target_words` words long. The answers walk
    a fixed cycle of words (forwards, backwards, every second word) or repeat a phrase: structure a tiny
    target learns in seconds (a chain of successors, and copying), and that generalises to unseen
    starting points and phrases."""
    n = max(3, target_words)
    kind = rng.integers(0, 4)
    start = int(rng.integers(0, len(_WORDS)))
    if kind == 0:
        walk = [_WORDS[(start + i) % len(_WORDS)] for i in range(n)]
        return f"Recite the words from {_WORDS[start]} for {n} words.", " ".join(walk)
    if kind == 1:
        walk = [_WORDS[(start - i) % len(_WORDS)] for i in range(n)]
        return f"Recite the words backwards from {_WORDS[start]} for {n} words.", " ".join(walk)
    if kind == 2:
        walk = [_WORDS[(start + 2 * i) % len(_WORDS)] for i in range(n)]
        return f"Recite every second word from {_WORDS[start]} for {n} words.", " ".join(walk)
    phrase = [str(w) for w in rng.choice(_WORDS, size=int(rng.integers(2, 5)))]
    times = max(2, n // len(phrase))
    return f"Repeat {' '.join(phrase)} {times} times.", " ".join(phrase * times)


def write_corpus(path: str | os.PathLike, num_conversations: int, *,
                 min_tokens: int = SyntheticConfig.min_tokens, max_tokens: int = SyntheticConfig.max_tokens,
                 seed: int = 0) -> Path:
    """A long-tailed (log-normal) mix of conversation lengths between about min and max tokens."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lo, hi = np.log(max(min_tokens, 8)), np.log(max_tokens)
    with open(path, "w") as f:
        for i in range(num_conversations):
            tokens = float(np.exp(np.clip(rng.normal(lo + 0.35 * (hi - lo), 0.45 * (hi - lo)), lo, hi)))
            turns = 1 if tokens < 160 or rng.random() < 0.6 else 2
            conv = [{"role": "system", "content": "You are a precise assistant."}] if rng.random() < 0.3 else []
            for _ in range(turns):
                user, answer = _task(rng, max(3, int(tokens / turns / 1.3)))
                conv += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"id": f"synthetic-{i}", "conversations": conv}) + "\n")
    return path


def train_tokenizer(corpus: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer trained on the corpus, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    with open(corpus) as f:
        for line in f:
            texts.extend(m["content"] for m in json.loads(line)["conversations"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts + ["user", "assistant", "system"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>")
    fast.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out
