#!/usr/bin/env bash
# The cluster image's install steps as one script: deploy/Dockerfile RUNs it, and tests/test_deploy.py runs
# the same script on a CPU machine (CPU torch, no index) into a throwaway environment.
#   PYTHON           the interpreter whose environment gets everything (default: python, the image's)
#   TORCH_SPEC       torch's requirement (default: torch==2.13.0)
#   TORCH_INDEX_URL  the wheel index of torch's CUDA build (the Dockerfile's: https://download.pytorch.org/whl/cu128);
#                    empty: the default index (on a CPU machine torch==2.13.0 resolves to the CPU wheel there)
#   PROJECT_DIR      the project's source (default: the repository this script is in)
#   PIP_FLAGS        extra flags for every `pip install` (the test's: --no-index --no-build-isolation)
set -euo pipefail
PY=${PYTHON:-python}
SRC=${PROJECT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
export TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
read -r -a FLAGS <<< "${PIP_FLAGS:-}"
install() { "$PY" -m pip install --no-cache-dir ${FLAGS[@]+"${FLAGS[@]}"} "$@"; }

# 1. torch first, from the CUDA index: the project's `torch>=2.6` is then satisfied and this build is kept
install "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# 2. the project (its ray requirement accepts the image's own Ray 2.60.0: pip keeps it; step 4 checks)
install "$SRC"
# 3. the reference DFlash package (exports load in it); --no-deps keeps its pins off torch and transformers
install --no-deps "dflash==0.1.0"
# 4. what the image must hold, checked in it
"$PY" - <<'PYEOF'
import os
import sys

sys.path = [p for p in sys.path if p not in ("", os.getcwd())]  # the installed copy, not the source beside it
import importlib.metadata as md

import dflash.model  # noqa: F401  (the reference's model code imports)
import ray
import torch

import dflash_ray
from packaging.requirements import Requirement   # packaging comes with Ray

# the base requirement on ray (the extras' `ray[llm]` ones carry an `extra ==` marker)
(wanted,) = [q for q in map(Requirement, md.requires("dflash-ray")) if q.name == "ray" and q.marker is None]
assert wanted.specifier.contains(ray.__version__), f"ray {ray.__version__} is not one dflash-ray accepts ({wanted})"
want_torch = os.environ["TORCH_SPEC"].partition("==")[2]
assert not want_torch or torch.__version__.split("+")[0] == want_torch, f"torch {torch.__version__} != {want_torch}"
print(f"installed: dflash-ray {md.version('dflash-ray')} ({os.path.dirname(dflash_ray.__file__)}), "
      f"ray {ray.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), dflash {md.version('dflash')}")
PYEOF
