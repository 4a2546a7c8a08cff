#!/usr/bin/env bash
# ONE prepared run of the whole job through Ray on a GPU machine (one GPU, e.g. an H200): at most 8 minutes
# (4 more where the image has vLLM: part 4).
#   1. Ray and the missing packages from .wheelhouse/, offline, when the image lacks Ray, OmegaConf or Hydra
#      (scripts/airgap-wheelhouse.sh builds it on a machine with PyPI; copy it beside this checkout;
#      docs/air-gapped.md)
#   2. a head node on this machine: all its CPUs, its GPU, the object store (the image's /dev/shm decides
#      where Ray puts it: the job checks and says)
#   3. benchmarks/gpu_ray_check.py: a Qwen3-8B-shaped target with random weights and seed-shaped data made
#      here, `dflash-ray train cluster=1gpu` on the head (one epoch, two stream segments, full-size
#      checkpoints), the runtime's own pieces without Ray on the same batches, the ratio; the object store's
#      own account (spills) after the job
#   4. where the image has vLLM: 240 conversations regenerated with regenerate.engine=vllm (a Ray Data LLM
#      stage on the head) and with the batched engine, tokens/s and the share of equal turns
#      (benchmarks/bench_regenerate_engine.py)
# Writes $OUT/gpu_ray_check.json, the job's log and summary, the object store's account.
# Usage (on the GPU machine; .wheelhouse/ beside the checkout when the image has no Ray):
#   bash benchmarks/gpu_ray_check.sh                 # OUT defaults to ./gpu_ray_check_out
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_ray_check.sh  # the same at tiny shapes on a CPU head (the tests)
#   GPU_RAY_CHECK_ARGS=--no-compile bash benchmarks/gpu_ray_check.sh   # a rerun without the drafter's compile
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_ray_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export PYTHONUNBUFFERED=1
t_start=$(date +%s)
if ! "$PY" -c "import ray, omegaconf, hydra" 2>/dev/null; then
  if [ ! -d .wheelhouse ]; then
    echo "no Ray in $PY and no .wheelhouse/: build it with scripts/airgap-wheelhouse.sh (docs/air-gapped.md)" >&2
    exit 2
  fi
  bash scripts/airgap-install.sh .wheelhouse > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 2; }
  echo "installed the wheelhouse in $(( $(date +%s) - t_start )) s"
fi
RAY_BIN=$(dirname "$(command -v "$PY")")/ray
[ -x "$RAY_BIN" ] || RAY_BIN=ray
temp=$(mktemp -d /tmp/dfrc.XXXX)            # short: Ray puts unix sockets under it
port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
if [ -n "${GPU_CHECK_CPU:-}" ]; then
  head=(--num-cpus 4 --resources '{"target_slot": 1}' --object-store-memory 400000000)
  small=(--cpu-small)
else
  head=(--num-gpus 1)
  small=()
fi
# --block in the background: stopping it stops this head's processes only (not another Ray on the machine)
"$RAY_BIN" start --head --block --node-ip-address=127.0.0.1 --port="$port" --temp-dir="$temp" \
  --include-dashboard=false --disable-usage-stats "${head[@]}" > "$OUT/ray_start.log" 2>&1 &
head_pid=$!
stop_head() {
  kill -TERM "$head_pid" 2>/dev/null; wait "$head_pid" 2>/dev/null   # (a background job ignores SIGINT)
  pkill -9 -f "$temp" 2>/dev/null   # whatever outlived it
}
trap stop_head EXIT
export RAY_ADDRESS=127.0.0.1:$port
for _ in $(seq 60); do
  "$RAY_BIN" status --address "$RAY_ADDRESS" > /dev/null 2>&1 && break
  kill -0 "$head_pid" 2>/dev/null || { cat "$OUT/ray_start.log"; exit 2; }
  sleep 2
done
df -h /dev/shm > "$OUT/shm.txt" 2>&1
status=0
timeout "${GPU_RAY_CHECK_SECONDS:-500}" "$PY" benchmarks/gpu_ray_check.py --out "$OUT" "${small[@]}" \
  ${GPU_RAY_CHECK_ARGS:-} || status=$?
# regeneration on vLLM as a Ray Data LLM stage beside the batched engine, where the image has vLLM
# (regenerate.engine=vllm; the figure it must show: >= 5x batched's tokens/s at >= 95% equal turns in bf16)
if [ -z "${GPU_CHECK_CPU:-}" ] && "$PY" -c "import vllm" 2>/dev/null; then
  timeout "${GPU_REGEN_SECONDS:-240}" "$PY" benchmarks/bench_regenerate_engine.py --engines batched,vllm \
    --device cuda --dtype bfloat16 --conversations 240 --json "$OUT/regenerate_vllm.json" \
    > "$OUT/regenerate_vllm.log" 2>&1 || status=$((status ? status : 3))
  tail -12 "$OUT/regenerate_vllm.log"
else
  echo "regenerate on vLLM: not run (no vLLM in $PY, or a CPU run)"
fi
"$RAY_BIN" memory --stats-only --address "$RAY_ADDRESS" > "$OUT/object_store.txt" 2>&1
grep -iE "spill|restor|plasma|object store" "$OUT/object_store.txt" | head -8
run_dir=$(ls -d "$OUT"/work/runs/ray_check 2>/dev/null)
[ -n "$run_dir" ] && cp "$run_dir"/summary.json "$OUT/summary.json" 2>/dev/null
stop_head
rm -rf "$OUT/work/target" "$OUT/work/runs/ray_check/ray_train" "$temp" 2>/dev/null   # GBs: not kept in $OUT
echo "gpu_ray_check: exit $status in $(( $(date +%s) - t_start )) s"
exit $status
