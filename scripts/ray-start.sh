#!/usr/bin/env bash
# `ray start` from the project's environment: the Ray processes (and every job they run) get .venv/bin
# first on PATH, so a submitted job's `python` is the project's Python. Arguments go to `ray start`:
#   scripts/ray-start.sh --head [--num-cpus 4 --resources '{"target_slot": 1}']      # the head node
#   scripts/ray-start.sh --address=<head-ip>:6379                                     # each worker node
# (each node needs the project installed: ./scripts/bootstrap.sh there, or an image with it)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
exec ray start "$@"
