"""Whether the cluster can place the configured split (runtime/cluster.py check_resources): one line naming
what it lacks, before training."""
from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_check_resources_names_what_the_cluster_lacks(ray_session):
    """A split the cluster cannot place stops with one line before training, instead of hanging."""
    from types import SimpleNamespace

    from dflash_ray.errors import UserError
    from dflash_ray.runtime.cluster import check_resources

    fits = SimpleNamespace(use_gpu=False, target_workers=1, drafter_workers=2, target_resource="target_slot",
                           target_gpus=1.0, drafter_gpus=1.0)
    check_resources(fits)  # the shared test cluster: 4 CPUs, 2 target slots
    with pytest.raises(UserError, match="CPUs but cluster.drafter_workers = 6"):
        check_resources(SimpleNamespace(**{**vars(fits), "drafter_workers": 6}))
    with pytest.raises(UserError, match="of resource 'target_slot' but cluster.target_workers = 3"):
        check_resources(SimpleNamespace(**{**vars(fits), "target_workers": 3}))
    with pytest.raises(UserError, match="GPUs but cluster.target_workers"):
        check_resources(SimpleNamespace(**{**vars(fits), "use_gpu": True}))
    # one GPU shared: 1 x 0.5 + 1 x 0.5 = 1 GPU (this test cluster has none, so the sum is what it names)
    one_gpu = SimpleNamespace(**{**vars(fits), "use_gpu": True, "drafter_workers": 1, "target_gpus": 0.5,
                                 "drafter_gpus": 0.5})
    with pytest.raises(UserError, match=r"= 1 x 0.5 \+ 1 x 0.5 = 1$"):
        check_resources(one_gpu)


def test_one_gpu_holds_a_target_actor_and_a_drafter_worker_at_half_shares(monkeypatch):
    """cluster=1gpu on a one-GPU node: 0.5 + 0.5 fits; whole-GPU shares (the 8-GPU options') do not."""
    import ray

    from dflash_ray.config import compose_config
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.cluster import check_resources
    from omegaconf import OmegaConf

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 1.0, "CPU": 8.0})
    one = OmegaConf.to_object(compose_config(["cluster=1gpu"]).cluster)
    assert (one.target_workers, one.drafter_workers, one.target_gpus, one.drafter_gpus) == (1, 1, 0.5, 0.5)
    check_resources(one)
    with pytest.raises(UserError, match="= 2$"):
        check_resources(SimpleNamespace(**{**vars(one), "target_gpus": 1.0, "drafter_gpus": 1.0}))
