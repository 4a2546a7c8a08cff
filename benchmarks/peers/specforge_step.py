"""SpecForge's DFlash training step on given features, timed: run in the peers' venv (benchmarks/peers/setup.sh),
never imported by the package. Reads the work file that benchmarks/peers/step_loop.py writes and prints one
JSON line.

Their step as their trainer runs it on one process: `OnlineDFlashModel` (specforge.algorithms.common.
dflash_family_model: anchor sampling, the noise embedding, the DFlash mask, the decayed cross-entropy over
chunked head calls) around their `DFlashDraftModel`, `loss.backward()`, then their `BF16Optimizer` (AdamW over
fp32 master copies, grad clipping, warmup + cosine). What the step loop leaves out on both sides: data loading,
the DDP/FSDP wrapper of a world of one, logging, validation, checkpoints.
"""
from __future__ import annotations

import json
import warnings

import torch
from torch import nn

from harness import BlockCounter, peer_args, time_steps

warnings.filterwarnings("ignore")


def main() -> None:
    args = peer_args()
    torch.set_num_threads(1)
    from transformers import Qwen3Config

    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.optimizer import BF16Optimizer

    w = torch.load(args.work, weights_only=False)
    s = w["shape"]
    layers = s["draft_layers"]
    config = Qwen3Config(
        hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=layers,
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        vocab_size=s["vocab"], rms_norm_eps=s["rms_norm_eps"], rope_theta=s["rope_theta"],
        max_position_embeddings=s["max_positions"], attention_bias=False, tie_word_embeddings=False,
        layer_types=["full_attention"] * layers, use_sliding_window=False)
    config.block_size = s["block"]
    config.num_target_layers = s["target_layers"]
    # their layer id k reads transformers' hidden_states[k + 1]: the features are given, so only the count
    # (the fc's input width) matters here
    config.dflash_config = {"target_layer_ids": list(s["taps"]), "mask_token_id": s["mask_token_id"]}
    config._attn_implementation = "sdpa"
    torch.manual_seed(s["seed"])
    draft = DFlashDraftModel(config).float()
    embed = nn.Embedding(s["vocab"], s["hidden"]).requires_grad_(False)
    embed.weight.data.copy_(w["embed"])
    head = nn.Linear(s["hidden"], s["vocab"], bias=False).requires_grad_(False)
    head.weight.data.copy_(w["head"])
    model = OnlineDFlashModel(draft, head, embed, mask_token_id=s["mask_token_id"], block_size=s["block"],
                              attention_backend="sdpa", num_anchors=s["anchors_per_row"],
                              loss_decay_gamma=s["loss_gamma"], objective_chunk_blocks=args.objective_chunk_blocks)
    blocks = BlockCounter(model)
    total = args.steps + args.warmup
    opt = BF16Optimizer(draft, lr=s["lr"], weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"],
                        warmup_ratio=s["warmup_ratio"], lr_scheduler="cosine", total_steps=total)
    ids, mask, hidden = w["input_ids"], w["loss_mask"], w["hidden"]
    rows = s["rows"]
    def one(step):
        sl = slice(step * rows, (step + 1) * rows)
        loss, _, _ = model(input_ids=ids[sl], hidden_states=hidden[sl], loss_mask=mask[sl].float())
        loss.backward()
        opt.step()
        return loss

    name = "SpecForge 0.2.0" + ("" if args.objective_chunk_blocks else " (objective_chunk_blocks=0)")
    print(json.dumps(time_steps(name, one, blocks.take, w, args, objective_chunk_blocks=args.objective_chunk_blocks)))


if __name__ == "__main__":
    main()
