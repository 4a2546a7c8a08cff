#!/usr/bin/env bash
# One node with 8 GPUs: 6 TargetForward actors (one GPU each) + 2 drafter workers (DDP, NCCL).
#   scripts/ray-start.sh --head                                   # on the GPU node
#   jobs/8gpu.sh model.target_path=/models/Qwen3-8B data.tokenizer=/models/Qwen3-8B data.shards=/data/shards [overrides...]
# The target directory and the shards must be readable on the node. Checkpoints go to
# <run.dir>/ray_train unless train.storage_path is set. Rerunning the same run.name resumes the run.
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
  python -m dflash_ray.train cluster=8gpu run.root="${RUN_ROOT:-$PWD/runs}" model=qwen3_8b data=sharegpt run.name="${RUN_NAME:-qwen3_8b}" "$@"
