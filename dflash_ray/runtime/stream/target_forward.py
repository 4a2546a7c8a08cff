"""The target actors of the stream (pipeline.py builds the stage): `TargetForward`, one per target GPU (a custom
resource on CPUs), the frozen target's tapped-layer features of each block of plan batches, read from the
node's feature cache where it has them (feature_cache.py), else computed and written there; a target split
over several processes (`TargetStage` followers, `start_replica`).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from dflash_ray.runtime.stream.rows import QUARANTINED, encode_features, row_slices


def in_row_slices(compute, input_ids: np.ndarray, lengths: np.ndarray, device):
    """compute(ids, attn) -> a tensor or a tuple of tensors with a leading row axis, over the batch whole; when
    the device runs out of memory, again over 2, 4, ... slices of its rows (down to single rows), the slices'
    outputs concatenated: the same features (every row's forward is its own: causal attention over its own
    tokens, its padding after it), up to float rounding (another batch shape). Returns (outputs, pieces)."""
    import torch

    rows, pieces = len(lengths), 1
    while True:
        try:
            parts = [compute(*_ids_and_mask(input_ids[ix], lengths[ix], device)) for ix in row_slices(rows, pieces)]
            break
        except torch.OutOfMemoryError:
            if pieces >= rows:
                raise   # a single row does not fit: the actor fails, and Ray retries the block elsewhere
        # out of the except block: the failed forward's activations are unreferenced now
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        pieces = min(2 * pieces, rows)
    if pieces == 1:
        return parts[0], 1
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts)), pieces
    return torch.cat(parts), pieces


def target_context(extract, input_ids: np.ndarray, lengths: np.ndarray, device) -> tuple[np.ndarray, str, int]:
    """The frozen target's tapped-layer features of one right-padded batch, encoded for a row
    (rows.encode_features; its .cpu() waits for the GPU), and the slices the forward took (in_row_slices)."""
    feats, pieces = in_row_slices(extract, input_ids, lengths, device)
    return (*encode_features(feats), pieces)


def target_context_and_soft_labels(extract, input_ids: np.ndarray, lengths: np.ndarray, device):
    """`target_context` and the target's next-token top-k at every position (distillation's soft labels,
    rows.encode_soft_labels), from the same forward."""
    from dflash_ray.runtime.stream.rows import encode_soft_labels

    (feats, top_ids, top_probs), pieces = in_row_slices(extract.features_and_top_k, input_ids, lengths, device)
    return (*encode_features(feats), encode_soft_labels(top_ids, top_probs), pieces)


class TargetForward:
    """One per target GPU (a custom resource stands in on the CPU): the frozen target's tapped-layer
    features for each batch. Ray restarts a killed actor (Ray Data retries its batch on a live one)."""

    def __init__(self, target_path: str, layer_ids: list, use_gpu: bool, record: str, namespace: str,
                 threads: int = 1, gpu_share: float = 1.0, dtype: str = "float32", stages: int = 1,
                 stage_resources: dict | None = None, feature_cache: tuple | None = None, top_k: int = 0,
                 feature_width: int = 0, keep_features: bool = True):
        import ray
        import torch

        from dflash_ray.runtime.stream.feature_cache import FeatureCache, default_root, soft_label_key

        # hybrid / offline (train.features): (cache dir or None for this node's default, key); None: online
        self.cache = None if feature_cache is None else FeatureCache(feature_cache[0] or default_root(), feature_cache[1])
        # train.loss=distill: the target's next-token top-k beside the features (cached under their own key)
        self.top_k = int(top_k)
        self.soft_cache = None if self.cache is None or not self.top_k else FeatureCache(
            feature_cache[0] or default_root(), soft_label_key(feature_cache[1], self.top_k))
        # keep_features False: the offline pass (stream/offline.py), which only fills the cache; a batch
        # already cached is skipped without reading it
        self.keep_features = keep_features
        self.layer_ids, self.feature_width = list(layer_ids), int(feature_width)

        if not use_gpu:
            torch.set_num_threads(max(1, threads))
        self.device = torch.device("cuda" if use_gpu else "cpu")
        if use_gpu:
            from dflash_ray.runtime.cluster import cap_gpu_memory

            cap_gpu_memory(gpu_share)
        if stages > 1 and self.top_k:   # resolve_spec refuses the pair: a follower would need the head and the gather
            raise ValueError("train.loss=distill needs the target in one process (target_gpus_per_replica 1)")
        # the target loads at the first batch the cache cannot answer: a stream that only reads the cache
        # (an offline run's training, a hybrid run's later segments) never holds it
        self._load = dict(target_path=target_path, use_gpu=use_gpu, gpu_share=gpu_share, dtype=dtype, stages=stages,
                          stage_resources=stage_resources or {}, threads=threads)
        self._extract, self.followers = None, []
        # an epoch end's filler rows: zeros encoded as the real rows are (one dtype in the stream)
        self.filler_dtype = getattr(torch, dtype)
        self.feature_dtype = dtype   # the encoding's name (rows.encode_features) of features read from the cache
        self.key = ray.get_runtime_context().get_actor_id()[:12]
        self.record = ray.get_actor(record, namespace=namespace)   # the run record counts what we compute
        ray.get(self.record.target_started.remote(self.key, os.getpid(), ray.get_runtime_context().get_node_id()))
        if self.cache is None:   # online: every batch needs the target, so it loads now (its failures show here)
            self.extract   # noqa: B018

    @property
    def extract(self):
        """The target's feature extractor, loaded at first use (see __init__)."""
        if self._extract is None:
            import ray
            import torch

            from dflash_ray.model.target import load_feature_extractor

            a, t0 = self._load, time.perf_counter()
            if a["stages"] > 1:   # a replica over `stages` GPUs: this actor is stage 0, the others are started here
                self._extract, self.followers = start_replica(a["target_path"], self.layer_ids, a["use_gpu"],
                                                              a["gpu_share"], a["dtype"], a["stages"],
                                                              a["stage_resources"], a["threads"])
                self.record.event.remote("target_replica", actor=self.key,   # the replica's stages (events.jsonl)
                                         layers=[list(r) for r in self._extract.stages],
                                         pids=[os.getpid()] + ray.get([f.pid.remote() for f in self.followers]))
            else:   # only the embedding and layers 0..max(tap) (every layer and the head for distill's top-k)
                self._extract = load_feature_extractor(a["target_path"], self.layer_ids, device=self.device,
                                                       dtype=getattr(torch, a["dtype"]), top_k=self.top_k)
            self.record.event.remote("target_loaded", actor=self.key, seconds=round(time.perf_counter() - t0, 2))
        return self._extract

    def __call__(self, batch: dict) -> dict:
        """A block of plan batches (see rows.stack_rows): each one's features, one report for the block."""
        contexts, dtypes, softs, report = [], [], [], []
        before = self._cache_counts()
        for i in range(len(batch["position"])):
            t0, pieces = time.perf_counter(), 1
            ids, lengths, samples = batch["input_ids"][i], batch["lengths"][i], batch["sample_ids"][i]
            cached = None
            # a filler, or a batch set aside (record/quarantine.py): zeros of the right shape, no forward
            if int(batch["position"][i]) < 0 or int(batch["bucket"][i]) == QUARANTINED:
                if not self.keep_features:
                    continue
                import torch

                width = self.feature_width or self.extract.hidden_size * len(self.layer_ids)
                feats, dtype = encode_features(torch.zeros(ids.shape + (width,), dtype=self.filler_dtype))
                soft = np.zeros(ids.shape + (2 * self.top_k,), np.int32)
            elif not self.keep_features and self._has_cached(samples, lengths):
                continue   # the offline pass, resumed: computed by an earlier pass
            elif (cached := self._from_cache(samples, lengths, ids.shape[1])) is not None:
                (feats, soft), dtype = cached, self.feature_dtype
            else:
                soft = None
                if self._load["stages"] > 1:   # the stages run in lockstep: no slices of one stage alone
                    feats, dtype = self.replica_context(ids, lengths)
                elif self.top_k:
                    feats, dtype, soft, pieces = target_context_and_soft_labels(self.extract, ids, lengths,
                                                                                self.device)
                else:
                    feats, dtype, pieces = target_context(self.extract, ids, lengths, self.device)
                if self.cache is not None:
                    self.cache.write_batch(samples, lengths, feats)
                if self.soft_cache is not None:
                    self.soft_cache.write_batch(samples, lengths, soft)
            contexts.append(feats)
            dtypes.append(dtype)
            softs.append(soft)
            report.append((time.perf_counter() - t0, int(batch["num_tokens"][i]), int(batch["bucket"][i]),
                           int(batch["index"][i]), int(feats.nbytes), cached is not None, pieces))
        after = self._cache_counts()
        self.record.target_batches.remote(self.key, report,
                                          None if after is None else {k: v - before[k] for k, v in after.items()})
        if not self.keep_features:   # the offline pass: what was computed, not the features
            return {"computed_tokens": np.array([sum(r[1] for r in report)], np.int64),
                    "computed_batches": np.array([len(report)], np.int64)}
        batch["context"] = contexts
        batch["context_dtype"] = np.array(dtypes)
        if self.top_k:
            batch["soft_labels"] = softs
        return batch

    def _has_cached(self, samples, lengths) -> bool:
        return self.cache.has_batch(samples, lengths) and (self.soft_cache is None
                                                          or self.soft_cache.has_batch(samples, lengths))

    def _from_cache(self, samples, lengths, width: int):
        """(features, top-k or None) of a batch whose samples are all in this node's cache (both caches with
        distill; the top-k first, so a batch read from neither counts no features row), else None."""
        if self.cache is None:
            return None
        soft = None
        if self.soft_cache is not None and (soft := self.soft_cache.read_batch(samples, lengths, width)) is None:
            return None
        feats = self.cache.read_batch(samples, lengths, width)
        return None if feats is None else (feats, soft)

    def _cache_counts(self) -> dict | None:
        """What the caches have done so far (feature_cache.py counts): rows and samples are the features
        cache's, bytes and faults both caches'."""
        if self.cache is None:
            return None
        counts = dict(self.cache.counts)
        if self.soft_cache is not None:
            for k in ("read_bytes", "written_bytes", "damaged", "write_errors"):
                counts[k] += self.soft_cache.counts[k]
        return counts

    def replica_context(self, input_ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, str]:
        """One batch through the replica's stages: each follower starts its part (its calls run in order),
        this stage runs its own and gathers every tap (model/target.py replica_features). A follower that
        died leaves a broken process group: this actor exits, and Ray restarts it with new followers."""
        import ray

        from dflash_ray.model.target import replica_features
        from dflash_ray.runtime.stream.rows import encode_features

        extract = self.extract   # loaded (its followers started) before they are called
        refs = [f.forward.remote(input_ids, lengths) for f in self.followers]
        ids, attn = _ids_and_mask(input_ids, lengths, self.device)
        try:
            feats = replica_features(extract, ids, attn)
            ray.get(refs)
        except Exception:   # noqa: BLE001 - any stage's failure breaks the group for good
            import traceback

            traceback.print_exc()
            os._exit(1)
        return encode_features(feats)


