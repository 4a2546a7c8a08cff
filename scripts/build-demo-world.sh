#!/usr/bin/env bash
# Rebuild the demo world the package ships (dflash_ray/demo/shipped/: the tokenizer and the trained demo
# target), then run the embedded default on it with an empty machine cache and record the world's
# fingerprint (regenerated corpus, plan, steps, greedy margins) in world.json. Run it after changing what the
# target is made from (the corpus generator, the target's config or training, the chat template); commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
work=$(mktemp -d /tmp/dflash-demo-world-XXXX)
.venv/bin/python -m dflash_ray.demo.shipped
DFLASH_RAY_CACHE="$work/cache" RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} \
  .venv/bin/dflash-ray train run.root="$work/runs" run.name=default
.venv/bin/python -m dflash_ray.demo.shipped --fingerprint "$work/runs/default"
