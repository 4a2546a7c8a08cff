"""A Hugging Face config's language-model part, read the same way everywhere (the plan, the sizing models,
the model layer, the CLI). Pure Python: no torch, no transformers."""
from __future__ import annotations

from collections.abc import Mapping


def text_config(config):
    """The language model's part of a Hugging Face config: its `text_config` (multimodal checkpoints keep
    the decoder's fields there), else the config itself. `config` is a config.json dict or a
    transformers PretrainedConfig; a dict that has hidden_size at its top is its own text config."""
    if isinstance(config, Mapping):
        return config if "hidden_size" in config else (config.get("text_config") or config)
    return getattr(config, "text_config", None) or config
