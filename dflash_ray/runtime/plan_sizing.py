"""The sizing models applied to a config and its plan (the driver's and `dflash-ray plan`'s): the memory
per process (sizing/memory.py), the object store a node's stream needs (sizing/object_store.py), and the
drafter's parallelism that `train.parallelism=auto` resolves to. Reads the target's shape from the config
(or its config.json); no Ray."""
from __future__ import annotations

from dflash_ray.config import compute_dtype


def feature_bytes_per_token(cfg) -> float | None:
    """Bytes of the target's features per token as they travel (hidden x tapped layers x the compute
    dtype's bytes); None when the target's shape is unknown."""
    shape = _feature_shape(cfg)
    if shape is None:
        return None
    hidden, taps = shape
    return float(hidden) * taps * (2 if compute_dtype(cfg) == "bfloat16" else 4)


def _feature_shape(cfg) -> tuple[int, int] | None:
    """(the target's width, the tapped layers), None when the target's shape is unknown."""
    from dflash_ray.data.plan import target_fields
    from dflash_ray.model.target import default_target_layer_ids
    from dflash_ray.hf_config import text_config

    text = text_config(target_fields(cfg) or {})
    if "hidden_size" not in text:
        return None
    m = cfg.model
    taps = len(m.target_layer_ids or default_target_layer_ids(int(text["num_hidden_layers"]), m.num_draft_layers))
    return int(text["hidden_size"]), taps


def plan_feature_cache(cfg, plan) -> dict | None:
    """What train.features would do with this plan (runtime/stream/feature_cache.py): the cache's size per node
    (the plan's tokens x taps x hidden x bytes), the mode and why; None when the target's shape is unknown."""
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.stream.feature_cache import cache_bytes, cache_disk, choose_features

    shape = _feature_shape(cfg)
    if shape is None:
        return None
    t, dtype, tokens = cfg.train, compute_dtype(cfg), int(plan.summary()["tokens"])
    need = cache_bytes(tokens, shape[1], shape[0], dtype, t.distill_top_k if t.loss == "distill" else 0)
    _, free = cache_disk(t.feature_cache_dir)
    try:
        mode, why = choose_features(t.features, t.epochs, need, t.feature_cache_gb, free)
    except UserError as e:
        mode, why = "refused", str(e)
    return {"bytes": need, "mode": mode, "why": why,
            "text": f"feature cache: {need / 2**30:,.2f} GiB a node at most ({tokens:,} tokens x {shape[1]} taps x "
                    f"{shape[0]} x {2 if dtype == 'bfloat16' else 4} bytes, {dtype}); train.features={t.features} "
                    f"-> {mode} ({why})"}


def plan_object_store(cfg, plan) -> dict | None:
    """The object store one node's stream needs for this plan (sizing/object_store.py; the run checks the
    nodes' stores against it at its start), from the largest batch's bytes through the stream; None when
    the target's shape is unknown."""
    from dflash_ray.sizing.object_store import rows_for_block, stream_store_need

    per_token = feature_bytes_per_token(cfg)
    if not per_token:
        return None
    c = cfg.cluster
    largest = float(plan.padded_tokens().max()) * (per_token + 5)   # features, the id (int32), the mask byte
    per_block = rows_for_block(largest, c.stream_block_mb)
    need = stream_store_need(per_block * largest, per_block, c.max_batches_in_flight, c.drafter_workers)
    gib = need["bytes"] / 2**30
    return {**need, "text": f"object store: the stream needs ~{gib:,.2f} GiB a node ({need['blocks']} blocks of up to "
                            f"{need['block_bytes'] / 2**20:,.0f} MiB, for the {need['why']}); checked at the run's "
                            f"start, and a store larger than the node's /dev/shm lives on disk (docs/clusters.md)"}


def plan_memory(cfg, plan) -> dict:
    """The memory model for the plan's batches, the configured drafter and the target's shape (from
    model.target_path's config.json or model.target_config); only a line when the shape is unknown."""
    from dflash_ray.data.plan import target_fields
    from dflash_ray.model.target import default_target_layer_ids
    from dflash_ray.hf_config import text_config
    from dflash_ray.sizing.memory import memory_report

    target = target_fields(cfg)
    if not target or "vocab_size" not in text_config(target):
        return {"text": ["memory model: the target's shape is unknown (model.target_path is not a local "
                         "directory with a config.json; a synthesised target is known once a run built it)"]}
    text = text_config(target)
    m, c = cfg.model, cfg.cluster
    layer_ids = list(m.target_layer_ids or default_target_layer_ids(int(text["num_hidden_layers"]), m.num_draft_layers))
    dtype = str(target.get("dtype") or target.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") or "float32")
    return memory_report(plan, target, draft_layers=m.num_draft_layers, layer_ids=layer_ids, use_gpu=c.use_gpu,
                         stored_bytes=4 if "32" in dtype else 2, device_memory_gib=c.device_memory_gb,
                         drafter_share=c.drafter_gpus, target_share=c.target_gpus,
                         recompute_layers=cfg.train.recompute_layers, drafter_ranks=c.drafter_workers,
                         parallelism=cfg.train.parallelism, target_stages=c.target_gpus_per_replica,
                         drafter_sizes={"intermediate": m.drafter_intermediate_size,
                                        "heads": m.drafter_num_attention_heads,
                                        "kv_heads": m.drafter_num_key_value_heads})


def choose_parallelism(cfg, plan) -> str:
    """What train.parallelism=auto means for this config and plan: fsdp when the memory model's DDP step
    (the plan's worst batch) does not fit the drafter's share of a GPU and there is more than one drafter
    rank, else ddp (also when the target's shape is unknown); an explicit ddp/fsdp stays."""
    if cfg.train.parallelism != "auto":
        return cfg.train.parallelism
    return plan_memory(cfg, plan).get("parallelism", "ddp")


def colocated_fits(cfg, memory: dict) -> bool | None:
    """Whether a target actor (or a replica's first stage) and a drafter worker fit half a GPU each, by the
    memory model's figures for this plan (`plan_memory`); None on CPUs or when the shape is unknown."""
    if not cfg.cluster.use_gpu or "drafter" not in memory or "target" not in memory:
        return None
    half = cfg.cluster.device_memory_gb * 2 ** 30 / 2
    return memory["drafter"]["total"] <= half and memory["target"]["total"] <= half
