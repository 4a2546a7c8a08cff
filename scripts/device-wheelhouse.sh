#!/usr/bin/env bash
# Builds the wheelhouse for a GPU machine with no network (the device tool's, whose image has CUDA torch,
# transformers, pyarrow, ... but no Ray, OmegaConf or Hydra): Ray 2.60 (trimmed: no jars, RLlib, Serve,
# LLM, dashboard source maps; binaries stripped) and every package the image lacks, as cp312 manylinux
# x86_64 wheels; MANIFEST.json lists each file, its size and sha256, what was trimmed and what the image's
# packages must satisfy. The project itself travels as source (the working tree). scripts/device-install.sh
# installs both there; docs/gpu-machine.md has the figures.
#   scripts/device-wheelhouse.sh [OUTDIR]           # default .wheelhouse (git-ignored); name it in `carry`
# Environment:
#   WHEELHOUSE_BUDGET_MIB  the most the folder may hold (default 56: with the repo, under the tool's 64 MiB);
#                          over it: exit 2 with one line
#   DFLASH_WHEEL_CACHE     where downloads are kept and reused (default ~/.cache/dflash-ray/wheels)
#   WHEELHOUSE_SKIP        packages not to carry (default virtualenv: runtime_env pip/uv, needs an index)
#   WHEELHOUSE_ALSO        device-image packages to carry anyway (when the image's is too old), comma-separated
#   RESOLVE_PYTHON         a Python 3.12 whose pip resolves (markers as on the device); found if not set
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.wheelhouse}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
RPY=${RESOLVE_PYTHON:-}
if [ -z "$RPY" ]; then
  for c in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      RPY=$c; break
    fi
  done
fi
RPY=${RPY:-$PY}
exec "$PY" scripts/wheelhouse.py build --out "$OUT" --python "$RPY" \
  --cache "${DFLASH_WHEEL_CACHE:-$HOME/.cache/dflash-ray/wheels}" \
  --budget-mib "${WHEELHOUSE_BUDGET_MIB:-56}" \
  --skip "${WHEELHOUSE_SKIP-virtualenv}" --also "${WHEELHOUSE_ALSO:-}"
