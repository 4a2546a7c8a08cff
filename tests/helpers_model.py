"""Shared by the model tests."""

# The tiny Qwen3 shape every model test builds on; each file sets its depth and tying.
TINY_QWEN3 = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256)
