"""The Ray Data pipeline: feed rows -> tokens joined -> TargetForward actor pool -> Ray Train workers.

    ray.data.range(blocks, one id per block)           the feed (feed.py) from the resume cursor, in blocks
                                                        of G plan batches, each block one rank's next G rows
      .map_batches(join_tokens)   tasks                 admitted by the flight window, then each batch's
                                                        tokens looked up and right-padded: a G-row block
      .map_batches(TargetForward) actor pool            one actor per target GPU (a custom resource on
                                                        CPU machines): context features of the tapped layers
      -> streaming_split(workers) inside Ray Train      order preserved, equal blocks: round-robin

G (`rows_per_block`) is as many plan batches as fit in `cluster.stream_block_mb` with the feed's largest
batch's features: Ray Data's costs are per block and per task (the split coordinator, a task per join, an
actor call per forward: ~70 ms of CPU a block on a 2-core CPU), so tiny batches share them, while a GPU
run's batches (~0.7 GB of features at Qwen3-8B's shape) stay one a block, as a block is also the unit of
memory in flight.

`DatasetFactory.splits` builds the streams each time the worker group (re)starts (Ray Train calls it
through stream/node_local.py NodeLocalDataConfig), so a restarted group gets fresh streams that start at the
checkpoint's cursor: one per node that hosts trainer workers, with target actors on that node. The
tokens live in the token store (token_store.py): blocks Ray Data read from the shards, spread over the
object stores; the driver puts only their index.
"""
from __future__ import annotations

import numpy as np

from dflash_ray.runtime.stream.rows import FEED_COLUMNS, FEED_SCALARS, QUARANTINED, stack_rows, token_row
from dflash_ray.runtime.stream.target_forward import TargetForward
from dflash_ray.runtime.stream.token_store import TokenStore
from dflash_ray.sizing.object_store import MAX_ROWS_PER_BLOCK  # noqa: F401  (the bound; tests read it here)
from dflash_ray.threads import threads_for


class _Ref:
    """Holds an ObjectRef so Ray Data passes it through unresolved (resolved once per process)."""

    def __init__(self, ref):
        self.ref = ref


_CACHE: dict = {}


def _get(holder: _Ref):
    import ray

    key = holder.ref.hex()
    if key not in _CACHE:
        if len(_CACHE) > 8:
            for k in [k for k in _CACHE if not isinstance(k, tuple)]:
                del _CACHE[k]
        _CACHE[key] = ray.get(holder.ref)
    return _CACHE[key]


def join_tokens(batch: dict, *, feed: _Ref, tokens: _Ref, coordinator: str, namespace: str, gen: int,
                pad_id: int, block_size: int, ranks: tuple, world: int, rows_per_block: int,
                rows_per_rank: int) -> dict:
    """One block id -> the block's plan batches of right-padded tokens, one row each (after the flight
    window admits the block's last row). See `block_rows` for which feed rows a block holds."""
    import ray

    indices = block_rows(int(batch["id"][0]), rows_per_block, rows_per_rank, ranks, world)
    key = ("actor", coordinator, namespace)
    if key not in _CACHE:
        _CACHE[key] = ray.get_actor(coordinator, namespace=namespace)
    ray.get(_CACHE[key].admit.remote(gen, indices[-1]))
    return token_block(_get(feed), tokens, indices, gen=gen, pad_id=pad_id, block_size=block_size)


def token_block(table, tokens: _Ref, indices: list, *, gen: int, pad_id: int, block_size: int) -> dict:
    """Feed rows `indices` of `table` -> their plan batches of right-padded tokens (rows.stack_rows)."""
    store = None
    rows = []
    for index in indices:
        row = {k: table.column(k)[index].as_py() for k in FEED_COLUMNS}
        if row["position"] < 0 or row["bucket"] == QUARANTINED:  # a filler, or a batch set aside: trains nothing
            n = 2 * block_size + 2
            ids, mask, lengths = np.full((1, n), pad_id, np.int32), np.ones((1, n), np.int8), np.array([n])
            samples = np.array([-1], np.int64)
        else:
            store = store or TokenStore(**_get(tokens))
            lengths = np.asarray(row["lengths"], np.int64)
            samples = np.asarray(row["sample_ids"], np.int64)
            ids, mask = store.batch(samples, lengths, pad_id)
        rows.append(token_row({k: row[k] for k in FEED_SCALARS}, gen, ids, mask, lengths, samples))
    return stack_rows(rows)


