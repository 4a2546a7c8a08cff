"""The DFlash drafter: a few Qwen3-style layers that fill a block of B tokens in one forward pass.

    context = hidden_norm(fc(concat of the target's tapped layers))        [S, H], shared by all layers
    block   = embed([anchor token, MASK x (B-1)])                          [B, H], the target's frozen embedding
    layers  : queries from the block; keys/values = [k/v_proj(context); k/v_proj(block)]
    logits  = norm(block) @ lm_head^T                                      the target's frozen head

Training runs up to `num_anchors` blocks per sample in one pass (mask rule in attention.py); inference
(draft_core.py, shipped with every export: `extend_context` / `draft_hidden`) runs one block against cached
context keys/values, as the reference does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash_ray.config import ModelConfig
from dflash_ray.hf_config import text_config

from .attention import training_mask
from .draft_core import DraftCore
from .loss import LossOutput, chunked_head_ce, default_gamma, mix_soft_labels, slot_weights
from .target import default_mask_token_id, default_target_layer_ids

# Qwen3 fields the drafter copies from its target (the drafter has the target's width, not its depth).
_TARGET_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
    "attention_bias", "attention_dropout", "vocab_size", "initializer_range", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
)


@dataclass(frozen=True)
class DrafterConfig:
    """What a drafter is, beyond its target's shape. None fields are answered by rule when the drafter is
    built: target_layer_ids by the reference formula, loss_gamma by the recipe's value for the block
    size, mask_token_id by the last embedding row (the runtime resolves it from the tokenizer first)."""
    num_draft_layers: int
    block_size: int
    num_anchors: int
    target_layer_ids: tuple[int, ...] | None = None
    loss_gamma: float | None = None
    mask_token_id: int | None = None
    anchors_per_batch: int | None = None   # blocks per batch (all rows), spread in proportion to each row's
                                           # valid anchors: the drafter's work per step; None = no bound
    # architecture knobs; None = the target's value. The width (hidden_size) and head_dim are always the
    # target's: fc maps into the target's width and the embedding/head are the target's own.
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None


def anchor_quota(valid: list[int], per_row: int, per_batch: int | None) -> list[int]:
    """Anchors each row trains: at most `per_row` and its valid count; when the rows' caps add up to more
    than `per_batch`, shares in proportion to the valid counts (largest remainders get the leftover), so a
    batch of many short rows and a batch of two long ones cost the drafter the same and train at the same
    anchor density."""
    caps = [min(int(v), int(per_row)) for v in valid]
    if per_batch is None or sum(caps) <= per_batch:
        return caps
    total = sum(valid)
    exact = [per_batch * v / total for v in valid]
    quota = [min(c, int(e)) for c, e in zip(caps, exact)]
    order = sorted(range(len(valid)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    left = per_batch - sum(quota)
    while left > 0:
        moved = False
        for i in order:
            if left and quota[i] < caps[i]:
                quota[i] += 1
                left -= 1
                moved = True
        if not moved:
            break
    return quota


def drafter_config(target_hf_config, num_draft_layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: list[int] | None = None, intermediate_size: int | None = None,
                   num_attention_heads: int | None = None, num_key_value_heads: int | None = None) -> Qwen3Config:
    """The drafter's Qwen3Config, carrying the DFlash fields both at top level and in `dflash_config`
    (the reference reads either: `_draft_value`).

    The target may be any HF decoder (Qwen3, Llama, Qwen3-MoE, ...): only the width fields in
    `_TARGET_FIELDS` are copied, so an MoE target's expert fields are ignored and the drafter stays a dense
    Qwen3-style model whose MLP width is the target's `intermediate_size` (Qwen3-30B-A3B: 6144, its dense
    MLP width, not the 768 of one expert) unless `intermediate_size` is given. `num_attention_heads` /
    `num_key_value_heads` replace the target's head counts; head_dim stays the target's."""
    tcfg = target_hf_config.to_dict() if hasattr(target_hf_config, "to_dict") else dict(target_hf_config)
    tcfg = text_config(tcfg)
    num_target_layers = int(tcfg["num_hidden_layers"])
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_draft_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    if min(target_layer_ids) < 0 or max(target_layer_ids) >= num_target_layers:
        raise ValueError(f"target_layer_ids {target_layer_ids} out of range for {num_target_layers} target layers")
    fields = {k: tcfg[k] for k in _TARGET_FIELDS if tcfg.get(k) is not None}
    # explicit: Qwen3Config's own default (128) would otherwise stand in for a target that derives it
    fields["head_dim"] = int(tcfg.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"])
    for name, value in (("intermediate_size", intermediate_size), ("num_attention_heads", num_attention_heads),
                        ("num_key_value_heads", num_key_value_heads)):
        if value is not None:
            if int(value) < 1:
                raise ValueError(f"drafter {name} must be >= 1, got {value}")
            fields[name] = int(value)
    if "intermediate_size" not in fields:  # else Qwen3Config's default (22016) would stand in silently
        raise ValueError("the target's config has no intermediate_size: give the drafter's")
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError(f"drafter num_attention_heads {fields['num_attention_heads']} is not a multiple of "
                         f"num_key_value_heads {fields['num_key_value_heads']}")
    dflash = {"block_size": int(block_size), "mask_token_id": int(mask_token_id),
              "target_layer_ids": target_layer_ids}
    return Qwen3Config(
        **fields,
        num_hidden_layers=int(num_draft_layers),
        use_sliding_window=False,
        architectures=["DFlashDraftModel"],
        num_target_layers=num_target_layers,
        dflash_config=dict(dflash),
        **dflash,
    )


class DFlashDrafter(DraftCore, nn.Module):
    def __init__(self, config: Qwen3Config, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 num_anchors: int = ModelConfig.num_anchors, loss_gamma: float | None = None,
                 attention_backend: str = "auto", ce_chunk_rows: int = 1024, anchors_per_batch: int | None = None):
        super().__init__()
        self._build_core(config)   # the layers, fc, norms, RoPE and the DFlash fields (draft_core.py)
        self.num_anchors = int(num_anchors)
        self.anchors_per_batch = None if anchors_per_batch is None else int(anchors_per_batch)
        self.loss_gamma = float(loss_gamma) if loss_gamma is not None else default_gamma(self.block_size)
        self.attention_backend = attention_backend
        self.ce_chunk_rows = int(ce_chunk_rows)
        # activation checkpointing: each layer keeps only its input for backward and recomputes the rest
        # (sizing/memory.py counts both ways); set by the runtime from train.recompute_layers
        self.recompute_layers = False
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")

        h = config.hidden_size
        # The target's embedding and head: frozen, non-persistent buffers, so they are not parameters
        # (the optimizer never sees them), not in state_dict (checkpoints and exports stay small), and
        # listed for DDP to skip (it would otherwise broadcast buffers on every forward).
        if embed_weight.shape[1] != h or head_weight.shape[1] != h:
            raise ValueError(f"embedding/head width {embed_weight.shape[1]}/{head_weight.shape[1]} != hidden {h}")
        self.tied = head_weight is embed_weight or (
            head_weight.shape == embed_weight.shape and head_weight.data_ptr() == embed_weight.data_ptr())
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        if not self.tied:
            self.register_buffer("lm_head_weight", head_weight.detach(), persistent=False)
        self._ddp_params_and_buffers_to_ignore = ["embed_weight", "lm_head_weight"]
        self._init_weights(config.initializer_range)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.tied else self.lm_head_weight

    def _init_weights(self, std: float):
        # As Hugging Face initialises Qwen3: normal(0, initializer_range) linears, unit norms.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    def compile_layers(self, **kwargs):
        """torch.compile each decoder layer in place (state_dict names unchanged); for the GPU, where the
        layers' norms, RoPE and flex attention fuse. Sequence length and anchor count vary between batches,
        so torch's automatic dynamic shapes are left on. A new BlockMask per step does not recompile
        (checked on the CPU, forward only). Over mixed buckets the layers build at most 6 graphs, then none
        (benchmarks/bench_recompiles.py, CPU with dynamo's eager backend: whether the input needs a gradient
        x first shape / any later shape / one row); `compiled_graphs` counts them in a run."""
        for layer in self.layers:
            layer.compile(**kwargs)
        return self

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ training
    def sample_anchors(self, loss_mask: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator):
        """Distinct anchors per sample (`anchor_quota`: up to num_anchors, and anchors_per_batch over the
        batch), sorted, where loss_mask[a] and loss_mask[a+1]
        hold, a >= 1 (the block has context) and a+1 < length. Returns (anchors [B, N], valid [B, N]);
        padding anchors are 0 and invalid. Sampling runs on the generator's device."""
        device = loss_mask.device
        lm = loss_mask.bool()
        bsz, seq = lm.shape
        pos = torch.arange(seq - 1, device=device)
        ok = lm[:, :-1] & lm[:, 1:] & (pos[None] >= 1) & (pos[None] + 1 < lengths.to(device)[:, None])
        ok = ok.to(generator.device)
        quota = anchor_quota(ok.sum(1).tolist(), self.num_anchors, self.anchors_per_batch)
        chosen = []
        for b in range(bsz):
            cand = ok[b].nonzero()[:, 0]
            if cand.numel() > quota[b]:
                pick = torch.randperm(cand.numel(), generator=generator, device=generator.device)
                cand = cand[pick[: quota[b]]].sort().values
            chosen.append(cand)
        n = max([c.numel() for c in chosen] + [1])
        anchors = torch.zeros(bsz, n, dtype=torch.long)
        valid = torch.zeros(bsz, n, dtype=torch.bool)
        for b, cand in enumerate(chosen):
            anchors[b, : cand.numel()] = cand.cpu()
            valid[b, : cand.numel()] = True
        return anchors.to(device), valid.to(device)

    def forward(self, input_ids: torch.Tensor, context: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """All blocks of all samples in one pass. input_ids [B, S], context [B, S, n*H], anchors [B, N]
        -> final-normed hidden states [B, N, block_size, H]."""
        bsz, seq = input_ids.shape
        n, bs = anchors.shape[1], self.block_size
        block_ids = torch.full((bsz, n, bs), self.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        x = self.embed(block_ids.view(bsz, n * bs))
        ctx_h = self.context_hidden(context)

        ctx_pos = torch.arange(seq, device=input_ids.device).expand(bsz, seq)
        blk_pos = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).view(bsz, n * bs)
        ctx_cos, ctx_sin = self.rotary_emb(ctx_h, ctx_pos)
        cos, sin = self.rotary_emb(x, blk_pos)
        mask = training_mask(anchors, seq, bs, self.attention_backend)
        recompute = self.recompute_layers and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x = torch.utils.checkpoint.checkpoint(layer, x, ctx_h, ctx_cos, ctx_sin, cos, sin, mask,
                                                      use_reentrant=False)
            else:
                x = layer(x, ctx_h, ctx_cos, ctx_sin, cos, sin, mask)
        return self.norm(x).view(bsz, n, bs, -1)

    def block_loss(self, hidden, input_ids, loss_mask, lengths, anchors, valid, soft_labels=None,
                   hard_weight: float = 0.0) -> LossOutput:
        """Weighted CE of slots 1..B-1 against x[a+k], supervised where the anchor is valid and every slot
        1..k is inside the sequence and supervised: inference never drafts across the end of a turn, so
        a slot after an unsupervised one (a user turn inside the block) is not trained either.

        soft_labels (distillation): (ids [B, S, K], probs [B, S, K]), the target's top-k next-token
        distribution at each position; slot k of anchor a learns the one at position a+k-1 (the target's
        prediction of x[a+k]), mixed with the hard label x[a+k] by `hard_weight` (loss.mix_soft_labels)."""
        bsz, seq = input_ids.shape
        k = torch.arange(1, self.block_size, device=input_ids.device)
        tgt = anchors[:, :, None] + k                                     # [B, N, B-1]
        tgt_c = tgt.clamp(max=seq - 1).view(bsz, -1)
        labels = input_ids.gather(1, tgt_c).view_as(tgt)
        sup = (valid[:, :, None] & (tgt < lengths.to(tgt.device)[:, None, None])
               & loss_mask.gather(1, tgt_c).view_as(tgt).bool())
        sup = sup.long().cumprod(-1).bool()                                # stop at the first gap
        w = slot_weights(self.block_size, self.loss_gamma).to(hidden.device).expand_as(tgt)

        rows = hidden[:, :, 1:, :][sup]                                    # [M, H], supervised slots only
        soft_ids = soft_probs = None
        if soft_labels is not None:
            top_ids, top_probs = soft_labels
            kk = top_ids.shape[-1]
            src = (tgt_c - 1)[:, :, None].expand(-1, -1, kk)               # the position predicting x[a+k]
            soft_ids = top_ids.gather(1, src).view(*tgt.shape, kk)[sup]
            soft_probs = top_probs.gather(1, src).view(*tgt.shape, kk)[sup]
            soft_ids, soft_probs = mix_soft_labels(soft_ids, soft_probs, labels[sup], hard_weight)
        loss_sum, correct = chunked_head_ce(rows, self.head_weight, labels[sup], w[sup], self.ce_chunk_rows,
                                            soft_ids, soft_probs)
        hit = torch.zeros_like(sup)
        hit[sup] = correct
        return LossOutput(
            loss_sum=loss_sum,
            weight_sum=w[sup].sum(),
            slot_correct=hit.sum((0, 1)),
            slot_count=sup.sum((0, 1)),
            prefix_correct=hit.long().cumprod(-1).sum((0, 1)),
            num_blocks=sup[:, :, 0].sum(),
        )

    def training_loss(self, input_ids, loss_mask, context, lengths, generator: torch.Generator,
                      soft_labels=None, hard_weight: float = 0.0) -> LossOutput:
        """One training forward: sample anchors from `generator`, run all blocks, return the loss parts.
        input_ids/loss_mask [B, S] right-padded, context [B, S, n*H], lengths [B]; soft_labels and
        hard_weight: distillation's labels (block_loss)."""
        anchors, valid = self.sample_anchors(loss_mask, lengths, generator)
        return self.loss_at_anchors(input_ids, loss_mask, context, lengths, anchors, valid, soft_labels, hard_weight)

    def loss_at_anchors(self, input_ids, loss_mask, context, lengths, anchors, valid, soft_labels=None,
                        hard_weight: float = 0.0) -> LossOutput:
        """`training_loss` at given anchors (sample_anchors' output). Every part of it is per row (attention
        inside a row, the loss a sum over rows), so rows [i:j] of a batch with rows [i:j] of the batch's
        anchors give that slice's share of the batch's sums: how a batch that does not fit is trained in
        slices with the anchors drawn for the whole batch (runtime/training/step.py)."""
        # the mask hides padded context positions, but a masked key still adds 0 x value: zero them so a
        # NaN or inf in the padding cannot reach the loss
        padded = torch.arange(input_ids.shape[1], device=context.device)[None] >= lengths.to(context.device)[:, None]
        context = context.masked_fill(padded[..., None], 0)
        hidden = self(input_ids, context, anchors)
        return self.block_loss(hidden, input_ids, loss_mask, lengths, anchors, valid, soft_labels, hard_weight)

    # ------------------------------------------------------------------ inference (one sequence)

@contextlib.contextmanager
def _seeded_rng(seed: int, device: torch.device):
    """Fork the generators that initialising on `device` draws from (the CPU's, and that one CUDA
    device's), seed them with `seed`, restore them on exit: the global RNG state is left as it was.
    (torch.manual_seed would also reseed every CUDA device, outside what fork_rng restores.)"""
    if device.type == "cuda":  # this branch has not run here (CPU-only machine)
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index], device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield


def _on_device(embed_weight: torch.Tensor, head_weight: torch.Tensor, device: torch.device):
    """The frozen embedding/head moved to `device`, a tied pair still one tensor (the drafter stores it once)."""
    tied = head_weight is embed_weight or (
        head_weight.shape == embed_weight.shape and head_weight.data_ptr() == embed_weight.data_ptr())
    embed = embed_weight.to(device)
    return embed, embed if tied else head_weight.to(device)


def build_drafter(cfg: DrafterConfig, target_hf_config, embed_weight, head_weight, seed: int | None = None,
                  attention_backend: str = "auto", device: str | torch.device | None = None) -> DFlashDrafter:
    """A fresh drafter for a target. seed: initialise under this seed without touching the global RNG.

    device: where the parameters are created and initialised (the embedding/head are moved there too);
    None = the CPU. Initialising on the GPU draws from that GPU's generator, so the same seed gives the
    same weights on the same device type (every rank of a run), not CPU weights equal to CUDA ones."""
    if not isinstance(cfg, DrafterConfig):
        raise TypeError(f"build_drafter takes a DrafterConfig, got {type(cfg).__name__}")
    device = torch.device("cpu" if device is None else device)
    embed_weight, head_weight = _on_device(embed_weight, head_weight, device)
    mask_token_id = cfg.mask_token_id
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(embed_weight.shape[0])
    config = drafter_config(target_hf_config, num_draft_layers=cfg.num_draft_layers, block_size=cfg.block_size,
                            mask_token_id=mask_token_id, target_layer_ids=cfg.target_layer_ids,
                            intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
                            num_key_value_heads=cfg.num_key_value_heads)
    kwargs = dict(num_anchors=cfg.num_anchors, loss_gamma=cfg.loss_gamma, attention_backend=attention_backend,
                  anchors_per_batch=cfg.anchors_per_batch)
    # torch.device as a context: every parameter (and the RoPE buffer) is allocated and initialised on
    # `device`, never first on the CPU (one thread under Ray: slow for ~1B parameters) and then copied.
    if seed is None:
        with device:
            return DFlashDrafter(config, embed_weight, head_weight, **kwargs)
    with _seeded_rng(seed, device), device:
        return DFlashDrafter(config, embed_weight, head_weight, **kwargs)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's counter): a recompile adds one."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
