"""What the target actors did, for the run record (record.py) to report: per actor its pid, node, batches,
tokens, busy seconds, restarts and the forwards it split; the busy seconds per bucket (the planner balances
batches' target work across buckets); the features' bytes that crossed nodes to their trainer; what the
feature cache served instead of a forward."""
from __future__ import annotations

import time


def _actor_entry(pid, node) -> dict:
    now = time.time()
    return {"pid": pid, "node": node, "batches": 0, "tokens": 0, "busy_s": 0.0, "restarts": 0, "started": now,
            "last": now, "oom_splits": 0}


class TargetActors:
    def __init__(self, gauges):
        self.gauges = gauges                          # the dflash_* Ray metrics (gauges.py)
        self.actors: dict[str, dict] = {}
        self.by_bucket: dict[int, list] = {}          # bucket -> [batches, busy seconds], all actors
        self.restarts = 0
        self.features = {"rows": 0, "bytes": 0, "cross_node_rows": 0, "cross_node_bytes": 0}
        self.feature_cache = {"read_tokens": 0, "read_s": 0.0}   # + feature_cache.FeatureCache's counts

    def started(self, key: str, pid: int, node: str) -> bool:
        """Actor `key` started; True when it is a restart (Ray restarted it after it died: its batch is
        recomputed by Ray Data's retry)."""
        t = self.actors.get(key)
        if t is None:
            self.actors[key] = _actor_entry(pid, node)
            return False
        t.update(pid=pid, node=node, restarts=t["restarts"] + 1)
        self.restarts += 1
        return True

    def batches(self, key: str, report: list, cache: dict | None, rank_nodes: list) -> bool:
        """A target actor's block: (busy seconds, tokens, bucket, feed index, feature bytes, read from the
        feature cache, slices of its forward) per batch, and what its feature cache did for the block
        (feature_cache.py counts); `rank_nodes`: the node of each trainer rank of the current stream. A batch
        read from the cache is no target forward: the target's rates count computed batches only; a forward
        of several slices ran out of device memory whole. True when the block held a computed batch."""
        computed = False
        for busy_s, tokens, bucket, index, nbytes, cached, pieces in report:
            if cached:
                c = self.feature_cache
                c["read_tokens"] += int(tokens)
                c["read_s"] += busy_s
            else:
                computed = True
                self._batch(key, busy_s, tokens, bucket, index, nbytes, rank_nodes)
                if pieces > 1:
                    self.actors[key]["oom_splits"] = self.actors[key].get("oom_splits", 0) + 1
        for k, v in (cache or {}).items():
            self.feature_cache[k] = self.feature_cache.get(k, 0) + v
        return computed

    def _batch(self, key: str, busy_s: float, tokens: int, bucket: int, index: int, nbytes: int,
               rank_nodes: list) -> None:
        t = self.actors.setdefault(key, _actor_entry(None, None))
        if index >= 0 and rank_nodes:
            # the rank that trains feed row `index` (feed.rank_rows) and its node: do the features cross?
            f = self.features
            f["rows"] += 1
            f["bytes"] += int(nbytes)
            if t.get("node") and t["node"] != rank_nodes[index % len(rank_nodes)]:
                f["cross_node_rows"] += 1
                f["cross_node_bytes"] += int(nbytes)
        t["batches"] += 1
        t["tokens"] += int(tokens)
        t["busy_s"] += busy_s
        t["last"] = time.time()
        if bucket >= 0:  # fillers (bucket -1) run no forward
            b = self.by_bucket.setdefault(int(bucket), [0, 0.0])
            b[0] += 1
            b[1] += busy_s
        self.gauges.target_batch(key, busy_s, idle=max(0.0, 1.0 - t["busy_s"] / max(time.time() - t["started"], 1e-9)))

    def pids(self) -> dict:
        return {k: v["pid"] for k, v in self.actors.items()}

    def report(self) -> dict:
        now = time.time()
        total = sum(t["batches"] for t in self.actors.values()) or 1
        targets = {k: {"batches": t["batches"], "share": t["batches"] / total, "busy_s": round(t["busy_s"], 3),
                       "tokens": t["tokens"], "idle_fraction": max(0.0, 1 - t["busy_s"] / max(now - t["started"], 1e-9)),
                       "restarts": t["restarts"], "pid": t["pid"], "node": t["node"],
                       "oom_splits": t.get("oom_splits", 0)}
                   for k, t in self.actors.items()}
        by_bucket = [{"bucket": b, "batches": n, "mean_busy_ms": 1000 * s / n}
                     for b, (n, s) in sorted(self.by_bucket.items()) if n]
        means = [r["mean_busy_ms"] for r in by_bucket]
        return {"target_busy_by_bucket": by_bucket,
                "target_busy_max_over_min": max(means) / min(means) if means and min(means) > 0 else None,
                "target_restarts": self.restarts, "targets": targets, "feature_traffic": dict(self.features),
                "feature_cache": dict(self.feature_cache)}
