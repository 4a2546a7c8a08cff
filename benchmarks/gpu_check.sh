#!/usr/bin/env bash
# ONE prepared run on a GPU machine (one GPU; the image needs CUDA PyTorch, transformers, safetensors and
# pyarrow, not Ray, OmegaConf or Hydra). The parts measured on one H200 on 2026-11-29 (benchmarks/results/
# h200_2026-11-29.md: the drafter step's MFU, thinned buckets, target capture) gave way to what has not run on
# a GPU yet; every part has its own time-out (585 s in all, under 10 minutes); GPU_CHECK_ALL=1 adds the
# 2026-11-29 parts back (over 10 minutes):
#   1. the runtime's GPU-only paths without Ray (benchmarks/gpu_check.py): the step's all-reduce on NCCL,
#      the bf16 feature encoding, checkpoint write/restore on CUDA
#   2. the drafter step at the recipe's density with the plan's cut at 16,384 block tokens (the real
#      presets' model.max_block_tokens_per_batch): the shortest bucket's batch (3 x 512, 340 anchors a
#      row) and the longest's (2 x 8192, 512 a row): peak memory and MFU of each (memory flat over buckets)
#   3. the target's capture at the plan's forward sizes, 1 x 512 .. 2 x 8192 (bench_target_sizes.py): the
#      target's efficiency at the small batches the cut makes
#   4. the loss's vocab chunk (ce_chunk_rows 1024, 2048, 4096; layers not compiled, the head is not anyway)
#   5. the drafter step at Qwen3-8B's drafter shape (bf16 autocast, compiled, fused AdamW): ms/step, MFU
# Writes $OUT/gpu_check.json (all figures) beside each part's log. Where the image lacks the reference `dflash`
# package (part 2's oracle), put its wheel in .whl/ (`pip download --no-deps -d .whl dflash==0.1.0` on a
# machine with PyPI): the script installs it without a network.
# Usage (on the GPU machine):
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
  recipe=("--batch 3 --context 64 --anchors 20" "--batch 2 --context 512 --anchors 32")
  chunks=(128 256 512)
  budget=32
else
  buckets=("--batch 32 --context 512" "--batch 2 --context 8192")
  recipe=("--batch 3 --context 512 --anchors 340" "--batch 2 --context 8192 --anchors 512")
  chunks=(1024 2048 4096)
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
part runtime_paths 90 "$PY" benchmarks/gpu_check.py "${device[@]}" --out "$OUT/runtime_paths.json"
part recipe_short 90 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" ${recipe[0]} --steps 3 --warmup 1 \
  --json "$OUT/recipe_short.json"
part recipe_long 90 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" ${recipe[1]} --steps 3 --warmup 1 \
  --json "$OUT/recipe_long.json"
part target_sizes 90 "$PY" benchmarks/bench_target_sizes.py "${small[@]}" --json "$OUT/target_sizes.json"
for c in "${chunks[@]}"; do
  part "ce_chunk_$c" 35 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" --no-compile --steps 3 --warmup 1 \
    --ce-chunk-rows "$c" --json "$OUT/ce_chunk_$c.json"
done
part drafter_step 120 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" --json "$OUT/drafter_step.json"
if [ -n "${GPU_CHECK_ALL:-}" ]; then
  part bucket_smallest 100 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" ${buckets[0]} --steps 3 --warmup 1 \
    --anchors-per-batch "$budget" --json "$OUT/bucket_smallest.json"
  part bucket_largest 100 "$PY" benchmarks/bench_drafter_step.py "${small[@]}" ${buckets[1]} --steps 3 --warmup 1 \
    --anchors-per-batch "$budget" --json "$OUT/bucket_largest.json"
  part target_capture 120 "$PY" benchmarks/bench_target_capture.py "${small[@]}" --json "$OUT/target_capture.json"
fi
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
parts = ["runtime_paths", "recipe_short", "recipe_long", "target_sizes", "drafter_step", "bucket_smallest",
         "bucket_largest", "target_capture"] + sorted(p.stem for p in out.glob("ce_chunk_*.json"))
report = {p: (json.loads((out / f"{p}.json").read_text()) if (out / f"{p}.json").exists() else None) for p in parts}
for name, (a, b) in {"recipe_memory_max_over_min": ("recipe_short", "recipe_long"),
                     "bucket_memory_max_over_min": ("bucket_smallest", "bucket_largest")}.items():
    if report[a] and report[b]:
        lo, hi = sorted([report[a]["peak_memory_gib"], report[b]["peak_memory_gib"]])
        report[name] = hi / max(lo, 1e-9)
(out / "gpu_check.json").write_text(json.dumps(report, indent=2))
print(json.dumps({p: (v is not None) for p, v in report.items()}))
PYEOF
exit $status
