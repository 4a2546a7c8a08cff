"""The export of a run's latest registered checkpoint: its drafter, as a Hugging Face directory the reference
`dflash` package and transformers' AutoModel load (model/export.py writes it)."""
from __future__ import annotations

import torch

from dflash_ray.runtime.registered import latest_checkpoint, local_checkpoint
from dflash_ray.runtime.training.checkpoint_format import load_weights, read_state


def export_latest(run_spec, dtype: str = "target", card: dict | None = None) -> tuple[str, str] | None:
    """Write the drafter of the run's latest checkpoint (local or remote storage) to <run.dir>/export, as
    a Hugging Face directory the reference `dflash` package loads, in the target's dtype unless `dtype`
    names one (serving engines load the drafter beside the target, in its dtype; bf16 is also half the
    file). Returns (checkpoint, export dir), or None when the run has no checkpoint."""
    from dflash_ray.model.export import export_drafter
    from dflash_ray.model.target import target_dtype
    from dflash_ray.run_layout import RunLayout
    from dflash_ray.runtime.training.model import build_run_drafter

    _, checkpoint = latest_checkpoint(run_spec.experiment_dir)
    if checkpoint is None:
        return None
    with local_checkpoint(checkpoint) as d:
        read_state(d)
        drafter = build_run_drafter(run_spec, torch.device("cpu"))
        drafter.load_state_dict(load_weights(d), strict=True)
    out_dtype = target_dtype(run_spec.target_path) if dtype == "target" else getattr(torch, dtype)
    return checkpoint, export_drafter(drafter, str(RunLayout(run_spec.run_dir).export), dtype=out_dtype, card=card)
