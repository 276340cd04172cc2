"""How hard generated games are: room size, clutter, hidden objects and the task-type mix."""

from __future__ import annotations

import dataclasses

from orsd_jax.envs.alfworld.tasks import TASK_TYPES


@dataclasses.dataclass(frozen=True)
class Difficulty:
    """Settings of the procedural generator.

    ``receptacles``: (min, max) receptacles kept from the scene, the ones the task needs included;
    None keeps the whole scene, as the official games do.
    ``distractors``: (min, max) objects besides the task's targets; None fills the room like
    ALFRED does, with every pickupable class of the scene present 1-3 times.
    ``target_instances``: (min, max) copies of the object to find (pick two: at least 2).
    ``target_placement``: where the task's objects start: ``visible`` (on open surfaces only),
    ``any`` receptacle, or ``hidden`` (inside closed containers whenever the room has one that
    can hold them).
    ``closed_goal``: whether the receptacle to put things in may be a closed container.
    ``task_weights``: relative share of each task type, in ``TASK_TYPES`` order.
    """

    name: str
    receptacles: tuple[int, int] | None
    distractors: tuple[int, int] | None
    target_instances: tuple[int, int]
    target_placement: str
    closed_goal: bool
    task_weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.target_placement not in ("visible", "any", "hidden"):
            raise ValueError(f"target_placement must be visible, any or hidden, got {self.target_placement!r}")
        if len(self.task_weights) != len(TASK_TYPES) or min(self.task_weights) < 0 or sum(self.task_weights) <= 0:
            raise ValueError(f"task_weights needs {len(TASK_TYPES)} non-negative weights, got {self.task_weights}")
        for name, bounds in (("receptacles", self.receptacles), ("distractors", self.distractors)):
            if bounds is not None and not 0 <= bounds[0] <= bounds[1]:
                raise ValueError(f"{name} must be None or (min, max) with 0 <= min <= max, got {bounds}")
        if not 1 <= self.target_instances[0] <= self.target_instances[1]:
            raise ValueError(f"target_instances must be (min, max) with 1 <= min <= max, got {self.target_instances}")


EASY = Difficulty(
    "easy",
    receptacles=(3, 5),
    distractors=(0, 2),
    target_instances=(1, 1),
    target_placement="visible",
    closed_goal=False,
    task_weights=(2, 2, 1, 1, 1, 1),
)
STANDARD = Difficulty(
    "standard",
    receptacles=None,
    distractors=None,
    target_instances=(1, 3),
    target_placement="any",
    closed_goal=True,
    task_weights=(1, 1, 1, 1, 1, 1),
)
HARD = Difficulty(
    "hard",
    receptacles=None,
    distractors=None,
    target_instances=(1, 2),
    target_placement="hidden",
    closed_goal=True,
    task_weights=(1, 1, 2, 2, 2, 2),
)
PRESETS = {d.name: d for d in (EASY, STANDARD, HARD)}


def get_difficulty(name: str | Difficulty) -> Difficulty:
    if isinstance(name, Difficulty):
        return name
    if name not in PRESETS:
        raise ValueError(f"unknown difficulty {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]
