"""Shared by the model tests."""
import pytest
import torch

# The tiny Qwen3 shape every model test builds on; each file sets its depth and tying.
TINY_QWEN3 = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models: a second thread only adds contention on a shared 2-core machine (10x slower measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
