"""The memory model: peak memory of a drafter training step and of a target actor, from shapes alone.

No torch here: `dflash-ray plan` prints it before anything is loaded. The drafter's step holds

    weights, gradients (fp32) and AdamW's two moments          16 bytes per trainable parameter
    the target's frozen embedding and head                     vocab x hidden in the target's dtype
    the batch's context features                               context tokens x taps x hidden
    activations saved for backward, per block token per layer  4H + 6 q + 5 kv + 4I elements
                  ... per context token per layer              5 kv elements (context K and V)
    the loss's vocab-sized chunk                               ce_chunk_rows x vocab

(q = heads x head_dim, kv = kv_heads x head_dim, I = intermediate size) — counted from the tensors the
layer code keeps for backward (model/layers.py: two RMSNorms keep input and output, q/k norms and RoPE
keep three copies, the K/V concatenations, attention output and its reshaped copy, the SwiGLU's four
intermediate tensors). Those counts are elements; what an element costs at the peak (its own bytes, and the
gradient backward allocates on top) depends on the device kind, so each kind has its constants, measured:

  CPU, fp32 (eager): 4 bytes an element x BACKWARD 1.45 (benchmarks/bench_step_memory.py, a scaled
    Qwen3-8B shape, six buckets: 1.44-1.53); the CPU's SDPA also takes a dense mask, rows x queries x keys
    booleans, and makes a float copy of it (5 bytes a pair).
  CUDA, bf16 autocast, compiled layers: bytes per block-token element and per context-token element
    fitted to the H200's peaks (benchmarks/results/gpu_check_h200_2026-11-29.json: 8,192 block tokens
    with 3,072 and with 16,384 context tokens; the compiled layers keep far fewer tensors than eager code,
    1.37 bytes per counted block element against the 4.35 of 3 bytes x 1.45). Flex attention's block
    mask: no dense term. Recompute (train.recompute_layers) has not been measured on a GPU: the same
    constants are applied to what it keeps.

With activation checkpointing of the drafter layers, each layer keeps only its input, and one layer's
activations exist at a time (recomputed in backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_ray.hf_config import text_config

GIB = 1024 ** 3


@dataclass(frozen=True)
class DeviceKind:
    """What an activation element costs at a step's peak on one kind of device (saved + its gradient)."""
    name: str
    block_bytes: float       # per counted element of a block token's activations
    context_bytes: float     # per counted element of a context token's (K/V, fc, the features' masked copy)
    feature_bytes: int       # the features as they arrive
    dense_mask: bool         # the attention kernel materialises rows x queries x keys


CPU_FP32 = DeviceKind("CPU, fp32", block_bytes=4 * 1.45, context_bytes=4 * 1.45, feature_bytes=4, dense_mask=True)
CUDA_BF16 = DeviceKind("GPU, bf16 autocast, compiled layers", block_bytes=1.37, context_bytes=2.56, feature_bytes=2,
                       dense_mask=False)


