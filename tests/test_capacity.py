"""The capacity model (sizing/capacity.py): the split of GPUs between the target and the drafter, colocated
or not, and the `plan` command's report of it. Expected values by hand."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash_ray.config import compose_config
from dflash_ray.errors import UserError
from dflash_ray.sizing.capacity import best_split, capacity_report


def test_capacity_model_balances_the_pipeline():
    r = best_split(8, target_rate=4000.0, drafter_rate=12000.0)
    assert (r["best"]["target"], r["best"]["drafter"]) == (6, 2)
    assert r["best"]["tokens_per_second"] == 24000.0
    r = best_split(8, target_rate=12000.0, drafter_rate=4000.0)
    assert (r["best"]["target"], r["best"]["drafter"]) == (2, 6)
    assert all(s["tokens_per_second"] <= r["best"]["tokens_per_second"] for s in r["splits"])
    # each side in its unit: target 5,000 context tokens/s, drafter 10,000 block tokens/s per GPU; at 4 block
    # tokens per context token a drafter GPU keeps up with 2,500 context tokens/s. By hand, 8 GPUs:
    #   configured 6 + 2: min(6 x 5000, 2 x 2500) = 5,000;  best split 3 + 5: min(15000, 12500) = 12,500
    #   (2 + 6: min(10000, 15000) = 10,000);  colocated: 8 / (1/5000 + 1/2500) = 13,333 -> the best layout
    cluster = _Node(name="8gpu", use_gpu=True, target_workers=6, drafter_workers=2, target_gpus=1.0, drafter_gpus=1.0,
                    target_tokens_per_gpu=5000.0, drafter_block_tokens_per_gpu=10000.0)
    cfg = SimpleNamespace(cluster=cluster, run=SimpleNamespace(dir="/nonexistent"),
                          model=SimpleNamespace(num_draft_layers=5))
    rep = capacity_report(cfg, {"tokens": 3_600_000, "block_tokens_per_token": 4.0})
    cap = rep["capacity"]
    assert cap["configured"]["tokens_per_second"] == 5000 and cap["drafter_tokens_per_gpu"] == 2500
    assert (cap["best"]["target"], cap["best"]["drafter"], cap["best"]["tokens_per_second"]) == (3, 5, 12500)
    assert cap["colocated"]["tokens_per_second"] == pytest.approx(8 / (1 / 5000 + 1 / 2500))
    assert cap["best_layout"] == "colocated" and cap["block_tokens_per_second"] == pytest.approx(4 * 8 / 0.0006)
    assert any("best split" in line and "3 target + 5 drafter" in line and "12,500 context tokens/s = 50,000 block"
               in line for line in rep["text"])
    # when the memory model puts a side over half a GPU, colocated is shown but the best layout is the split
    tight = capacity_report(cfg, {"tokens": 3_600_000, "block_tokens_per_token": 4.0}, colocated_fits=False)
    assert tight["capacity"]["best_layout"] == "split" and tight["capacity"]["tokens_per_second"] == 12500
    assert any("DOES NOT FIT" in line for line in tight["text"])
    # at the density of 512 anchors a 16K batch (0.56) the same GPUs lean the other way: the drafter keeps up
    # with 17,857 context tokens/s a GPU, the best split is 6 + 2 (min(30000, 35714))
    thin = capacity_report(cfg, {"tokens": 3_600_000, "block_tokens_per_token": 0.56})["capacity"]
    assert (thin["best"]["target"], thin["best"]["drafter"]) == (6, 2) and thin["best"]["tokens_per_second"] == 30000
    # one GPU shared by a target actor and a drafter worker: colocated is the only layout, and the configured one
    one = _Node(name="1gpu", use_gpu=True, target_workers=1, drafter_workers=1, target_gpus=0.5, drafter_gpus=0.5,
                target_tokens_per_gpu=5000.0, drafter_block_tokens_per_gpu=10000.0)
    rep1 = capacity_report(SimpleNamespace(cluster=one, run=cfg.run, model=cfg.model),
                           {"tokens": 3_600_000, "block_tokens_per_token": 4.0})
    assert rep1["capacity"]["best"] is None and rep1["capacity"]["configured"]["layout"] == "colocated"
    assert rep1["capacity"]["tokens_per_second"] == pytest.approx(1 / (1 / 5000 + 1 / 2500))
    assert "capacity model (1gpu: 1 GPU)" in rep1["text"][0]
    # the old key (context tokens/s of a drafter, meaningless without a density) is named with its successor
    with pytest.raises(UserError, match="cluster.drafter_block_tokens_per_gpu"):
        compose_config(["cluster.drafter_tokens_per_gpu=1000"])


class _Node(dict):
    __getattr__ = dict.__getitem__


def test_plan_command_prints_capacity(tmp_path, tiny_data, capsys):
    from dflash_ray.cli import main

    shards = next(o for o in tiny_data if o.startswith("data.shards="))
    assert main(["plan", "cluster=8gpu", shards, f"run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "capacity model (8gpu: 8 GPUs)" in out
    # no measured rates: the seed run's (6 target + 2 drafter GPUs at 25,300 context tokens/s, ~3.91 block
    # tokens per context token, drafter-bound) give T = 25300/6 context and D = 25300 x 3.91 / 2 block tokens/s
    # per GPU; this plan's density rho turns D into D / rho context tokens/s; min(t*T, (8-t)*D/rho) over t
    assert main(["plan", "cluster=8gpu", shards, f"run.dir={tmp_path}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rho = out["block_tokens_per_token"]
    t_rate, d_rate = 25300 / 6, 25300 * 3.91 / 2 / rho
    by_hand = max(min(t * t_rate, (8 - t) * d_rate) for t in range(1, 8))
    assert out["capacity"]["best"]["tokens_per_second"] == pytest.approx(by_hand)
    assert out["capacity"]["colocated"]["tokens_per_second"] == pytest.approx(8 / (1 / t_rate + 1 / d_rate))
    assert "seed-run estimate" in out["capacity"]["source"]
