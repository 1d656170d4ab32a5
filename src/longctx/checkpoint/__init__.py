"""Reshardable, crash-safe checkpoints (PyTorch Distributed Checkpoint underneath)."""
