"""Trajectories as compact text, for the rubric writer and for the verifier.

A trajectory is shown as the observations the agent acted on and the actions it took, step by
step. The observation that follows the last action is never shown, and neither are rewards: the
rubric writer must not see outcomes (WebShop's final page even prints the score). A trajectory
over its token budget keeps its first and last steps and says how many were left out between.
Headers carry no counts: on ALFWorld an episode shorter than the step limit is a win, so a step
count in a header would state the outcome; the steps themselves are the only evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from orsd_jax.rollout import Trajectory

MAX_OBSERVATION_CHARS = 300


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


SHOWN_ABOVE = "(the start shown above)"


def _step_lines(trajectory: Trajectory, start_shown: bool) -> list[str]:
    return [
        f"Step {k}: saw: {SHOWN_ABOVE if k == 1 and start_shown else _clip(step.observation, MAX_OBSERVATION_CHARS)}\n"
        f"        did: {step.action if step.action is not None else '(no valid action)'}"
        for k, step in enumerate(trajectory.steps, start=1)
    ]


def render_trajectory(
    trajectory: Trajectory, budget_tokens: int, count_tokens: Callable[[str], int], *, start_shown: bool = False
) -> str:
    """The trajectory's steps, cut in the middle to fit ``budget_tokens``; with ``start_shown`` the
    first observation is referred to, not repeated."""
    lines = _step_lines(trajectory, start_shown)
    text = "\n".join(lines)
    if count_tokens(text) <= budget_tokens:
        return text
    for keep in range(len(lines) - 1, 0, -1):
        head, tail = lines[: (keep + 1) // 2], lines[len(lines) - keep // 2 :]
        text = "\n".join([*head, f"... ({len(lines) - keep} steps left out) ...", *tail])
        if count_tokens(text) <= budget_tokens:
            return text
    return f"... ({len(lines)} steps left out) ..."


def render_group(trajectories: Sequence[Trajectory], budget_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The attempts one after another; a first observation common to all of them is shown once."""
    starts = {t.steps[0].observation if t.steps else None for t in trajectories}
    start = starts.pop() if len(starts) == 1 else None
    attempts = "\n\n".join(
        f"Attempt {i}:\n{render_trajectory(t, budget_tokens, count_tokens, start_shown=start is not None)}"
        for i, t in enumerate(trajectories, start=1)
    )
    return (
        attempts if start is None else f"Every attempt starts from: {_clip(start, MAX_OBSERVATION_CHARS)}\n\n{attempts}"
    )
