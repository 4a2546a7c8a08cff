#!/usr/bin/env bash
# ONE prepared run for a lent GPU machine (one H200; its image has CUDA PyTorch, transformers, safetensors,
# pyarrow, but no Ray, OmegaConf or Hydra): 217 s on 2026-11-29 (benchmarks/results/), every part under its
# own time-out (560 s in all, inside one 10-minute device call); the quick runtime paths (3.) run first:
#   1. the drafter step at Qwen3-8B's drafter shape (bf16 autocast, compiled): ms/step, MFU, peak memory;
#      then the smallest and the largest bucket's batch under the anchor budget (32 x 512 and 2 x 8192
#      tokens, model.anchors_per_batch=512): peak memory of each
#   2. target feature capture at Qwen3-8B's shape vs output_hidden_states=True: tokens/s, peak memory
#   3. the runtime's GPU-only paths without Ray (benchmarks/gpu_check.py): the step's all-reduce on NCCL,
#      the bf16 feature encoding, checkpoint write/restore on CUDA
# Writes $OUT/gpu_check.json (all figures) beside each part's log. The image lacks the reference `dflash`
# (part 2's oracle): carry its wheel in .whl/ (`pip download --no-deps -d .whl dflash==0.1.0`), installed here.
# Usage (device tool):
#   bash benchmarks/gpu_check.sh            # OUT defaults to ./gpu_check_out
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # the same script at CPU-small shapes (what CI runs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import dflash" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl || exit 2
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi
small=()
if [ -n "${GPU_CHECK_CPU:-}" ]; then
  small=(--cpu-small)
  buckets=("--batch 8 --context 128" "--batch 1 --context 1024")
  budget=32
else
  buckets=("--batch 32 --context 512" "--batch 2 --context 8192")
  budget=512
fi
status=0
part() {  # part NAME SECONDS COMMAND...: run, log, remember a failure, go on
  local name=$1 secs=$2; shift 2
  echo "== $name"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc ($OUT/$name.log)"
  [ $rc -eq 0 ] || status=1
}
device=()
[ -n "${GPU_CHECK_CPU:-}" ] && device=(--device cpu)
part runtime_paths 60 "$PY" benchmarks/gpu_check.py "${device[@]}" --out "$OUT/runtime_paths.json"
part drafter_step 180 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" --json "$OUT/drafter_step.json"
part bucket_smallest 100 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" ${buckets[0]} --steps 3 --warmup 1 \
  --anchors-per-batch "$budget" --json "$OUT/bucket_smallest.json"
part bucket_largest 100 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" ${buckets[1]} --steps 3 --warmup 1 \
  --anchors-per-batch "$budget" --json "$OUT/bucket_largest.json"
part target_capture 120 "$PY" benchmarks/bench_target_capture.py "${small[@]}" --json "$OUT/target_capture.json"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
parts = ("drafter_step", "bucket_smallest", "bucket_largest", "target_capture", "runtime_paths")
report = {p: (json.loads((out / f"{p}.json").read_text()) if (out / f"{p}.json").exists() else None) for p in parts}
small, large = report["bucket_smallest"], report["bucket_largest"]
if small and large:
    lo, hi = sorted([small["peak_memory_gib"], large["peak_memory_gib"]])
    report["bucket_memory_max_over_min"] = hi / max(lo, 1e-9)
(out / "gpu_check.json").write_text(json.dumps(report, indent=2))
print(json.dumps({p: (v is not None) for p, v in report.items()}))
PYEOF
exit $status
