#!/usr/bin/env bash
# The peers' venv (.peers-venv/, outside the product's dependencies): the published DFlash trainers, to be
# measured beside this project's on the same work. Nothing here is imported by the package.
#   SpecForge 0.2.0 (PyPI specforge) and NVIDIA Model Optimizer 0.47.0 (PyPI nvidia-modelopt), --no-deps
#   (SpecForge pins torch 2.11 and SGLang; on a CPU machine its offline DFlash path needs neither), with
#   torch pinned to the CPU wheel this project uses and transformers at SpecForge's own pin.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
VENV=.peers-venv
stamp=$VENV/.peers-installed
want=$(sha256sum benchmarks/peers/setup.sh | cut -c1-16)
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  $VENV/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  $VENV/bin/python -m pip install -q "torch==2.13.0"
  $VENV/bin/python -m pip install -q "transformers==5.8.1" accelerate safetensors numpy pyyaml pydantic \
    psutil tqdm datasets huggingface-hub typing-extensions requests ninja nvidia-ml-py packaging "setuptools>=80" \
    omegaconf "pulp<4.0" regex rich scipy
  $VENV/bin/python -m pip install -q --no-deps "specforge==0.2.0" "nvidia-modelopt==0.47.0"
  echo "$want" > "$stamp"
fi
$VENV/bin/python -c "import specforge, modelopt, torch, transformers; print('peers venv:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'specforge 0.2.0, modelopt', modelopt.__version__)"
