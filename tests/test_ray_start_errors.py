"""A Ray that does not start or cannot be reached is one line naming what happened and what to do (exit 2
through the CLI's UserError), not Ray's traceback. ray.init is replaced by one that raises what Ray 2.60
raises (its node-startup timeout is a bare Exception); nothing starts, the session's Ray is untouched."""
import pytest
import ray

from dflash_ray.config import ClusterConfig
from dflash_ray.errors import UserError
from dflash_ray.runtime.cluster import ray_cluster

TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
           "startup or the GCS has become overloaded.")


@pytest.fixture
def failing_init(monkeypatch):
    calls = {"shutdown": 0}

    def init(**kwargs):
        calls["init"] = kwargs
        raise Exception(TIMEOUT + "\nmore lines of Ray's own")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_a_local_ray_that_times_out_is_one_line_with_what_to_do(failing_init):
    with pytest.raises(UserError) as e:
        with ray_cluster(ClusterConfig(num_cpus=4, target_workers=1)):
            pass
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("a local Ray did not start (The current node timed out during startup.")
    assert "scripts/ray-start.sh --head --num-cpus 4 --resources '{\"target_slot\": 1.0}'" in msg
    assert "cluster.address=auto" in msg and failing_init["shutdown"] == 1


def test_an_unreachable_cluster_names_its_address(failing_init):
    with pytest.raises(UserError, match=r"^could not connect to Ray at 10\.0\.0\.9:6379 \(The current node"):
        with ray_cluster(ClusterConfig(address="10.0.0.9:6379")):
            pass
