#!/usr/bin/env bash
# The model-dependent tests (pytest -m rounding) under the machine's own rounding and with the math libraries
# held to other instruction sets (scripts/rounding.py says how; docs/testing.md when to run it).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/python scripts/rounding.py "$@"
