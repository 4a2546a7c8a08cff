"""Shared by the model tests."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models: a second thread only adds contention on a shared 2-core machine (10x slower measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
