#!/usr/bin/env bash
# Several 8-GPU nodes with shared storage (default split: 12 target + 4 drafter GPUs, cluster=multinode).
#   head:    scripts/ray-start.sh --head
#   workers: scripts/ray-start.sh --address=<head-ip>:6379
#   jobs/multinode.sh model.target_path=/shared/Qwen3-8B data.tokenizer=/shared/Qwen3-8B data.shards=/shared/shards \
#       train.storage_path=/shared/ray_train   # or s3://bucket/prefix
# Trainer workers are spread over the nodes and each node's target actors feed that node's trainers, so
# the target's features never cross nodes (summary.json: placement, feature_traffic; docs/clusters.md).
# Checkpoints must be on storage every node reaches (NFS or S3): a restarted worker group may land on
# another node. tests/test_multinode.py submits this script to two raylets on one machine. The ledger, metrics.jsonl, summary.json and export/ are written on the head node
# (under run.dir), by the run's coordinator actor and the driver.
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
  python -m dflash_ray.train cluster=multinode run.root="${RUN_ROOT:-$PWD/runs}" model=qwen3_8b data=sharegpt run.name="${RUN_NAME:-qwen3_8b_multinode}" "$@"
