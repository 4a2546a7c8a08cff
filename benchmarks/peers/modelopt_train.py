"""NVIDIA Model Optimizer's DFlash drafter trained for whole epochs from a feature dump, then exported by its
own exporter: run in the peers' venv (benchmarks/peers/setup.sh) by benchmarks/peers/whole_job.py, never
imported by the package. Prints one JSON line.

    .peers-venv/bin/python benchmarks/peers/modelopt_train.py --work WORK.json

The work file names the dump (SpecForge's offline format, written by whole_job.py's adapter: one `torch.save`
file a sample with input_ids, loss_mask and hidden_states at the taps), the target's directory, the shape
and knobs (step_loop.preset_shape), epochs, rows a step and the export directory.

Their offline path through their Python API, as modelopt_step.py times it: `mtsp.convert(model,
[("dflash", cfg)])` with `dflash_offline=True`, the decayed hard-label objective, then what their HF-Trainer
recipe runs around it (their script is not in the wheel; `TrainingArguments` refuses their bf16/tf32 on
CPUs): backward, clipping, torch's AdamW, transformers' warmup + cosine, the samples of each epoch in the
order of the HF Trainer's `group_by_length=True` (its LengthGroupedSampler: shuffled, seeded, cut into
megabatches of 50 steps, each sorted by length, the longest first) and cut into steps of `rows` rows,
right-padded to the longest rounded up to a whole block (padding lies after every anchor's context, and its
loss mask is 0). Their trained blocks are counted from their own sampler's keep mask (harness.BlockCounter). Then `model.get_exporter().export(dir)`: model.safetensors and config.json
in the z-lab layout, which the reference package loads.

Their conversion takes the draft's RoPE base from the target's config attribute `rope_theta`, which
transformers 5 keeps in `rope_parameters` instead: it would train at Qwen3's default base while their
exporter writes the target's. The target's base is passed explicitly here, so training and export agree
(the same fix the step loop's SpecForge drafter needed); so is the target's RMSNorm epsilon (their Qwen3
config's 1e-6 would stay, where this project's drafter takes the target's 1e-5).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BlockCounter  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def load_dump(features: Path) -> list[dict]:
    return [torch.load(f, weights_only=True) for f in sorted(features.glob("*.ckpt"))]


def padded(samples: list[dict], multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded to the longest row, rounded up to a whole block (their forward requires it)."""
    n = -(-max(len(s["input_ids"]) for s in samples) // multiple) * multiple
    width = samples[0]["hidden_states"].shape[-1]
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    mask = torch.zeros(len(samples), n)
    hidden = torch.zeros(len(samples), n, width)
    for r, s in enumerate(samples):
        k = len(s["input_ids"])
        ids[r, :k], mask[r, :k], hidden[r, :k] = s["input_ids"], s["loss_mask"].float(), s["hidden_states"]
    return ids, mask, hidden


def length_grouped(lengths: list[int], rows: int, rng: random.Random, megabatch_steps: int = 50) -> list[int]:
    """The order of transformers' LengthGroupedSampler (Trainer's group_by_length): a shuffled permutation cut into
    megabatches of `megabatch_steps` x `rows` samples, each sorted by length, longest first."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    size = megabatch_steps * rows
    return [i for m in range(0, len(order), size) for i in sorted(order[m:m + size], key=lambda k: -lengths[k])]


def offline_model(target_dir: str, s: dict):
    """The target converted to their offline DFlash model (the target's layers dropped; features come as
    `base_model_outputs`): the shape, taps and loss of `s` (step_loop.preset_shape), the decayed hard labels,
    the target's RoPE base and RMSNorm epsilon passed explicitly (see the module's doc), and checked."""
    import modelopt.torch.speculative as mtsp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.config.num_orig_hidden_layers = s["target_layers"]   # what their offline data preparation records
    arch = {"num_hidden_layers": s["draft_layers"], "hidden_size": s["hidden"],
            "intermediate_size": s["intermediate"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "target_layer_ids": list(s["taps"]),
            "rope_theta": s["rope_theta"], "rms_norm_eps": s["rms_norm_eps"], "_attn_implementation": "sdpa"}
    torch.manual_seed(s["seed"])
    mtsp.convert(model, [("dflash", {"dflash_offline": True, "dflash_block_size": s["block"],
                                     "dflash_num_anchors": s["anchors_per_row"],
                                     "dflash_mask_token_id": s["mask_token_id"],
                                     "dflash_loss_objective": "decay", "dflash_loss_decay_factor": s["loss_gamma"],
                                     "dflash_self_logit_distillation": False,
                                     "dflash_architecture_config": arch})])
    draft_rope = float(model.dflash_config.rope_parameters["rope_theta"])
    assert draft_rope == s["rope_theta"], f"the draft trains at RoPE base {draft_rope}, the target's is {s['rope_theta']}"
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    work = json.loads(Path(ap.parse_args().work).read_text())
    s = work["shape"]
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import get_cosine_schedule_with_warmup

    t0 = time.monotonic()
    samples = load_dump(Path(work["features"]))
    load_s = time.monotonic() - t0
    model = offline_model(s["target_dir"], s)
    model.train()
    blocks = BlockCounter(model)
    params = [p for p in model.parameters() if p.requires_grad]
    rows, epochs = work["rows_per_step"], work["epochs"]
    total = math.ceil(len(samples) / rows) * epochs
    opt = torch.optim.AdamW(params, lr=s["lr"], weight_decay=s["weight_decay"])
    sched = get_cosine_schedule_with_warmup(opt, round(s["warmup_ratio"] * total), total)
    rng = random.Random(s["seed"])
    lengths = [len(x["input_ids"]) for x in samples]
    steps, context_tokens, loss = 0, 0, float("nan")
    for _ in range(epochs):
        order = length_grouped(lengths, rows, rng)
        for i in range(0, len(order), rows):
            ids, mask, hidden = padded([samples[k] for k in order[i:i + rows]], s["block"])
            out = model(input_ids=ids, base_model_outputs={"aux_hidden_states": hidden}, loss_mask=mask)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, s["grad_clip"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            context_tokens += sum(len(samples[k]["input_ids"]) for k in order[i:i + rows])
            steps, loss = steps + 1, float(out.loss)
    train_s = time.monotonic() - t0
    t1 = time.monotonic()
    model.get_exporter().export(work["export"], dtype=torch.float32)
    print(json.dumps({"steps": steps, "block_tokens": blocks.total * s["block"], "context_tokens": context_tokens,
                      "final_loss": loss, "load_seconds": load_s, "train_seconds": train_s,
                      "export_seconds": time.monotonic() - t1}))


if __name__ == "__main__":
    main()
