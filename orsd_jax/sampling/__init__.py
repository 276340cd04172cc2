"""Samplers: a vLLM server process, or an in-process JAX decoder, behind one interface."""

from orsd_jax.sampling.base import Completion, Sampler, SamplingError, SamplingParams, validate_prompts

__all__ = ["Completion", "Sampler", "SamplingError", "SamplingParams", "validate_prompts"]
