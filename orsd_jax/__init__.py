"""orsd_jax: Online Rubric Self-Distillation for LLM agents, in JAX and Flax NNX."""
