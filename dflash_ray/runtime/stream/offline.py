"""train.features=offline: the target's pass over the samples a run still trains, before its drafter workers
start, every one written to the node's feature cache (feature_cache.py); training then reads the cache.

The peers' offline order (SpecForge, Model Optimizer: dump the features, then train) inside one run: the
target pool takes every target slot (every GPU, or on CPUs every core split over the target resource's
slots), ends, and gives them back before Ray Train starts. Asked for only (`auto` never takes it): on two
shared CPU cores side by side measured faster (SmolLM2's one-epoch job: 413 s online against 443 s offline
in one run, docs/notes/performance.md); a node whose every GPU can run the target first is the case it is for,
not measured.

    ray.data.range(blocks) -> .map_batches(offline_tokens) -> .map_batches(TargetForward, keep_features=False)

The rows are the current epoch's remaining plan batches (a resumed run: from its checkpoint's cursor);
every epoch plans the same samples, so one epoch's pass fills the cache for all. A batch whose samples are
all cached already (a rerun) is skipped by a stat, not read. The features never leave the actor that
computed them: it writes them and returns two counts. On several nodes each actor fills its own node's
cache, and a trainer on another node computes what its node lacks (hybrid's rule): correct, not faster.
"""
from __future__ import annotations

import time

import numpy as np

from dflash_ray.runtime.stream.pipeline import _get, _Ref, token_block


def offline_tokens(batch: dict, *, feed: _Ref, tokens: _Ref, pad_id: int, block_size: int, rows_per_block: int,
                   num_rows: int) -> dict:
    """Block id -> its feed rows' padded tokens (no flight window: nothing trains while this runs)."""
    b = int(batch["id"][0])
    indices = list(range(b * rows_per_block, min(num_rows, (b + 1) * rows_per_block)))
    return token_block(_get(feed), tokens, indices, gen=0, pad_id=pad_id, block_size=block_size)


def pass_rows(feed_table):
    """The feed rows the pass computes: the first epoch of the feed (the cursor's), fillers left out."""
    import pyarrow.compute as pc

    if feed_table.num_rows == 0:
        return feed_table
    first = feed_table.column("epoch")[0]
    keep = pc.and_(pc.equal(feed_table.column("epoch"), first), pc.greater_equal(feed_table.column("position"), 0))
    return feed_table.filter(keep)


def target_pool(cluster, resources: dict) -> tuple[int, int]:
    """(actors, torch threads each) for the pass: every target slot of every node now that no trainer holds
    one (pipeline.target_room with no trainers); on CPUs the usable cores split over the slots."""
    from dflash_ray.runtime.stream.pipeline import target_room
    from dflash_ray.threads import usable_cores

    slots = sum(max(0, target_room(cluster, total, 0)) for total in resources.values())
    return slots, 1 if cluster.use_gpu else max(1, usable_cores() // max(1, slots))


def compute_offline_features(run_spec, feed_table, tokens_ref, log=print, node_id: str | None = None) -> dict:
    """Run the pass; returns what it did (summary.json's "offline_features"). node_id: on that node's target
    slots only, every row written to its cache (a sweep's pass, once per node: fill_feature_cache)."""
    import ray
    from ray.data import ActorPoolStrategy

    from dflash_ray.runtime.stream.pipeline import (block_budget_mb, node_resources, rows_per_block,
                                                    stream_bytes_per_token, target_actor_resources,
                                                    target_forward_kwargs)
    from dflash_ray.runtime.stream.target_forward import TargetForward

    s, c = run_spec, run_spec.cluster
    rows = pass_rows(feed_table)
    resources = node_resources()
    pin = {}
    if node_id is not None:   # Ray's own per-node resource ("node:<ip>", 1 on each node) pins every task and actor
        resources = {node_id: resources.get(node_id, {})}
        pin = {k: 0.001 for k in resources[node_id] if k.startswith("node:") and k != "node:__internal_head__"}
    actors, threads = target_pool(c, resources)
    if actors < 1:
        raise RuntimeError(f"no node can host a target actor for the offline pass: nodes {resources}")
    t0 = time.perf_counter()
    out = {"node": node_id, "rows": rows.num_rows, "actors": actors, "threads": threads, "computed_batches": 0,
           "computed_tokens": 0, "seconds": 0.0}
    if rows.num_rows == 0:
        return out
    per_block = rows_per_block(rows.column("lengths"), stream_bytes_per_token(s),
                               block_budget_mb(c.stream_block_mb, resources))
    n = -(-rows.num_rows // per_block)
    res = target_actor_resources(c)
    if pin:
        res = {**res, "resources": {**res.get("resources", {}), **pin}}
    ds = ray.data.range(n, override_num_blocks=n).map_batches(
        offline_tokens, batch_size=1, num_cpus=0.25, resources=pin or None,
        fn_kwargs=dict(feed=_Ref(ray.put(rows)), tokens=_Ref(tokens_ref), pad_id=s.pad_token_id,
                       block_size=s.drafter.block_size, rows_per_block=per_block, num_rows=rows.num_rows))
    ds = ds.map_batches(TargetForward, batch_size=None, compute=ActorPoolStrategy(size=min(actors, n)),
                        fn_constructor_kwargs=target_forward_kwargs(s, threads=threads, stage_resources=res,
                                                                    keep_features=False), **res)
    for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
        out["computed_batches"] += int(np.sum(b["computed_batches"]))
        out["computed_tokens"] += int(np.sum(b["computed_tokens"]))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    where = f" on node {node_id[:8]}" if node_id else ""
    log(f"target features, offline{where}: {out['computed_tokens']:,} tokens in {out['computed_batches']} batches computed "
        f"and cached in {out['seconds']:.0f} s ({actors} target actor(s) x {threads} thread(s); "
        f"{rows.num_rows - out['computed_batches']} batches were cached already)")
    return out

