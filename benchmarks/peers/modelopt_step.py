"""NVIDIA Model Optimizer's DFlash training step on given features, timed: run in the peers' venv
(benchmarks/peers/setup.sh), never imported by the package. Reads the work file that
benchmarks/peers/step_loop.py writes and prints one JSON line.

Their offline path through their Python API: the target (SmolLM2, from the converted directory the work file
names) converted with `mtsp.convert(model, [("dflash", cfg)])` and `dflash_offline=True` (their conversion
drops the target's layers; the features come as `base_model_outputs["aux_hidden_states"]`), the decayed
hard-label objective (`dflash_loss_objective="decay"`, factor = gamma), as modelopt_train.offline_model
builds it for the whole job, then what their HF-Trainer recipe runs
around it: `loss.backward()`, gradient clipping, torch's AdamW, warmup + cosine (transformers' schedule).
Their HF-Trainer script is not in the wheel and their recipe asks for bf16/tf32, which `TrainingArguments`
refuses on CPUs: the loop here is plain torch, fp32, one thread.
"""
from __future__ import annotations

import json
import logging
import warnings

import torch

from harness import BlockCounter, peer_args, time_steps

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def main() -> None:
    args = peer_args()
    torch.set_num_threads(1)
    from transformers import get_cosine_schedule_with_warmup

    from modelopt_train import offline_model

    w = torch.load(args.work, weights_only=False)
    s = w["shape"]
    model = offline_model(w["target_dir"], s)
    model.train()
    blocks = BlockCounter(model)
    params = [p for p in model.parameters() if p.requires_grad]
    total = args.steps + args.warmup
    opt = torch.optim.AdamW(params, lr=s["lr"], weight_decay=s["weight_decay"])
    sched = get_cosine_schedule_with_warmup(opt, round(s["warmup_ratio"] * total), total)
    ids, mask, hidden = w["input_ids"], w["loss_mask"], w["hidden"]
    rows = s["rows"]
    def one(step):
        sl = slice(step * rows, (step + 1) * rows)
        out = model(input_ids=ids[sl], base_model_outputs={"aux_hidden_states": hidden[sl]},
                    loss_mask=mask[sl].float())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    print(json.dumps(time_steps("Model Optimizer 0.47.0", one, blocks.take, w, args,
                                trainable_parameters=sum(p.numel() for p in params))))


if __name__ == "__main__":
    main()
