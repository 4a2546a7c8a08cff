"""The capacity model: how to lay N GPUs out between target forwards and drafter training.

Each side in its own unit. The target computes context tokens: T context tokens/s per GPU. The drafter
trains anchor blocks: D block tokens/s per GPU (anchors x block size; its cost is in the block tokens, the
context only feeds K/V). The plan says how many block tokens the drafter trains per context token (rho,
the density: the recipe's every-valid-anchor gives ~3.9 on seed-shaped data, 512 anchors a 16K batch
0.56), so a drafter GPU keeps up with D / rho context tokens/s. The order interleaves every bucket into
every part of the epoch (and the flight window buffers batches), so the epoch's mean rho is what a
pipeline sees; the plan prints it per bucket.

Two layouts, both reported:
  split      t target + d = N - t drafter GPUs stream min(t*T, d*D/rho) context tokens/s; every integer
             split is tried.
  colocated  every GPU runs a target actor and a drafter worker (fractional shares: cluster.target_gpus
             + cluster.drafter_gpus <= 1) and spends 1/T + rho/D seconds per context token on both: N /
             (1/T + rho/D) context tokens/s. No split rounds a GPU away and no feature leaves its GPU's
             node; what it does not count is the two processes' interference on one GPU (not measured).

Rates come from, in order: cluster.target_tokens_per_gpu / cluster.drafter_block_tokens_per_gpu when set;
else the `measured` block of <run.dir>/summary.json when that run trained the same model on the same
kind of device; else the seed run's figures (8 GPUs, 6 target + 2 drafter, 25.3K context tokens/s at the
recipe's density, ~3.91 block tokens per context token on its seed-shaped data: D = 49.5K block tokens/s,
assuming its drafters were the bound; T = 25.3K / 6, a lower bound), labelled as such.
`dflash-ray plan cluster=...` prints the report.
"""
from __future__ import annotations

import json

from dflash_ray.run_layout import RunLayout

SEED_RUN = {"gpus": 8, "target": 6, "drafter": 2, "tokens_per_second": 25300.0, "block_tokens_per_token": 3.91}


def best_split(n_gpus: int, target_rate: float, drafter_rate: float) -> dict:
    """All splits t + d = n_gpus (t, d >= 1) with their throughput, both rates in context tokens/s per
    GPU (the drafter's at the plan's density); the best first."""
    if n_gpus < 2:
        raise ValueError("need at least 2 devices (one target, one drafter)")
    splits = []
    for t in range(1, n_gpus):
        d = n_gpus - t
        tput = min(t * target_rate, d * drafter_rate)
        splits.append({"target": t, "drafter": d, "tokens_per_second": tput,
                       "bottleneck": ("balanced" if abs(t * target_rate - d * drafter_rate) <= 0.01 * tput
                                      else "target" if t * target_rate < d * drafter_rate else "drafter"),
                       "target_utilisation": tput / (t * target_rate),
                       "drafter_utilisation": tput / (d * drafter_rate)})
    best = max(splits, key=lambda s: (s["tokens_per_second"], -s["target"]))
    return {"best": best, "splits": splits}


def colocated(n_gpus: int, target_rate: float, drafter_rate: float) -> dict:
    """Every GPU runs both sides (rates in context tokens/s per GPU, as best_split): the GPU's time per
    context token is the sum of both sides', and the target's share of it is what it gets."""
    per_gpu = 1.0 / (1.0 / target_rate + 1.0 / drafter_rate)
    share = per_gpu / target_rate
    return {"gpus": n_gpus, "tokens_per_second": n_gpus * per_gpu, "target_share": share,
            "drafter_share": 1.0 - share}


