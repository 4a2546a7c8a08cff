"""Training: the worker loop, the optimizer step, the TorchTrainer and the checkpoint manager."""