def block_rows(block: int, rows_per_block: int, rows_per_rank: int, ranks: tuple, world: int) -> list[int]:
    """The feed rows of a stream's block, in order. A stream serves `ranks` (all ranks of the run, or a
    node's); its blocks go round-robin over them (equal blocks, order preserved), so block b belongs to rank
    ranks[b % len(ranks)] and holds that rank's next G rows: its local rows k = (b // len(ranks)) * G ..
    (fewer at its end), and a rank's k-th row is feed row k * world + rank, as feed.rank_rows assigns."""
    slot, turn = block % len(ranks), block // len(ranks)
    first = turn * rows_per_block
    return [k * world + ranks[slot] for k in range(first, min(first + rows_per_block, rows_per_rank))]


def stream_blocks(rows_per_rank: int, rows_per_block: int, n_ranks: int) -> int:
    """Blocks of a stream of `n_ranks` ranks with `rows_per_rank` rows each (every rank's last block may be
    short, the same length for all: the round-robin stays aligned)."""
    return n_ranks * -(-rows_per_rank // rows_per_block)


def largest_batch_bytes(lengths, bytes_per_token: int) -> int:
    """Bytes of the feed's largest plan batch through the stream: padded rows x width tokens at
    `bytes_per_token` (features, ids, mask); 0 when unknown. lengths: the feed's `lengths` list column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if bytes_per_token <= 0 or len(lengths) == 0:
        return 0
    arr = lengths.combine_chunks() if isinstance(lengths, pa.ChunkedArray) else lengths
    counts = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    if flat.size == 0:
        return 0
    starts = np.cumsum(counts) - counts
    widest = np.maximum.reduceat(flat, starts[counts > 0])
    return int((counts[counts > 0] * widest).max()) * int(bytes_per_token)


def rows_per_block(lengths, bytes_per_token: int, block_mb: float) -> int:
    """Plan batches per stream block for this feed (sizing/object_store.rows_for_block at its largest batch,
    `largest_batch_bytes`, against this Ray Data's largest block)."""
    from dflash_ray.sizing.object_store import rows_for_block

    return rows_for_block(largest_batch_bytes(lengths, bytes_per_token), block_mb, _max_block_bytes())


def stream_store_need(run_spec, feed, resources: dict) -> dict:
    """What one node's stream needs of its object store (sizing/object_store.py), for this feed: its
    largest block, the flight window, every trainer on one node (the worst placement)."""
    from dflash_ray.sizing.object_store import stream_store_need as need

    per_token = stream_bytes_per_token(run_spec)
    lengths = feed.table.column("lengths")
    per_block = rows_per_block(lengths, per_token, block_budget_mb(run_spec.cluster.stream_block_mb, resources))
    return need(per_block * largest_batch_bytes(lengths, per_token), per_block,
                run_spec.cluster.max_batches_in_flight, run_spec.cluster.drafter_workers)


STORE_FRACTION_PER_BLOCK = 1 / 64


def block_budget_mb(block_mb: float, resources: dict) -> float:
    """cluster.stream_block_mb, within 1/64 of the smallest node's object store. Ray Data budgets each
    operator's output memory (the target actors got ~1/3 of a 400 MB store); the equal split dispatches
    a round only when all its blocks are there while the trainers still hold the previous round's, so
    about four blocks must fit in that budget or the stream deadlocks (seen with 26 MiB blocks in a
    400 MB store)."""
    stores = [float(r.get("object_store_memory", 0)) for r in resources.values() if r.get("object_store_memory")]
    if not stores:
        return block_mb
    return min(block_mb, min(stores) * STORE_FRACTION_PER_BLOCK / 2**20)


def _max_block_bytes() -> float:
    try:
        from ray.data import DataContext

        return float(DataContext.get_current().target_max_block_size or 128 * 2**20)
    except ImportError:
        return 128 * 2**20


def stream_bytes_per_token(run_spec) -> int:
    """Bytes a token carries through the stream: the tapped layers' features (in the run's compute dtype),
    its id (int32) and its loss-mask byte; 0 when the target's width is unknown."""
    hidden = run_spec.target_hidden_size
    if hidden <= 0:
        return 0
    per_value = 2 if run_spec.compute_dtype == "bfloat16" else 4
    return hidden * len(run_spec.drafter.target_layer_ids) * per_value + 4 + 1


class DatasetFactory:
    """Builds the stream each time the worker group starts (Ray Train calls `NodeLocalDataConfig.configure`,
    with the nodes the workers landed on): the remaining steps from the latest registered checkpoint's cursor.

    Node-local features: the target's features are the big part of a row (Qwen3-8B, 5 tapped layers, bf16:
    ~40 KB per token). So each node that hosts trainer workers gets a stream of its own: the feed rows its
    ranks train (rank r trains rows i with i % world == r, as feed.rank_rows says), joined and run through
    target actors placed on that node, split round-robin over its ranks. Features never leave the node
    that computed them; the global plan, each rank's rows and the ledger are unchanged. The target actors
    are shared out in proportion to each node's ranks, within what the node can host; when a node with
    trainers can host none, the run falls back to one stream of all rows over actors anywhere (features
    then cross nodes; the run record counts those bytes)."""

    def __init__(self, run_spec, plans, tokens_ref, checkpoints):
        self.run_spec, self.plans = run_spec, plans   # plans: the driver's RunPlans (spec.py), built there
        self.tokens = _Ref(tokens_ref)
        self.checkpoints = checkpoints   # the run's RunCheckpoints (runtime/checkpoints.py): where a stream starts

    def feed(self, quarantined=()):
        """quarantined: (epoch, position) of plan batches no rank trains (record/quarantine.py)."""
        from dflash_ray.runtime.stream.feed import build_feed

        s = self.run_spec
        cursor, _ = self.checkpoints.latest()
        return build_feed(self.plans, cursor, s.batches_per_step, s.train.epochs, s.train.max_steps,
                          quarantined=quarantined)

    def splits(self, world_size: int, worker_node_ids: list) -> list:
        """One iterator per rank, rank r's rows in order."""
        import ray

        s = self.run_spec
        everywhere = [(None, tuple(range(world_size)))]
        groups = node_groups(worker_node_ids) if worker_node_ids else everywhere
        if len(groups) == 1:
            groups = everywhere   # one node: no pinning (its actors may go wherever there is room)
        resources = node_resources()
        shares = target_shares(s.cluster, groups, world_size, resources)
        if shares is None and len(groups) > 1:   # a node with trainers can host no target actor
            groups, shares = everywhere, target_shares(s.cluster, everywhere, world_size, resources)
        if shares is None:
            raise RuntimeError(f"no node can host a target actor now (cluster.target_workers="
                               f"{s.cluster.target_workers}): nodes {resources}")
        from dflash_ray.runtime.coordinator import record_actor_name

        coord = ray.get_actor(s.coordinator, namespace=s.namespace)
        record = ray.get_actor(record_actor_name(s.coordinator), namespace=s.namespace)
        # a replaced group's late commits are dropped from here on; what its failure quarantines is in the feed
        quarantined = ray.get(record.end_stream.remote(s.train.quarantine_after))
        feed = self.feed([tuple(q) for q in quarantined])
        placement = [{"node": node, "ranks": list(ranks), "target_actors": k} for (node, ranks), k in zip(groups, shares)]
        per_block = rows_per_block(feed.table.column("lengths"), stream_bytes_per_token(s),
                                   block_budget_mb(s.cluster.stream_block_mb, resources))
        gen = ray.get(record.new_stream.remote(feed.total_steps, list(worker_node_ids or []), placement))
        ray.get(coord.reset_feed.remote(gen, feed.total_steps, feed.cursor.as_dict(), s.batches_per_step,
                                        feed.schedule_steps, rows_per_block=per_block, world=world_size))
        feed_ref = ray.put(feed.table)
        out = [None] * world_size
        for (node, ranks), k in zip(groups, shares):
            ds = self.stream(feed_ref, feed.num_rows, gen, node, ranks, world_size, k, per_block)
            ds.context.execution_options.preserve_order = True   # equal blocks: round-robin over the ranks
            for r, it in zip(ranks, ds.streaming_split(len(ranks), equal=True)):
                out[r] = {"train": it}
        return out

    def stream(self, feed_ref, num_rows: int, gen: int, node, ranks: tuple, world: int, target_actors: int,
               per_block: int = 1):
        """The Ray Data stream of the rows `ranks` train (node None: actors anywhere), in blocks of
        `per_block` plan batches (see block_rows)."""
        import ray
        from ray.data import ActorPoolStrategy
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        s, c = self.run_spec, self.run_spec.cluster
        per_rank = num_rows // world   # the feed gives every rank the same number of rows
        n = stream_blocks(per_rank, per_block, len(ranks))
        ds = ray.data.range(max(n, 1), override_num_blocks=max(n, 1))
        if n == 0:
            return ds.limit(0)
        pin = {} if node is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        ds = ds.map_batches(
            join_tokens, batch_size=1, num_cpus=0.25, concurrency=2,
            fn_kwargs=dict(feed=_Ref(feed_ref), tokens=self.tokens, coordinator=s.coordinator,
                           namespace=s.namespace, gen=gen, pad_id=s.pad_token_id, block_size=s.drafter.block_size,
                           ranks=tuple(ranks), world=world, rows_per_block=per_block, rows_per_rank=per_rank),
            **pin)
        res = target_actor_resources(c)
        return ds.map_batches(   # batch_size None: a block is one call (never merged with the next)
            TargetForward, batch_size=None, compute=ActorPoolStrategy(size=target_actors),
            fn_constructor_kwargs=target_forward_kwargs(s, threads=threads_for(c.cpu_threads, "target"), stage_resources=res),
            **res, **pin)


def target_actor_resources(cluster) -> dict:
    """What one TargetForward actor asks Ray for: its GPU share, or on CPUs the target's custom resource."""
    if cluster.use_gpu:
        return dict(num_gpus=cluster.target_gpus, num_cpus=1)
    return dict(num_cpus=0.5, resources={cluster.target_resource: 1})


def target_forward_kwargs(s, *, threads: int, stage_resources: dict, keep_features: bool = True) -> dict:
    """TargetForward's constructor arguments for run spec `s`."""
    from dflash_ray.runtime.coordinator import record_actor_name

    c = s.cluster
    return dict(target_path=s.target_path, layer_ids=list(s.drafter.target_layer_ids), use_gpu=c.use_gpu,
                record=record_actor_name(s.coordinator), namespace=s.namespace, gpu_share=c.target_gpus,
                dtype=s.compute_dtype, threads=threads, stages=c.target_gpus_per_replica,
                stage_resources=stage_resources,
                feature_cache=None if s.feature_cache is None else (s.train.feature_cache_dir, s.feature_cache),
                top_k=s.train.distill_top_k if s.train.loss == "distill" else 0,
                feature_width=s.target_hidden_size * len(s.drafter.target_layer_ids), keep_features=keep_features)


def node_groups(worker_node_ids: list) -> list[tuple]:
    """(node, ranks on it) in order of each node's lowest rank."""
    groups: dict = {}
    for rank, node in enumerate(worker_node_ids):
        groups.setdefault(node, []).append(rank)
    return [(node, tuple(ranks)) for node, ranks in groups.items()]


def target_room(cluster, total: dict, trainers: int) -> int:
    """Target actors (replicas) one node can host beside `trainers` drafter workers: its GPUs less the
    trainers' shares, over a replica's (its stages each take a target actor's share); on CPUs its target
    resource's slots, over the stages."""
    k = getattr(cluster, "target_gpus_per_replica", 1)
    if cluster.use_gpu:
        free = total.get("GPU", 0.0) - trainers * cluster.drafter_gpus
        return int(free / (cluster.target_gpus * k) + 1e-9)
    return int(total.get(cluster.target_resource, 0.0) / k + 1e-9)


def target_shares(cluster, groups: list, world_size: int, resources: dict) -> list | None:
    """Target actors per node group: cluster.target_workers in proportion to the group's ranks (at least
    one), capped by what the node can host (its target resource, or its GPUs less its trainers' shares);
    the one group of a single-node (or fallback) stream: target_workers capped by the whole cluster's
    room. None when a group can host none (an actor pool that cannot start would wait forever).
    resources: node id -> that node's total resources (alive nodes)."""
    k = getattr(cluster, "target_gpus_per_replica", 1)   # a replica's stages: each takes a target actor's share
    shares = []
    for node, ranks in groups:
        if node is None:   # anywhere: what all nodes together can host beside the trainers
            have = sum(target_room(cluster, total, 0) for total in resources.values()) - \
                (int(world_size * cluster.drafter_gpus / (cluster.target_gpus * k)) if cluster.use_gpu else 0)
            want = cluster.target_workers
        else:
            have = target_room(cluster, resources.get(node, {}), len(ranks))
            want = max(1, round(cluster.target_workers * len(ranks) / world_size))
        if have < 1:
            return None
        shares.append(min(want, have))
    return shares


def node_resources() -> dict:
    import ray

    return {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
