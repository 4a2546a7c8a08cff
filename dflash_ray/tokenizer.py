"""Loading a tokenizer directory with the checks every reader of one needs (prepare, regeneration, eval):
a fast tokenizer (token offsets) with a chat template. Imports neither the data layer nor the model
layer, so both may use it; transformers only when called."""
from __future__ import annotations

from pathlib import Path

from dflash_ray.errors import UserError


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{p}: tokenizer directory does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except Exception as e:
        raise UserError(f"{p}: cannot load tokenizer ({str(e).splitlines()[0]})") from e
    if not getattr(tok, "is_fast", False):
        raise UserError(f"{p}: a fast tokenizer (tokenizer.json) is needed for token offsets")
    if not tok.chat_template:
        raise UserError(f"{p}: tokenizer has no chat_template")
    return tok
