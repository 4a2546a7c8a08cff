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
# The head node: the project's Grafana dashboard beside Ray's own. Ray writes its dashboards into this folder
# and points its Grafana provisioning at it (docs/monitoring.md, "The Grafana dashboard").
if [[ " $* " == *" --head "* ]]; then
  export RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR="${RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR:-$PWD/runs/grafana_dashboards}"
  mkdir -p "$RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"
  cp dashboards/grafana/*.json "$RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR/"
fi
# The object store lives in /dev/shm only when it fits there; otherwise Ray puts it in /tmp, on disk, with one
# line in its log (a container's 64 MB /dev/shm does this; Ray's default store is then 10 GB on disk). A
# Qwen3-8B run's feature blocks are ~0.67 GB each: say so here, where the fix is (the run checks again).
shm=$(df -B1 --output=size /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [[ -n "$shm" && "$shm" -lt $((10 * 1024 * 1024 * 1024)) ]]; then
  echo "WARNING: /dev/shm is $((shm / 1024 / 1024)) MiB: Ray will keep its object store on disk (/tmp); give the" \
       "container more shared memory (docker run --shm-size=64g, or the cluster's run_options) or pass" \
       "--object-store-memory below /dev/shm's size" >&2
fi
# Token authentication (Ray's): on unless RAY_AUTH_MODE says otherwise. The head uses this machine's token, made
# by Ray's own CLI when there is none (~/.ray/auth_token); every worker node, and every machine that submits
# jobs, needs that same token (copy the file, or set RAY_AUTH_TOKEN) and is then in token mode by itself.
if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
  if [[ -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]]; then
    export RAY_AUTH_MODE=token
  elif [[ " $* " == *" --head "* && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    ray get-auth-token --generate > /dev/null
    export RAY_AUTH_MODE=token
  fi
fi
exec ray start "$@"
