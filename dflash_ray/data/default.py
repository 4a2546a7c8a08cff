"""The embedded default's data: when no input, tokenizer or shards are given, make them under the run
directory (a generated corpus, a tokenizer trained on it, prepared shards). Existing ones are reused."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from dflash_ray.data.prepare import prepare
from dflash_ray.data.shards import list_shards
from dflash_ray.data.synthetic import train_tokenizer, write_corpus
from dflash_ray.errors import UserError


def ensure_data(cfg, log=print):
    """Fill data.input / data.tokenizer with generated ones when unset; prepare shards when missing."""
    run_dir = Path(cfg.run.dir)
    d = cfg.data
    if d.input is None:
        corpus = run_dir / "corpus.jsonl"
        if not corpus.exists():
            write_corpus(corpus, d.synthetic.num_conversations, min_tokens=d.synthetic.min_tokens,
                         max_tokens=d.synthetic.max_tokens, seed=int(cfg.seed))
            log(f"generated {d.synthetic.num_conversations} synthetic conversations -> {corpus}")
        d.input = str(corpus)
    if d.tokenizer is None:
        tok = run_dir / "tokenizer"
        if not (tok / "tokenizer.json").exists():
            train_tokenizer(d.input, tok)
            log(f"trained a byte-level BPE tokenizer -> {tok}")
        d.tokenizer = str(tok)
    if d.shards is None:
        raise UserError("config key 'data.shards' must be set (e.g. data.shards=DIR)")
    if not Path(d.shards).exists():
        if OmegaConf.is_missing(d, "input") or d.input is None:
            raise UserError(f"{d.shards}: shard directory does not exist and data.input is not set")
        s = prepare(d.input, d.tokenizer, d.shards, shard_size=int(d.shard_size),
                    min_supervised=2 * int(cfg.model.block_size), vocab_size=d.vocab_size, progress=False)
        dropped = ", ".join(f"{k}: {v}" for k, v in s.dropped.items()) or "none"
        log(f"prepared {s.samples} samples, {s.tokens} tokens in {s.shards} shards -> {d.shards} (dropped: {dropped})")
    list_shards(d.shards)
    return cfg
