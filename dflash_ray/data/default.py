"""The embedded default's data: when no input, tokenizer or shards are given, make them under the run
directory (a generated corpus, a tokenizer trained on it, prepared shards). Existing ones are reused."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from dflash_ray.data.prepare import prepare
from dflash_ray.data.shards import list_shards
from dflash_ray.data.synthetic import train_tokenizer, write_corpus
from dflash_ray.config import require


def ensure_data(cfg, log=print):
    """Fill data.input / data.tokenizer with generated ones when they are null; prepare shards when the
    shard directory does not exist yet. Required values (`???`) must be given unless shards exist."""
    run_dir = Path(cfg.run.dir)
    d = cfg.data
    shards = require(cfg, "data.shards")
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
    if not Path(shards).exists():
        s = prepare(require(cfg, "data.input"), require(cfg, "data.tokenizer"), shards,
                    shard_size=int(d.shard_size), min_supervised=2 * int(cfg.model.block_size),
                    vocab_size=d.vocab_size, progress=False)
        dropped = ", ".join(f"{k}: {v}" for k, v in s.dropped.items()) or "none"
        log(f"prepared {s.samples} samples, {s.tokens} tokens in {s.shards} shards -> {shards} (dropped: {dropped})")
    list_shards(shards)
    return cfg
