"""eval and the held-out tau stop decoding where regenerate stops a turn: at the tokenizer's eos and at every
end token the target's generation_config declares (Qwen3 lists <|im_end|> and <|endoftext|>)."""
from __future__ import annotations

from helpers_data import make_tokenizer
from transformers import AutoTokenizer, GenerationConfig

from dflash_ray.model.generation import declared_end_token_ids


def test_every_declared_end_token_stops_decoding(tmp_path):
    _, tokdir = make_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    eos = tok.eos_token_id
    target = tmp_path / "target"
    GenerationConfig(eos_token_id=[eos, 7, 11]).save_pretrained(str(target))
    assert declared_end_token_ids(tok, str(target)) == [eos, 7, 11]        # the tokenizer's first, once each
    GenerationConfig(eos_token_id=5).save_pretrained(str(target))
    assert declared_end_token_ids(tok, str(target)) == [eos, 5]
    assert declared_end_token_ids(tok, str(tmp_path / "no-generation-config")) == [eos]
    assert declared_end_token_ids(None, str(target)) is None                # no tokenizer: no stop list
