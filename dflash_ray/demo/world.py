"""The embedded default's data: when no input, tokenizer or shards are given, make them under the run
directory (a generated corpus, a tokenizer trained on it, prepared shards, held-out prompts). Existing
ones are reused."""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from dflash_ray.config import require
from dflash_ray.data.prepare import options_from_config, prepare
from dflash_ray.data.shards import list_shards
from dflash_ray.data.synthetic import train_tokenizer, write_corpus

HELDOUT = "heldout.jsonl"


def ensure_corpus(cfg, log=print) -> bool:
    """Fill data.input / data.tokenizer with generated ones when they are null. Returns True when the
    corpus is the synthetic one (the demo world)."""
    run_dir = Path(cfg.run.dir)
    d = cfg.data
    synthetic = not OmegaConf.is_missing(d, "input") and d.input is None
    if synthetic:
        corpus = run_dir / "corpus.jsonl"
        if not corpus.exists():
            write_corpus(corpus, d.synthetic.num_conversations, min_tokens=d.synthetic.min_tokens,
                         max_tokens=d.synthetic.max_tokens, seed=int(cfg.seed))
            log(f"generated {d.synthetic.num_conversations} synthetic conversations -> {corpus}")
        d.input = str(corpus)
    if synthetic and not OmegaConf.is_missing(d, "tokenizer") and d.tokenizer is None:
        tok = run_dir / "tokenizer"
        if not (tok / "tokenizer.json").exists():
            train_tokenizer(d.input, tok)
            log(f"trained a byte-level BPE tokenizer -> {tok}")
        d.tokenizer = str(tok)
    return synthetic


def ensure_shards(cfg, log=print) -> None:
    """Prepare data.input into data.shards when the shard directory does not exist yet. Required values
    (`???`) must be given unless shards exist. Shards at a URI (s3://...) are read, never prepared here."""
    d = cfg.data
    shards = require(cfg, "data.shards")
    if "://" not in str(shards) and not Path(shards).exists():
        s = prepare(require(cfg, "data.input"), require(cfg, "data.tokenizer"), shards, progress=False,
                    **options_from_config(cfg))
        dropped = ", ".join(f"{k}: {v}" for k, v in s.dropped.items()) or "none"
        log(f"prepared {s.samples} samples, {s.tokens} tokens in {s.shards} shards -> {shards} (dropped: {dropped})")
    list_shards(shards)


def ensure_data(cfg, log=print):
    """The corpus (generated when data.input is null) and its shards."""
    ensure_corpus(cfg, log=log)
    ensure_shards(cfg, log=log)
    return cfg


def write_heldout(cfg, tokenizer, path: str | Path, log=print) -> Path:
    """Prompts no run trains on (a corpus of another seed): each conversation's first user turn with the
    chat template's generation prompt, as token ids, one JSON list per line."""
    path = Path(path)
    if path.exists():
        return path
    d = cfg.data.synthetic
    source = path.with_name(".heldout-conversations.jsonl")
    write_corpus(source, int(d.heldout_prompts), min_tokens=d.min_tokens, max_tokens=d.max_tokens,
                 seed=int(cfg.seed) + 1_000_003)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(source) as src, open(tmp, "w") as out:
        for line in src:
            conv = json.loads(line)["conversations"]
            first_user = next(i for i, m in enumerate(conv) if m["role"] == "user")
            ids = tokenizer.apply_chat_template(conv[:first_user + 1], tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
            out.write(json.dumps([int(t) for t in ids]) + "\n")
    tmp.replace(path)
    source.unlink()
    log(f"wrote {d.heldout_prompts} held-out prompts -> {path}")
    return path
