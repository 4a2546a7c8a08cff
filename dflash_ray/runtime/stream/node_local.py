"""Ray Train's DataConfig for the run's stream.

Ray Train calls `configure` each time the worker group starts, with the nodes the workers landed on:
exactly what the node-local streams need (pipeline.DatasetFactory.splits builds them). Ray Train requires
a dataset under the name "train"; the one it hands to `configure` is a placeholder that never runs.
"""
from __future__ import annotations

from ray.train import DataConfig


class NodeLocalDataConfig(DataConfig):
    def __init__(self, factory, execution_options):
        super().__init__(execution_options=execution_options)
        self.factory = factory

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        return self.factory.splits(world_size, worker_node_ids)