def _ids_and_mask(input_ids: np.ndarray, lengths: np.ndarray, device):
    import torch

    ids = torch.from_numpy(input_ids.astype(np.int64)).to(device)
    attn = (torch.arange(ids.shape[1])[None] < torch.from_numpy(lengths.astype(np.int64))[:, None]).long()
    return ids, attn.to(device)


class TargetStage:
    """Stage r > 0 of a target replica over several GPUs (cluster.target_gpus_per_replica): its layers only
    (model/target.py load_target_stage), fed by stage r - 1 and feeding stage r + 1 (send/recv in the
    replica's process group; NCCL on GPUs, gloo on CPUs). Started by stage 0, the TargetForward actor."""

    def __init__(self, threads: int = 1):
        import torch

        torch.set_num_threads(max(1, threads))

    def join(self, address: str, rank: int, world: int, use_gpu: bool, gpu_share: float, target_path: str,
             layer_ids: list, stages: list, dtype: str) -> None:
        import torch
        import torch.distributed as dist

        from dflash_ray.model.target import load_target_stage

        self.device = torch.device("cuda" if use_gpu else "cpu")
        if use_gpu:
            from dflash_ray.runtime.cluster import cap_gpu_memory

            cap_gpu_memory(gpu_share)
        dist.init_process_group("nccl" if use_gpu else "gloo", init_method=address, rank=rank, world_size=world)
        self.stage = load_target_stage(target_path, layer_ids, stages, rank, device=self.device,
                                       dtype=getattr(torch, dtype))

    def pid(self) -> int:
        return os.getpid()

    def forward(self, input_ids: np.ndarray, lengths: np.ndarray) -> None:
        from dflash_ray.model.target import replica_features

        ids, attn = _ids_and_mask(input_ids, lengths, self.device)
        replica_features(self.stage, ids, attn)