def _rates(cfg) -> tuple[float, float, str]:
    """(target context tokens/s per GPU, drafter block tokens/s per GPU, where they came from)."""
    c = cfg.cluster
    t, d = c.target_tokens_per_gpu, c.drafter_block_tokens_per_gpu
    if t is not None and d is not None:
        return t, d, "config (cluster.target_tokens_per_gpu, cluster.drafter_block_tokens_per_gpu)"
    summary = RunLayout(cfg.run.dir).summary
    if summary.exists():
        try:
            s = json.loads(summary.read_text())
            m = s.get("measured") or {}
            same_model = (s.get("model", {}).get("num_draft_layers") == cfg.model.num_draft_layers
                          and bool(s.get("use_gpu")) == c.use_gpu)
            mt, md = m.get("target_tokens_per_second_per_actor"), m.get("drafter_block_tokens_per_second_per_worker")
            if same_model and mt and md:
                return (float(t if t is not None else mt), float(d if d is not None else md),
                        f"measured by the run in {summary.parent}")
        except (OSError, ValueError):
            pass
    sr = SEED_RUN
    t_scale, d_scale, scaled = _scale_from_seed(cfg)
    return (t if t is not None else sr["tokens_per_second"] / sr["target"] * t_scale,
            d if d is not None else sr["tokens_per_second"] * sr["block_tokens_per_token"] / sr["drafter"] * d_scale,
            "seed-run estimate: 25.3K context tokens/s on 6 target + 2 drafter GPUs at ~3.91 block tokens per "
            "context token, drafter-bound" + scaled)


# the seed run's target (Qwen3-8B) and its 5-layer drafter: what the seed run's rates were measured on
SEED_TARGET = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}


def _active_layer_params(shape) -> int:
    """A decoder layer's parameters a token passes through (attention, the active experts' MLP)."""
    h = shape.hidden
    return 2 * h * shape.q + 2 * h * shape.kv + shape.mlp_activations() * h


def _scale_from_seed(cfg) -> tuple[float, float, str]:
    """(target, drafter) rate factors for another model than the seed run's: by the parameters a token passes
    through (matmul FLOPs), the target's decoder layers and the drafter's layers and fc, relative to Qwen3-8B
    and its 5-layer drafter; (1, 1, "") for that shape or an unknown one."""
    from dflash_ray.data.plan import target_fields
    from dflash_ray.sizing.memory import Shape

    target = target_fields(cfg)
    try:
        here, seed = Shape.of(target or {}), Shape.of(SEED_TARGET)
    except (KeyError, TypeError, ValueError):   # a shape without the fields (e.g. no vocab_size yet)
        return 1.0, 1.0, ""
    m = cfg.model
    draft = here.drafter(m.drafter_intermediate_size, m.drafter_num_attention_heads, m.drafter_num_key_value_heads)
    t_scale = (seed.layers * _active_layer_params(seed)) / (here.layers * _active_layer_params(here))
    d_scale = ((5 * _active_layer_params(seed.drafter()) + 5 * seed.hidden ** 2)
               / (m.num_draft_layers * _active_layer_params(draft) + 5 * here.hidden ** 2))
    if abs(t_scale - 1) < 1e-3 and abs(d_scale - 1) < 1e-3:
        return 1.0, 1.0, ""
    return t_scale, d_scale, (f"; scaled to this target by the parameters a token passes through (target x"
                              f"{t_scale:.3f}, drafter x{d_scale:.3f} of Qwen3-8B's)")


