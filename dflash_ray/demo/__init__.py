"""The embedded default's demo world: a generated corpus, a tokenizer, a tiny target trained on it, its regeneration."""
