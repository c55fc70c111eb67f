"""Checkpoint I/O: Hugging Face safetensors (weights) and Orbax (train state)."""

from dapo_jax.checkpoints.hf import CheckpointError, load_pretrained, save_pretrained
