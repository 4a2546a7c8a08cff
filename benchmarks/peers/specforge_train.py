"""SpecForge's own CLI, `specforge train --config FILE`, with its trained anchor blocks counted from its own
sampler (harness.BlockCounter on OnlineDFlashModel): run in the peers' venv by benchmarks/peers/whole_job.py,
never imported by the package. Prints one JSON line at the end: {"blocks": N, "forwards": M}.

    .peers-venv/bin/python benchmarks/peers/specforge_train.py --config train.yaml
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BlockCounter  # noqa: E402


def main() -> int:
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.cli import main as specforge

    blocks = BlockCounter(OnlineDFlashModel)
    calls = {"n": 0}
    counted = OnlineDFlashModel._sample_anchor_positions

    def with_calls(model, *args, **kwargs):
        calls["n"] += 1
        return counted(model, *args, **kwargs)

    OnlineDFlashModel._sample_anchor_positions = with_calls
    sys.argv = ["specforge", "train", *sys.argv[1:]]
    rc = specforge() or 0
    print(json.dumps({"blocks": blocks.total, "forwards": calls["n"]}), flush=True)
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
