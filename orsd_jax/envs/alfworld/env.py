"""``AlfworldEnv``: one ALFWorld game at a time on the real engine, as verl-agent plays it.

Reward is verl-agent's text-mode reward, 10 on the winning step and 0 otherwise; an episode ends
when the game is won or after ``max_steps`` commands (50 in verl-agent), unparseable answers
included: the rollout sends ``""`` for those, which the engine answers with "Nothing happens."
and which still uses up a step, as TextWorld's step limit counts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orsd_jax.envs.alfworld.data import GameDataError
from orsd_jax.envs.alfworld.engine import make_engine
from orsd_jax.envs.base import EnvStep, Task

if TYPE_CHECKING:
    import textworld

WIN_REWARD = 10.0
MAX_STEPS = 50


class AlfworldEnv:
    """Plays ``Task``s whose ``key`` is a ``game.tw-pddl`` path.

    The engine starts on the first ``reset``; pickling keeps only the settings, so the class
    (or a ``functools.partial`` of it) can be sent to spawned worker processes.
    """

    def __init__(self, max_steps: int = MAX_STEPS):
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self.max_steps = max_steps
        self._engine: textworld.core.Wrapper | None = None
        self._loaded: str | None = None  # game file currently in the engine
        self._task: Task | None = None
        self._steps = 0
        self._done = True

    def __getstate__(self) -> dict:
        return {"max_steps": self.max_steps}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, **state)

    def reset(self, task: Task) -> EnvStep:
        if task.env != "alfworld":
            raise ValueError(f"AlfworldEnv cannot play a {task.env!r} task")
        if self._engine is None:
            self._engine = make_engine()
        if task.key != self._loaded:
            self._loaded = None  # a failed load must not look like a loaded game
            try:
                self._engine.load(task.key)
            except (OSError, ValueError, KeyError) as err:
                raise GameDataError(f"cannot load the ALFWorld game {task.key}: {err!r}") from err
            self._loaded = task.key
        state = self._engine.reset()
        self._task, self._steps, self._done = task, 0, False
        return self._env_step(state, reward=0.0)

    def step(self, action: str) -> EnvStep:
        if self._task is None:
            raise RuntimeError("step() before reset(): no game is loaded")
        if self._done:
            raise RuntimeError(
                f"the episode of {self._task.key} is over (won or {self.max_steps} steps); call reset() first"
            )
        if not isinstance(action, str):
            raise TypeError(f'action must be a string ("" for no valid action), got {type(action).__name__}')
        assert self._engine is not None  # started by the reset() that set self._task
        state, _, _ = self._engine.step(action)
        self._steps += 1
        return self._env_step(state, reward=WIN_REWARD if state["won"] else 0.0)

    def _env_step(self, state, reward: float) -> EnvStep:
        assert self._task is not None  # reset() sets it before the first _env_step
        won = bool(state["won"])
        self._done = won or self._steps >= self.max_steps
        return EnvStep(
            observation=state.feedback,
            admissible_actions=tuple(a for a in state["admissible_commands"] if a != "help"),
            reward=reward,
            done=self._done,
            won=won,
            score=1.0 if won else 0.0,
            info={"gamefile": self._task.key, "task_type": self._task.task_type, "steps": self._steps},
        )

    def close(self) -> None:
        self._engine = None  # the planner library stays loaded: TextWorld never unloads it
        self._loaded = self._task = None
        self._done = True