def node_split(nodes: int, gpus_per_node: int, target_workers: int, drafter_workers: int,
               target_rate: float, drafter_rate: float, feature_bytes_per_token: float | None) -> dict:
    """The placement the runtime chooses on `nodes` equal nodes (pipeline.DatasetFactory.splits): trainer
    workers spread evenly (Ray Train's SPREAD), target actors shared out in proportion to each node's
    trainers within the node's free GPUs; each node's stream runs at min(t*T, d*D). Cross-node feature
    traffic: none with node-local streams; for comparison, one stream over all nodes would carry the
    features of every batch whose target actor is on another node than its trainer (1 - sum_i
    d_i/D * t_i/T of them, a row's actor being any of the T with equal chance)."""
    d = [drafter_workers // nodes + (1 if i < drafter_workers % nodes else 0) for i in range(nodes)]
    t = [min(max(1, round(target_workers * di / drafter_workers)) if di else 0, gpus_per_node - di) for di in d]
    per_node = [{"node": i, "drafter": di, "target": ti, "idle_gpus": gpus_per_node - di - ti,
                 "tokens_per_second": min(ti * target_rate, di * drafter_rate)} for i, (di, ti) in enumerate(zip(d, t))]
    total = sum(n["tokens_per_second"] for n in per_node)
    local = sum(di / drafter_workers * ti / max(sum(t), 1) for di, ti in zip(d, t))
    one_stream = min(sum(t) * target_rate, drafter_workers * drafter_rate)
    fb = feature_bytes_per_token
    return {"nodes": per_node, "tokens_per_second": total, "cross_node_bytes_per_second": 0.0,
            "one_stream_cross_node_fraction": 1 - local,
            "one_stream_cross_node_bytes_per_second": (1 - local) * one_stream * fb if fb else None,
            "feature_bytes_per_token": fb}


def capacity_report(cfg, plan_summary: dict, feature_bytes_per_token: float | None = None,
                    colocated_fits: bool | None = None) -> dict:
    """The split and colocated layouts' throughput for the cluster, and the best. colocated_fits: whether
    the memory model says a target actor and a drafter worker fit half a GPU each (False: colocated is shown
    but never the best; None: unknown, not checked)."""
    c = cfg.cluster
    k = int(c.get("target_gpus_per_replica", 1) or 1)   # GPUs a target replica spans (its layers split over them)
    gpus = c.target_workers * k * (c.target_gpus if c.use_gpu else 1) + c.drafter_workers * (c.drafter_gpus if c.use_gpu else 1)
    n = max(1, round(gpus))
    shared = c.use_gpu and (c.target_gpus < 1 or c.drafter_gpus < 1)   # processes sharing GPUs: colocated
    unit = ("GPU" if n == 1 else "GPUs") if c.use_gpu else "devices (CPU actors)"
    t_rate, block_rate, source = _rates(cfg)
    # a replica's stages run one after the other on one batch at a time (model/target.py replica_features):
    # it forwards at one GPU's rate on k GPUs, 1/k a GPU
    t_rate = t_rate / k
    rho = plan_summary.get("block_tokens_per_token") or 1.0
    d_rate = block_rate / rho                     # the drafter's context tokens/s per GPU at this density
    together = colocated(n, t_rate, d_rate)
    splits = best_split(n, t_rate, d_rate) if n >= 2 else None   # one GPU: colocated only
    best = splits["best"] if splits else None
    if shared:
        configured = {"layout": "colocated", "tokens_per_second": together["tokens_per_second"]}
    elif splits and c.target_workers + c.drafter_workers == n:
        configured = {"layout": "split", **next(s for s in splits["splits"] if s["target"] == c.target_workers)}
    else:
        configured = None
    tokens = plan_summary.get("tokens") or 0
    split_tps = best["tokens_per_second"] if best else 0.0
    winner = "colocated" if together["tokens_per_second"] > split_tps and colocated_fits is not False else "split"
    top = together["tokens_per_second"] if winner == "colocated" else split_tps
    cap = {"devices": n, "target_tokens_per_gpu": t_rate, "drafter_block_tokens_per_gpu": block_rate,
           "drafter_tokens_per_gpu": d_rate, "block_tokens_per_token": rho, "source": source,
           "configured": configured, "best": best, "colocated": together, "best_layout": winner,
           "tokens_per_second": top, "block_tokens_per_second": top * rho,
           "epoch_hours_configured": tokens / configured["tokens_per_second"] / 3600 if tokens and configured else None,
           "epoch_hours_best": tokens / top / 3600 if tokens else None}
    text = [
        f"capacity model ({cfg.cluster.name}: {n} {unit}); rates from {source}",
        f"  target {t_rate:,.0f} context tokens/s per device"
        f"{f' (replicas of {k} GPUs, their stages in turn: 1/{k} of a GPU each)' if k > 1 else ''}; "
        f"drafter {block_rate:,.0f} block tokens/s per device "
        f"= {d_rate:,.0f} context tokens/s at this plan's {rho:.2f} block tokens per context token",
    ]
    if configured and configured["layout"] == "split":
        text.append(f"  configured split {configured['target']} target + {configured['drafter']} drafter: "
                    f"{_both(configured['tokens_per_second'], rho)} ({_bound(configured)})")
    elif configured:
        text.append(f"  configured: colocated (GPU shares cluster.target_gpus {c.target_gpus:g}, cluster.drafter_gpus "
                    f"{c.drafter_gpus:g}): {_both(configured['tokens_per_second'], rho)}")
    if best:
        text.append(f"  best split       {best['target']} target + {best['drafter']} drafter: "
                    f"{_both(best['tokens_per_second'], rho)} ({_bound(best)})")
    text += [f"  colocated        {n} x (target + drafter), GPU time {together['target_share']:.0%} target / "
             f"{together['drafter_share']:.0%} drafter: {_both(together['tokens_per_second'], rho)} "
             f"(cluster.target_workers={n} cluster.drafter_workers={n} cluster.target_gpus=0.5 "
             f"cluster.drafter_gpus=0.5; the two processes' interference on a GPU is not modelled"
             f"{'; DOES NOT FIT: the memory model puts a side over half a GPU' if colocated_fits is False else ''})",
             f"  best layout: {winner}, {_both(top, rho)}"]
    if tokens:
        text.append(f"  one epoch ({tokens:,} context tokens): "
                    + (f"{_duration(cap['epoch_hours_configured'])} configured, " if configured else "")
                    + f"{_duration(cap['epoch_hours_best'])} at the best layout")
    nodes = c.get("nodes", 1)   # (a stand-in cluster without the key: one node)
    if nodes > 1 and configured and configured["layout"] == "split":
        per = n // nodes
        split = node_split(nodes, per, c.target_workers, c.drafter_workers, t_rate, d_rate,
                           feature_bytes_per_token)
        cap["per_node"] = split
        text.append(f"  per node ({nodes} nodes x {per} {unit.split(' ')[0]}; trainers spread, each node's target "
                    f"actors feed its own trainers):")
        for nd in split["nodes"]:
            idle = f" + {nd['idle_gpus']} idle" if nd["idle_gpus"] else ""
            text.append(f"    node {nd['node']}: {nd['target']} target + {nd['drafter']} drafter{idle}: "
                        f"{nd['tokens_per_second']:,.0f} context tokens/s")
        fb = split["feature_bytes_per_token"]
        one = (f"{split['one_stream_cross_node_bytes_per_second'] / 1e9:,.2f} GB/s" if fb else "unknown bytes")
        text.append(f"  cross-node feature traffic: 0 B/s with node-local streams ({split['tokens_per_second']:,.0f} "
                    f"context tokens/s in all); one stream over all nodes would move "
                    f"{100 * split['one_stream_cross_node_fraction']:.0f}% of the batches' features across nodes "
                    f"({one}{f' at {fb / 1e3:,.1f} KB per token' if fb else ''})")
    return {"capacity": cap, "text": text}


def _both(context_tps: float, rho: float) -> str:
    return f"{context_tps:,.0f} context tokens/s = {context_tps * rho:,.0f} block tokens/s"


def _duration(hours: float) -> str:
    s = hours * 3600
    return f"{hours:.1f} h" if s >= 3600 else (f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s")


def _bound(split: dict) -> str:
    return "balanced" if split["bottleneck"] == "balanced" else f"{split['bottleneck']}-bound"
