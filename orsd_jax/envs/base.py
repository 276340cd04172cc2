"""What every text environment gives the rollout loop.

An environment is a plain object with ``reset(task) -> EnvStep`` and ``step(action) -> EnvStep``.
It knows nothing about tokens, prompts or models; prompt builders and the action parser live
beside it (``prompts.py`` of each environment, ``orsd_jax.envs.actions``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class Task:
    """One playable task. ``key`` identifies it exactly (a game file, a goal index)."""

    env: str  # "alfworld" | "webshop"
    key: str
    task_type: str  # ALFWorld: pick, look, clean, heat, cool, pick2; WebShop: the product category
    description: str  # the task sentence shown to the agent


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """The result of a reset or a step.

    ``observation`` is the raw text the environment returned for this transition (the GiGPO
    anchor state); ``admissible_actions`` are the commands the prompt lists.
    ``reward`` is the training reward of this transition as verl-agent defines it (10 on the step
    that wins the task, else 0); ``score`` the task score so far in [0, 1] (ALFWorld: won;
    WebShop: the purchase reward); ``won`` the task's success flag.
    """

    observation: str
    admissible_actions: tuple[str, ...]
    reward: float = 0.0
    done: bool = False
    won: bool = False
    score: float = 0.0
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class TextEnv(Protocol):
    def reset(self, task: Task) -> EnvStep: ...

    def step(self, action: str) -> EnvStep: ...

    def close(self) -> None: ...
