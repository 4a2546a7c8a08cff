#!/usr/bin/env bash
# Set-up command 2: install into .venv (first run only) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
