"""`require`: a config value that must be set, or one line naming its key.

Its own module (light: OmegaConf only) so that the config (dflash_ray.config, which re-exports it) and
the layers the config's checks call (dflash_ray.data.plan) both import it without importing each other.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dflash_ray.errors import UserError


def require(cfg: DictConfig, key: str) -> Any:
    """The value at `key`, or a UserError naming the key when it is unset (??? or null)."""
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException:
        value = None
    if value is None:
        raise UserError(f"config key '{key}' must be set (e.g. {key}=...)")
    return value
