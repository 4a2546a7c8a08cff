"""NVIDIA Model Optimizer's DFlash training step on given features, timed: run in the peers' venv
(benchmarks/peers/setup.sh), never imported by the package. Reads the work file that
benchmarks/peers/step_loop.py writes and prints one JSON line.

Their offline path through their Python API: the target (SmolLM2, from the converted directory the work file
names) converted with `mtsp.convert(model, [("dflash", cfg)])` and `dflash_offline=True` (their conversion
drops the target's layers; the features come as `base_model_outputs["aux_hidden_states"]`), the decayed
hard-label objective (`dflash_loss_objective="decay"`, factor = gamma), then what their HF-Trainer recipe runs
around it: `loss.backward()`, gradient clipping, torch's AdamW, warmup + cosine (transformers' schedule).
Their HF-Trainer script is not in the wheel and their recipe asks for bf16/tf32, which `TrainingArguments`
refuses on CPUs: the loop here is plain torch, fp32, one thread.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
import warnings

import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--profile", type=int, default=0, help="then profile this many more steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import modelopt.torch.speculative as mtsp
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    w = torch.load(args.work, weights_only=False)
    s = w["shape"]
    model = AutoModelForCausalLM.from_pretrained(w["target_dir"], dtype=torch.float32)
    model.config.num_orig_hidden_layers = s["target_layers"]   # what their offline data preparation records
    arch = {"num_hidden_layers": s["draft_layers"], "hidden_size": s["hidden"],
            "intermediate_size": s["intermediate"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "target_layer_ids": list(s["taps"]),
            "_attn_implementation": "sdpa"}
    torch.manual_seed(s["seed"])
    mtsp.convert(model, [("dflash", {"dflash_offline": True, "dflash_block_size": s["block"],
                                     "dflash_num_anchors": s["anchors_per_row"],
                                     "dflash_mask_token_id": s["mask_token_id"],
                                     "dflash_loss_objective": "decay", "dflash_loss_decay_factor": s["loss_gamma"],
                                     "dflash_self_logit_distillation": False,
                                     "dflash_architecture_config": arch})])
    model.train()
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

    losses, blocks, elapsed = [], 0, 0.0
    for step in range(total):
        sl = slice(step * rows, (step + 1) * rows)
        t0 = time.perf_counter()
        loss = one(step)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            elapsed += dt
            # their anchor count: min(num_anchors, supervised positions up to seq_len - block)
            valid = (mask[sl][:, : ids.shape[1] - s["block"] + 1] > 0).sum(dim=1).clamp(max=s["anchors_per_row"])
            blocks += int(valid.sum())
            losses.append(float(loss))
    print(json.dumps({"trainer": "Model Optimizer 0.47.0", "steps": args.steps, "seconds": elapsed,
                      "block_tokens": blocks * s["block"], "context_tokens": int(args.steps * rows * ids.shape[1]),
                      "trainable_parameters": sum(p.numel() for p in params), "losses": losses,
                      "profile": _profile(one, args.profile)}))


def _profile(one, n: int):
    if not n:
        return None
    from profile_ops import profile_steps

    return profile_steps(lambda: one(0), n)


if __name__ == "__main__":
    main()
