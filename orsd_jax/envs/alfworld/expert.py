"""Expert labels of ALFWorld steps, from the engine's own planner on the live game state.

An engine made with ``make_engine(plan=True)`` replans from the current state after every reset
and step (TextWorld's ``policy_commands``: Fast Downward on the game's PDDL state). Let ``d(s)`` be
the length of that plan, 0 once the game is won. An action ``a`` taken in state ``s`` and leading
to ``s'`` is **expert-consistent** iff ``d(s') = d(s) - 1``.

Why this definition: for optimal plans, ``d(s') >= d(s) - 1`` always (``a`` followed by a plan from
``s'`` is a plan from ``s``), so ``d(s') = d(s) - 1`` holds exactly when ``a`` starts *some*
shortest plan from ``s``. It therefore accepts every optimal action, not only the one the planner
happened to list first: ALFWorld ties often (which of two objects to fetch first, whether to
switch the lamp on before or after fetching the object), and an agent should not be marked wrong
for breaking a tie the other way. A command the engine refuses ("Nothing happens.") leaves the
state, hence ``d``, unchanged and is never consistent; a detour to a place the task does not
need leaves ``d`` unchanged (any place is one ``go to`` from any other) and is not consistent
either, while the step that returns to a shortest path is consistent again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from orsd_jax.envs.base import Task


@dataclasses.dataclass(frozen=True)
class ExpertLabel:
    """One step: the action and the engine's plans from the states before and after it."""

    action: str
    plan_before: tuple[str, ...] | None  # None: the planner found no plan from that state
    plan_after: tuple[str, ...] | None  # () once the game is won

    @property
    def consistent(self) -> bool:
        """``d(s') = d(s) - 1``: the action starts a shortest plan from the state it was taken in."""
        if self.plan_before is None or self.plan_after is None:
            return False
        return len(self.plan_after) == len(self.plan_before) - 1

    @property
    def planned(self) -> bool:
        """The action is the first command of the engine's own plan (a stricter label)."""
        return bool(self.plan_before and self.plan_before[0] == self.action)


def expert_plan(state) -> tuple[str, ...] | None:
    """The plan from a state of a ``make_engine(plan=True)`` engine: () when the game is won,
    None when the planner found none."""
    if state["won"]:
        return ()
    return tuple(state["policy_commands"]) or None


def label_actions(engine, task: Task, actions: Sequence[str]) -> list[ExpertLabel]:
    """Plays ``actions`` on ``task`` from its start in ``engine`` (a ``make_engine(plan=True)``)
    and labels each one; the actions after the step that wins the game are not played."""
    engine.load(task.key)
    plan = expert_plan(engine.reset())
    labels = []
    for action in actions:
        state, _, _ = engine.step(action)
        labels.append(ExpertLabel(action, plan, after := expert_plan(state)))
        plan = after
        if state["won"]:
            break
    return labels


def label_episodes(episodes: Sequence[tuple[Task, Sequence[str]]]) -> list[list[bool]]:
    """Per episode ``(task, actions played)``, each step's ``consistent`` label (an action after the
    winning step, which the engine does not play, is not consistent), on one planning engine."""
    from orsd_jax.envs.alfworld.engine import make_engine

    engine = make_engine(plan=True)
    out = []
    for task, actions in episodes:
        labels = [label.consistent for label in label_actions(engine, task, actions)]
        out.append(labels + [False] * (len(actions) - len(labels)))
    return out


def label_groups(groups) -> list[list[list[bool]]]:
    """``label_episodes`` of every trajectory of ``rollout.Group``s: per group, per trajectory, per step."""
    flat = iter(label_episodes([(g.task, [s.action or "" for s in t.steps]) for g in groups for t in g.trajectories]))
    return [[next(flat) for _ in g.trajectories] for g in groups]