def device_kind(gpu: bool) -> DeviceKind:
    return CUDA_BF16 if gpu else CPU_FP32


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    tied: bool
    experts: int = 0             # MoE: routed experts per layer (0: a dense MLP)
    expert_intermediate: int = 0
    active_experts: int = 0

    @classmethod
    def of(cls, target: dict) -> "Shape":
        t = text_config(target)
        h, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
        return cls(hidden=h, heads=heads, kv_heads=int(t.get("num_key_value_heads") or heads),
                   head_dim=int(t.get("head_dim") or h // heads), intermediate=int(t["intermediate_size"]),
                   vocab=int(t["vocab_size"]), layers=int(t["num_hidden_layers"]),
                   tied=bool(target.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
                   experts=int(t.get("num_experts") or t.get("num_local_experts") or 0),
                   expert_intermediate=int(t.get("moe_intermediate_size") or 0),
                   active_experts=int(t.get("num_experts_per_tok") or 0))

    def drafter(self, intermediate: int | None = None, heads: int | None = None, kv_heads: int | None = None):
        """The drafter's shape: dense, the target's width, with the drafter's own MLP width and heads."""
        from dataclasses import replace

        return replace(self, intermediate=intermediate or self.intermediate, heads=heads or self.heads,
                       kv_heads=kv_heads or self.kv_heads, experts=0, expert_intermediate=0, active_experts=0)

    def mlp_params(self) -> int:
        if self.experts:  # routed experts and the router
            return 3 * self.hidden * self.expert_intermediate * self.experts + self.hidden * self.experts
        return 3 * self.hidden * self.intermediate

    def mlp_activations(self) -> int:
        """Elements of one token's MLP intermediates (gate, up, their product): the active experts' for MoE."""
        return 3 * (self.expert_intermediate * self.active_experts if self.experts else self.intermediate)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """A Qwen3 decoder layer's parameters (projections, q/k norms, two RMSNorms)."""
        h = self.hidden
        return 2 * h * self.q + 2 * h * self.kv + self.mlp_params() + 2 * self.head_dim + 2 * h


def drafter_params(shape: Shape, draft_layers: int, taps: int) -> int:
    """Trainable parameters: the layers, fc (taps x H -> H), hidden_norm and norm."""
    return draft_layers * shape.layer_params() + taps * shape.hidden ** 2 + 2 * shape.hidden


def drafter_step_memory(shape: Shape, *, draft_layers: int, taps: int, block_tokens: int, context_tokens: int,
                        gpu: bool, frozen_bytes: int, recompute_layers: bool = False, mask_pairs: int = 0,
                        ce_chunk_rows: int = 1024, optimizer: bool = True) -> dict:
    """Bytes of each part of one drafter training step's peak, and their total."""
    h = shape.hidden
    kind = device_kind(gpu)
    per_block_layer = 4 * h + 6 * shape.q + 5 * shape.kv + 4 * shape.intermediate
    per_ctx_layer = 5 * shape.kv
    # outside the layers: block embedding, final norm (2H) and the loss's saved gradient rows (H);
    # context: the masked copy of the features (taps x H, as they arrive), fc's output and its norm (2H)
    block_once = 4 * h
    ctx_once = 2 * h + taps * h
    if recompute_layers:   # each layer keeps its input (block tokens x H); one layer recomputed at a time
        block_elems = block_tokens * (draft_layers * h + per_block_layer + block_once)
        ctx_elems = context_tokens * (per_ctx_layer + ctx_once)
    else:
        block_elems = block_tokens * (draft_layers * per_block_layer + block_once)
        ctx_elems = context_tokens * (draft_layers * per_ctx_layer + ctx_once)
    activations = kind.block_bytes * block_elems + kind.context_bytes * ctx_elems
    feat = kind.feature_bytes
    params = drafter_params(shape, draft_layers, taps)
    parts = {
        "weights": 4 * params,
        "gradients": 4 * params,
        "optimizer": 8 * params if optimizer else 0,
        "frozen_embed_head": shape.vocab * h * frozen_bytes * (1 if shape.tied else 2),
        "context_features": context_tokens * taps * h * feat,
        "activations": activations,
        "loss_chunk": min(ce_chunk_rows, max(block_tokens, 1)) * shape.vocab * (4 + (2 if gpu else 0)),
        "dense_mask": 5 * mask_pairs if kind.dense_mask else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def sharded_step_memory(parts: dict, shape: Shape, *, taps: int, world: int) -> dict:
    """The step's peak (drafter_step_memory's parts) under FSDP over `world` ranks (train.parallelism=fsdp):
    the fp32 weights, gradients and AdamW moments are 1/world on each rank; gathered whole at a time are the
    root's own parameters (fc: taps x H x H, kept for the step), the running decoder layer and the next one
    (prefetched), in fp32, and one layer's gradients before their reduce-scatter. Activations, features,
    the frozen embedding/head and the loss chunk are per rank as under DDP."""
    layer = 4 * shape.layer_params()
    out = dict(parts)
    for k in ("weights", "gradients", "optimizer"):
        out[k] = -(-parts[k] // world)
    out["gathered"] = 4 * taps * shape.hidden ** 2 + 2 * layer + layer
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def stage_layers(num_layers: int, stages: int, embed_share: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous layer ranges [start, stop) of decoder layers 0..num_layers-1 for `stages` processes, as
    even as whole layers allow, the first stage giving up `embed_share` of a layer per stage's worth to the
    embedding it also holds (its size in layers: vocab x H / a layer's parameters)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} stages for {num_layers} layers")
    per = (num_layers + embed_share) / stages
    bounds = [0]
    for s in range(1, stages):
        bounds.append(min(num_layers - (stages - s), max(bounds[-1] + 1, round(s * per - embed_share))))
    bounds.append(num_layers)
    return list(zip(bounds[:-1], bounds[1:]))


def target_actor_memory(shape: Shape, *, last_tap: int, taps: int, tokens: int, weight_bytes: int,
                        stages: int = 1) -> dict:
    """Bytes of a target actor's forward: the weights it loads (embedding, layers 0..last tap; no head),
    the features it returns (taps x H per token) and one layer's working set (no autograd): the hidden
    state, q/k/v, the attention output and the SwiGLU's intermediates, per token. With `stages` > 1 (a
    replica over several GPUs, model/target.py load_target_stage): the first stage's, which holds the
    embedding and gathers every tap (the others hold their layers only)."""
    h = shape.hidden
    layers = last_tap + 1
    if stages > 1:
        first = stage_layers(layers, stages, embed_share=shape.vocab * h / shape.layer_params())[0]
        layers = first[1] - first[0]
    weights = weight_bytes * (shape.vocab * h + layers * shape.layer_params())
    working = weight_bytes * tokens * (3 * h + shape.q + 2 * shape.kv + shape.q + shape.mlp_activations())
    parts = {"weights": weights, "features": weight_bytes * tokens * taps * h, "working": working}
    parts["total"] = sum(parts.values())
    return parts


def memory_report(plan, target: dict, *, draft_layers: int, layer_ids: list[int], use_gpu: bool,
                  stored_bytes: int, device_memory_gib: float, drafter_share: float, target_share: float,
                  recompute_layers: bool, drafter_sizes: dict | None = None, drafter_ranks: int = 1,
                  parallelism: str = "ddp", target_stages: int = 1) -> dict:
    """The drafter step's estimated peak for every batch of the plan (the worst one reported, and the
    spread over buckets) and the target actor's for the longest batch, against the device's memory per
    process (its share of the GPU). Text lines, figures, warnings. stored_bytes: the element size of the
    target's checkpoint (the frozen embedding/head keep it; a GPU target actor loads bf16). drafter_sizes:
    the drafter's own intermediate/heads/kv_heads where the config sets them. parallelism (ddp | fsdp | auto)
    over `drafter_ranks`: the figure of the one the run uses ("parallelism" in the result; auto is ddp when
    its step fits the drafter's share of a GPU, else fsdp), with the other beside it."""
    target_shape = Shape.of(target)
    shape = target_shape.drafter(**(drafter_sizes or {}))
    taps = len(layer_ids)
    parts = plan_drafter_parts(plan, shape, draft_layers=draft_layers, taps=taps, gpu=use_gpu,
                               frozen_bytes=stored_bytes if use_gpu else 4, recompute_layers=recompute_layers)
    peaks = np.array([p["total"] for p in parts])
    worst = int(np.argmax(peaks))
    drafter = parts[worst]
    fsdp = sharded_step_memory(drafter, shape, taps=taps, world=max(1, drafter_ranks))
    have_drafter = device_memory_gib * drafter_share * GIB
    if parallelism == "auto":
        parallelism = "fsdp" if (use_gpu and drafter_ranks > 1 and drafter["total"] > have_drafter) else "ddp"
    ddp_total = drafter["total"]
    if parallelism == "fsdp" and drafter_ranks > 1:   # every batch's peak less what sharding takes off
        peaks = peaks - ddp_total + fsdp["total"]
        drafter = fsdp
    trained, _ = plan.drafter_anchors()
    block = plan.plan_spec.block_size
    worst_of = {b: float(peaks[plan.bucket == b].max()) for b in range(len(plan.plan_spec.boundaries))
                if (plan.bucket == b).any()}
    by_bucket = list(worst_of.values())
    target_mem = target_actor_memory(target_shape, last_tap=max(layer_ids), taps=taps,
                                     tokens=int(plan.padded_tokens().max()), weight_bytes=2 if use_gpu else 4,
                                     stages=target_stages)
    where = device_kind(use_gpu).name
    g = lambda b: f"{b / GIB:,.2f} GiB" if b >= GIB / 2 else f"{b / 2 ** 20:,.1f} MiB"  # noqa: E731
    text = [f"memory model ({where}; sizing/memory.py): drafter step, worst batch (bucket {int(plan.bucket[worst])}: "
            f"{int(trained[worst])} anchors x block {block}, {int(plan.padded_tokens()[worst]):,} context tokens) "
            f"{g(drafter['total'])}",
            f"  weights+grads+AdamW {g(drafter['weights'] + drafter['gradients'] + drafter['optimizer'])}, "
            f"frozen embed/head {g(drafter['frozen_embed_head'])}, features {g(drafter['context_features'])}, "
            f"activations {g(drafter['activations'])}{' (layers checkpointed)' if recompute_layers else ''}, "
            f"loss chunk {g(drafter['loss_chunk'])}" + (f", dense mask {g(drafter['dense_mask'])}" if drafter["dense_mask"] else ""),
            f"  worst batch of each bucket, max/min: {max(by_bucket) / min(by_bucket):.2f}",
            f"  drafter parallelism: {parallelism} over {drafter_ranks} rank(s) (DDP {g(ddp_total)} a rank; FSDP "
            f"{g(fsdp['total'])}: weights+grads+AdamW 1/{max(1, drafter_ranks)}, {g(fsdp['gathered'])} gathered at a time)",
            f"  target actor{f' (first of {target_stages} stages)' if target_stages > 1 else ''} {g(target_mem['total'])}: weights {g(target_mem['weights'])}, "
            f"features {g(target_mem['features'])}, one layer's working set {g(target_mem['working'])}"]
    warnings = []
    if use_gpu:
        for name, need, share, hint in (
                ("drafter step", drafter["total"], drafter_share,
                 "lower model.max_block_tokens_per_batch or data.max_tokens_per_batch, or set train.recompute_layers=true"),
                ("target actor", target_mem["total"], target_share,
                 "lower data.max_tokens_per_batch or give it more of a GPU (cluster.target_gpus)")):
            have = device_memory_gib * share * GIB
            text.append(f"  {name}: {need / have:.0%} of its {have / GIB:,.1f} GiB "
                        f"(cluster.device_memory_gb {device_memory_gib:g} x share {share:g})")
            if need > have:
                warnings.append(f"WARNING: the {name} needs ~{g(need)}, more than its {have / GIB:,.1f} GiB: {hint}")
    return {"drafter": drafter, "parallelism": parallelism, "drafter_ddp": ddp_total, "drafter_fsdp": fsdp["total"],
            "drafter_worst_batch": worst, "drafter_bucket_max_over_min": max(by_bucket) / min(by_bucket),
            "drafter_by_bucket": worst_of,   # bytes: each bucket's worst batch (train.oom_split's report)
            "target": target_mem, "text": text + warnings, "warnings": warnings}


def plan_drafter_parts(plan, shape: Shape, *, draft_layers: int, taps: int, gpu: bool, frozen_bytes: int,
                       recompute_layers: bool) -> list[dict]:
    """drafter_step_memory of every batch of a plan: its trained anchors x block size,
    its padded context tokens, and (CPU) its dense mask, rows x queries x keys with the anchors spread
    evenly over the rows."""
    trained, _ = plan.drafter_anchors()
    rows = np.diff(plan.offsets)
    block = plan.plan_spec.block_size
    queries = block * np.ceil(trained / rows)
    pairs = rows * queries * (plan.max_len + queries)
    padded = plan.padded_tokens()
    return [drafter_step_memory(shape, draft_layers=draft_layers, taps=taps, block_tokens=int(t) * block,
                                context_tokens=int(c), gpu=gpu, frozen_bytes=frozen_bytes,
                                recompute_layers=recompute_layers, mask_pairs=int(m))
            for t, c, m in zip(trained, padded, pairs)]
