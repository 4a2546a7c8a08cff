"""A target split over processes (model/target.py: load_target_stage, replica_features; the pieces of
cluster.target_gpus_per_replica): two processes on gloo, each holding only its layers, give rank 0 the
features of the unsplit target exactly; the stages' layer ranges by hand."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_model import TINY_QWEN3
from helpers_ranks import init_ranks

LAYERS, TAPS = 6, [1, 3, 5]   # a tap on the last layer: HF's final norm applies to it


def test_stage_ranges_by_hand():
    from dflash_ray.model.target import stage_layers

    assert stage_layers(6, 2) == [(0, 3), (3, 6)]
    assert stage_layers(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert stage_layers(78, 2, embed_share=4.0) == [(0, 37), (37, 78)]   # (78 + 4) / 2 = 41 -> 41 - 4 = 37
    assert stage_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError):
        stage_layers(2, 3)


def _stage(rank, world, store, target, out):
    import torch.distributed as dist

    from dflash_ray.model.target import load_target_stage, replica_features, stage_layers

    torch.set_num_threads(1)
    init_ranks(rank, world, store)
    try:
        stages = stage_layers(LAYERS, 2)
        stage = load_target_stage(target, TAPS, stages, rank)
        held = {n.split(".")[1] for n, p in stage.decoder.named_parameters() if n.startswith("layers.")
                and not p.is_meta}
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 200, (2, 24), generator=g)
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, 20:] = 0                                           # a right-padded row
        feats = replica_features(stage, ids, mask)
        torch.save({"features": feats, "layers": sorted(int(x) for x in held),
                    "embedding": not stage.decoder.embed_tokens.weight.is_meta, "ids": ids, "mask": mask},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_processes_give_the_unsplit_targets_features(tmp_path, ranks):
    from dflash_ray.model.target import build_synthetic_target, load_feature_extractor

    target = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": LAYERS}, 300, str(tmp_path / "t"), seed=1)
    out = tmp_path / "out"
    ranks(__name__, "_stage", 2, tmp_path / "store", target, str(out))
    r0, r1 = (torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1))
    # each process read only its own layers (and rank 0 the embedding)
    assert (r0["layers"], r1["layers"]) == ([0, 1, 2], [3, 4, 5]) and r0["embedding"] and not r1["embedding"]
    assert r1["features"] is None
    whole = load_feature_extractor(target, TAPS)(r0["ids"], r0["mask"])
    assert r0["features"].shape == whole.shape == (2, 24, 3 * TINY_QWEN3["hidden_size"])
    assert torch.equal(r0["features"], whole)


@pytest.mark.slow
def test_the_job_with_a_target_over_two_stages_trains_the_weights_of_one(split_run, job_run):
    """cluster.target_gpus_per_replica=2 on the CPU cluster (each stage a target slot): the main job's target
    actor runs stage 0 and starts stage 1 beside it; the features are the unsplit target's, so the run ends
    with the reference run's weights, bit for bit. (The run also trains in two stream segments, which must
    not change a weight either: conftest.split_run.)"""
    from dflash_ray.runtime.training.checkpoint_format import load_weights

    from dflash_ray.runtime.record.ledger import read_jsonl

    spec, s = split_run
    ref = job_run["summary"]
    replicas = [e for e in read_jsonl(Path(spec.run_dir) / "events.jsonl") if e["event"] == "target_replica"]
    # the tiny target's taps end at its last layer: its layers split in two, each stage its own process
    assert replicas and all(len(set(e["pids"])) == 2 and len(e["layers"]) == 2 for e in replicas)
    assert replicas[0]["layers"][0][0] == 0 and replicas[0]["layers"][0][1] == replicas[0]["layers"][1][0]
    assert s["steps"] == ref["steps"] and s["ledger"]["ok"] is True and s["tokens"] == ref["tokens"]
    a, b = load_weights(Path(s["checkpoint"])), load_weights(Path(ref["checkpoint"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
