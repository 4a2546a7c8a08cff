"""A GGUF file as a target: converted once, with transformers' own GGUF loader (dequantised to a normal
Hugging Face model), into a Hugging Face directory (safetensors, config, tokenizer files with the chat
template) in a cache keyed by the file's digest. Actors, `prepare`, `regenerate` and `eval` then load that
directory in well under a second, as any other target.

    <cache>/gguf/<sha256 of the file, 16 hex>/
        config.json, model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
        gguf-source.json     the file it came from, its digest, transformers' version; written last: an
                             entry without it (a conversion killed midway) is made again

The weights are saved in float32: a quantised file's dequantised values (scale x q + min, in fp16 parts)
are exact there and would round in bf16. The cache is $DFLASH_RAY_CACHE, else ~/.cache/dflash-ray; on a
multi-node cluster it must be on storage every node sees (or the conversion made on each), since the run
passes the converted directory on.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from dflash_ray.errors import UserError
from dflash_ray.machine_cache import cache_root, file_digest

SOURCE_RECORD = "gguf-source.json"


def converted_dir(src: str | os.PathLike, *, cache: str | os.PathLike | None = None, log=print) -> Path:
    """The Hugging Face directory of the GGUF file `src` (paths.gguf_file finds it), converting it on
    first use. One line (UserError) when the gguf package is missing, the file is not a readable GGUF
    file, or transformers cannot dequantise its architecture."""
    src = Path(src)
    digest = file_digest(src)
    out = Path(cache or cache_root()) / "gguf" / digest[:16]
    if (out / SOURCE_RECORD).exists():
        return out
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"{src}: reading a GGUF file needs the 'gguf' package: pip install 'dflash-ray[smol]' "
                        "(or pip install gguf)")
    log(f"converting {src.name} ({src.stat().st_size / 2**20:.0f} MiB GGUF) to a Hugging Face directory "
        f"-> {out} (once: cached by the file's digest)")
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _convert(src, tmp)
        (tmp / SOURCE_RECORD).write_text(json.dumps(
            {"source": str(src.resolve()), "sha256": digest, "transformers": _transformers_version()}, indent=1))
        if out.exists():          # a damaged entry (no source record): made again
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except Exception as e:   # not GGUF, truncated, an architecture transformers cannot dequantise: its reason
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{src}: cannot load as a GGUF model ({reason[:300]})") from e
    # transformers marks a model loaded from GGUF as quantised and refuses to save it; its weights are
    # dequantised already, so the same architecture built from the config without that mark takes them
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = type(quantised)(config)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:
        raise UserError(f"{src}: the dequantised weights do not match {type(model).__name__} "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _tied_keys(model) -> set:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if not isinstance(tied, dict) else set(tied.keys())


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
