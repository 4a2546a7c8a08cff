"""model.compute_dtype=bfloat16 on the CPU (what model=smollm2_135m trains with): the target actors' features
in bf16, the epoch end's filler rows encoded the same way (one dtype in the stream: issue 24 found fp32
fillers beside bf16 rows), the drafter under bf16 autocast; two epochs, every planned batch trained once."""
from __future__ import annotations

import math

from helpers_cluster import RUNTIME_RUN


def test_a_bf16_run_crosses_its_epoch_ends(train_run, tiny_plan_batches):
    per_step = 2 * 3                                 # RUNTIME_RUN's 2 drafter workers x grad_accum 3
    assert all(n % per_step for n in tiny_plan_batches), "an epoch ends without a filler: the test would miss it"
    spec, s = train_run("bf16", [*RUNTIME_RUN, "train.grad_accum=3", "model.compute_dtype=bfloat16"], timeout=600)
    assert spec.compute_dtype == "bfloat16"
    assert s["ledger"]["ok"] and s["epochs_finished"] == [0, 1]
    assert s["steps"] == sum(-(-n // per_step) for n in tiny_plan_batches)
    assert math.isfinite(s["final_loss"])
