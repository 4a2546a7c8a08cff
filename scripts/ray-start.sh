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
exec ray start "$@"
