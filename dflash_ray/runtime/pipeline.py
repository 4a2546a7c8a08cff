"""The Ray Data pipeline: feed rows -> tokens joined -> TargetForward actor pool -> Ray Train workers.

    ray.data.range(rows, one row per block)            the feed (feed.py) from the resume cursor
      .map_batches(join_tokens)   tasks                 admitted by the flight window, then the batch's
                                                        tokens looked up and right-padded
      .map_batches(TargetForward) actor pool            one actor per target GPU (a custom resource on
                                                        CPU machines): context features of the tapped layers
      -> streaming_split(workers) inside Ray Train      order preserved, one-row blocks: round-robin

`DatasetFactory` is handed to `TorchTrainer(datasets={"train": factory})`: Ray Train calls it each time
the worker group (re)starts, so a restarted group gets a fresh stream that starts at the checkpoint's
cursor. The tokens live in the token store (token_store.py): blocks Ray Data read from the shards,
spread over the object stores; the driver puts only their index.
"""
from __future__ import annotations

import os
import time

import numpy as np

from dflash_ray.runtime.rows import FEED_COLUMNS, FEED_SCALARS, encode_features, token_row
from dflash_ray.runtime.token_store import TokenStore


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
                pad_id: int, block_size: int) -> dict:
    """One feed row -> one batch of right-padded tokens (after the flight window admits it)."""
    import ray

    index = int(batch["id"][0])
    key = ("actor", coordinator, namespace)
    if key not in _CACHE:
        _CACHE[key] = ray.get_actor(coordinator, namespace=namespace)
    ray.get(_CACHE[key].admit.remote(gen, index))
    table = _get(feed)
    row = {k: table.column(k)[index].as_py() for k in FEED_COLUMNS}
    if row["position"] < 0:  # filler: pads an epoch's last step to a full step; trains nothing
        n = 2 * block_size + 2
        ids, mask, lengths = np.full((1, n), pad_id, np.int32), np.ones((1, n), np.int8), np.array([n])
    else:
        store = TokenStore(**_get(tokens))
        lengths = np.asarray(row["lengths"], np.int64)
        ids, mask = store.batch(np.asarray(row["sample_ids"], np.int64), lengths, pad_id)
    return token_row({k: row[k] for k in FEED_SCALARS}, gen, ids, mask, lengths)


def target_context(extract, input_ids: np.ndarray, lengths: np.ndarray, device) -> tuple[np.ndarray, str]:
    """The frozen target's tapped-layer features of one right-padded batch, encoded for a row
    (rows.encode_features; its .cpu() waits for the GPU)."""
    import torch

    ids = torch.from_numpy(input_ids.astype(np.int64)).to(device)
    attn = (torch.arange(ids.shape[1])[None] < torch.from_numpy(lengths.astype(np.int64))[:, None]).long()
    return encode_features(extract(ids, attn.to(device)))


class TargetForward:
    """One per target GPU (a custom resource stands in on the CPU): the frozen target's tapped-layer
    features for each batch. Ray restarts a killed actor (Ray Data retries its batch on a live one)."""

    def __init__(self, target_path: str, layer_ids: list, use_gpu: bool, coordinator: str, namespace: str,
                 threads: int = 1, gpu_share: float = 1.0):
        import ray
        import torch

        from dflash_ray.model.target import load_feature_extractor

        if not use_gpu:
            torch.set_num_threads(max(1, threads))
        self.device = torch.device("cuda" if use_gpu else "cpu")
        if use_gpu:
            from dflash_ray.runtime.cluster import cap_gpu_memory

            cap_gpu_memory(gpu_share)
        # only the embedding and layers 0..max(tap): later layers and the LM head are never loaded
        self.extract = load_feature_extractor(target_path, list(layer_ids), device=self.device)
        self.key = ray.get_runtime_context().get_actor_id()[:12]
        self.coord = ray.get_actor(coordinator, namespace=namespace)
        ray.get(self.coord.target_started.remote(self.key, os.getpid(), ray.get_runtime_context().get_node_id()))

    def __call__(self, batch: dict) -> dict:
        t0 = time.perf_counter()
        if int(batch["position"][0]) < 0:  # a filler: zeros of the right shape, no forward
            width = self.extract.hidden_size * len(self.extract.layer_ids)
            feats, dtype = np.zeros(batch["input_ids"].shape[1:] + (width,), np.float32), "float32"
        else:
            feats, dtype = target_context(self.extract, batch["input_ids"][0], batch["lengths"][0], self.device)
        self.coord.target_batch.remote(self.key, time.perf_counter() - t0, int(batch["num_tokens"][0]),
                                       int(batch["bucket"][0]))
        batch["context"] = feats[None]
        batch["context_dtype"] = np.array([dtype])
        return batch


class DatasetFactory:
    """Called by Ray Train (in its controller) each time the worker group starts: the stream of the
    remaining steps from the latest registered checkpoint's cursor."""

    def __init__(self, run_spec, tokens_ref, experiment_dir: str):
        self.run_spec = run_spec
        self.tokens = _Ref(tokens_ref)
        self.experiment_dir = experiment_dir

    def feed(self):
        from dflash_ray.runtime.checkpoint import latest_checkpoint
        from dflash_ray.runtime.feed import build_feed

        s = self.run_spec
        cursor, _ = latest_checkpoint(self.experiment_dir)
        plans = {}

        def plan_for(e):
            if e not in plans:
                plans[e] = s.build_plan(e)
            return plans[e]

        return build_feed(plan_for, cursor, s.batches_per_step, s.train.epochs, s.train.max_steps)

    def __call__(self):
        import ray
        from ray.data import ActorPoolStrategy

        s, c = self.run_spec, self.run_spec.cluster
        feed = self.feed()
        coord = ray.get_actor(s.coordinator, namespace=s.namespace)
        gen = ray.get(coord.reset_feed.remote(feed.total_steps, feed.cursor.as_dict(), s.batches_per_step,
                                             feed.schedule_steps))
        feed_ref = ray.put(feed.table)
        n = max(feed.num_rows, 1)
        ds = ray.data.range(n, override_num_blocks=n)
        if feed.num_rows == 0:
            return ds.limit(0)
        ds = ds.map_batches(
            join_tokens, batch_size=1, num_cpus=0.25, concurrency=2,
            fn_kwargs=dict(feed=_Ref(feed_ref), tokens=self.tokens, coordinator=s.coordinator,
                           namespace=s.namespace, gen=gen, pad_id=s.pad_token_id, block_size=s.drafter.block_size))
        if c.use_gpu:
            res = dict(num_gpus=c.target_gpus, num_cpus=1)
        else:
            res = dict(num_cpus=0.5, resources={c.target_resource: 1})
        return ds.map_batches(
            TargetForward, batch_size=1, compute=ActorPoolStrategy(size=c.target_workers),
            fn_constructor_kwargs=dict(target_path=s.target_path, layer_ids=list(s.drafter.target_layer_ids),
                                       use_gpu=c.use_gpu, coordinator=s.coordinator, namespace=s.namespace,
                                       gpu_share=c.target_gpus),
            **res)
