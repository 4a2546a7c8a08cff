#!/usr/bin/env bash
# Builds, on a machine with PyPI, the wheelhouse for an air-gapped GPU cluster whose image already has CUDA
# torch and some packages (transformers, pyarrow, ...) but no Ray, OmegaConf or Hydra: Ray 2.60 (trimmed: no
# Java workers, RLlib, Serve, LLM, dashboard source maps; binaries stripped) and every package the image lacks,
# as cp312 manylinux x86_64 wheels. MANIFEST.json lists each file, its size and sha256, what was trimmed and
# what the image's packages must satisfy. The project itself goes as source (this checkout); copy both to the
# cluster and run scripts/airgap-install.sh there. docs/air-gapped.md is the guide.
#   scripts/airgap-wheelhouse.sh [OUTDIR]           # default .wheelhouse (git-ignored)
# Environment:
#   WHEELHOUSE_IMAGE_PACKAGES  a `pip list --format=freeze` file from the image: the packages it has (default:
#                              a CUDA torch image's list, in scripts/wheelhouse.py)
#   WHEELHOUSE_BUDGET_MIB  the most the folder may hold, in MiB (default 0: no budget); over it: exit 2 with one line
#   DFLASH_WHEEL_CACHE     where downloads are kept and reused (default ~/.cache/dflash-ray/wheels)
#   WHEELHOUSE_SKIP        packages to leave out (default virtualenv: runtime_env pip/uv, needs a package index)
#   WHEELHOUSE_ALSO        image packages to put in the wheelhouse anyway (when the image's is too old), comma-separated
#   RESOLVE_PYTHON         a Python 3.12 whose pip resolves (markers as on the image's Python); found if not set
set -euo pipefail
IMG=${WHEELHOUSE_IMAGE_PACKAGES:-}
if [ -n "$IMG" ]; then   # a path from where the script was called
  [ -f "$IMG" ] || { echo "airgap-wheelhouse: WHEELHOUSE_IMAGE_PACKAGES=$IMG is not a file" >&2; exit 2; }
  IMG=$(cd "$(dirname "$IMG")" && pwd)/$(basename "$IMG")
fi
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
  --budget-mib "${WHEELHOUSE_BUDGET_MIB:-0}" --image-packages "$IMG" \
  --skip "${WHEELHOUSE_SKIP-virtualenv}" --also "${WHEELHOUSE_ALSO:-}"
