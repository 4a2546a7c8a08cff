#!/usr/bin/env bash
# Set-up command 1: install into .venv (first run only) and run the main job on its embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/dflash-ray train "$@"