def start_replica(target_path: str, layer_ids: list, use_gpu: bool, gpu_share: float, dtype: str, stages: int,
                  stage_resources: dict, threads: int):
    """From stage 0 (a TargetForward actor): start stages 1..k-1 on this node, each with the resources of
    a target actor, join them in one process group, and load every stage's layers (the layers 0..last tap
    split evenly, the embedding counted on stage 0). Returns (stage 0's extractor, the followers)."""
    import socket

    import ray
    import torch
    import torch.distributed as dist
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dflash_ray.model.target import load_target_stage
    from dflash_ray.sizing.memory import Shape, stage_layers

    config = json.loads((Path(target_path) / "config.json").read_text()) if "://" not in target_path else {}
    last = max(int(i) for i in layer_ids) + 1
    try:
        shape = Shape.of(config)
        share = shape.vocab * shape.hidden / shape.layer_params()
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        share = 0.0
    ranges = stage_layers(last, stages, embed_share=share)
    node = ray.get_runtime_context().get_node_id()
    here = NodeAffinitySchedulingStrategy(node, soft=False)
    followers = [ray.remote(TargetStage).options(scheduling_strategy=here, **stage_resources).remote(threads)
                 for _ in range(stages - 1)]
    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    address = f"tcp://{host}:{port}"
    joined = [f.join.remote(address, r + 1, stages, use_gpu, gpu_share, target_path, layer_ids, ranges, dtype)
              for r, f in enumerate(followers)]
    dist.init_process_group("nccl" if use_gpu else "gloo", init_method=address, rank=0, world_size=stages)
    device = torch.device("cuda" if use_gpu else "cpu")
    extract = load_target_stage(target_path, layer_ids, ranges, 0, device=device, dtype=getattr(torch, dtype))
    ray.get(joined)
    return extract, followers
