"""Rollout: token sampling and the compiled static sampler."""

from dapo_jax.rollout.sampler import RolloutBatch, Sampler, generate
from dapo_jax.rollout.sampling import SamplingParams, sample_logits

__all__ = ["RolloutBatch", "Sampler", "SamplingParams", "generate", "sample_logits"]
