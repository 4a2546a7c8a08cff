#!/usr/bin/env bash
# Set-up command 2: install into .venv (first run only) and run the whole test suite, on two pytest-xdist
# workers unless told otherwise (-n N, or -n 0 for one process; a module's tests stay on one worker).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
workers=(-n 2)
for arg in "$@"; do
  case "$arg" in -n|-n*|--numprocesses|--numprocesses=*|--pdb|--trace|no:xdist) workers=() ;; esac
done
exec .venv/bin/python -m pytest -q "${workers[@]}" "$@"
