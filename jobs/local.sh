#!/usr/bin/env bash
# The embedded default as a Ray job on a one-machine cluster without GPUs (tiny models, synthetic data).
#   scripts/ray-start.sh --head --num-cpus 4 --resources '{"target_slot": 1}'     # once; --num-cpus 4 on 2 cores on purpose
#   jobs/local.sh [overrides...]                                         # e.g. train.max_steps=20
# RAY_ADDRESS defaults to the local dashboard. Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
RAY=ray; [ -x .venv/bin/ray ] && RAY=.venv/bin/ray   # the project's Ray: no activated venv needed
# a cluster started with token auth (scripts/ray-start.sh) takes jobs that send its token: Ray sends this machine's
# only in token mode (a cluster without token auth accepts it too)
if [[ -z "${RAY_AUTH_MODE:-}" && ( -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ) ]]; then
  export RAY_AUTH_MODE=token
fi
exec "$RAY" job submit --runtime-env jobs/runtime_env.yaml -- \
  python -m dflash_ray.train cluster=local run.root="${RUN_ROOT:-$PWD/runs}" "$@"
