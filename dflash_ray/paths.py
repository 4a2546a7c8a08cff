"""Where models come from: a local directory, or a Hugging Face hub id resolved through huggingface_hub's
cache (downloaded where the machine has network). No torch here.

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


def resolve_model_dir(value: str, key: str) -> str:
    """`value` itself when it is not a hub id; else its snapshot directory in the local Hugging Face
    cache, downloaded first when it is not there and the hub can be reached. One line naming the key
    when neither works."""
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


def resolve_hub_ids(cfg) -> None:
    """Replace hub ids in the model-directory keys of a composed config by their local snapshots."""
    from omegaconf import OmegaConf

    for key in MODEL_KEYS:
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(value, str):
            resolved = resolve_model_dir(value, key)
            if resolved != value:
                OmegaConf.update(cfg, key, resolved)
