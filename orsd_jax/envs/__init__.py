"""Text environments (ALFWorld, WebShop), the shared answer parser and the worker pool."""

from orsd_jax.envs.actions import ParsedAction, parse_action
from orsd_jax.envs.base import EnvStep, Task, TextEnv
from orsd_jax.envs.pool import EnvPool, EnvWorkerError

__all__ = ["EnvPool", "EnvStep", "EnvWorkerError", "ParsedAction", "Task", "TextEnv", "parse_action"]
