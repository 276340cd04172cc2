"""From played groups to the replay's step samples: one per step, with its advantage and its
group's rubric insert (the with-rubric branch's extra context)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from orsd_jax import chat
from orsd_jax.batch import StepSample
from orsd_jax.rollout import Group
from orsd_jax.rubrics import GroupRubric, rubric_insert


class StepKey(NamedTuple):
    """Where a step sample came from: group, trajectory and step of an update (a tuple, so it
    saves as a row of integers)."""

    group: int
    trajectory: int
    step: int


def step_samples(
    groups: Sequence[Group],
    advantages: Sequence[Sequence[np.ndarray]],
    rubrics: Sequence[GroupRubric] | None,
    fmt: chat.ChatFormat,
    tokenizer,
) -> tuple[list[StepSample], list[StepKey]]:
    """Every step sample with its advantage (``advantages[g][t][s]``) and its group's rubric
    insert (none when the group has no rubric); and where each came from."""
    samples, index = [], []
    tail = len(fmt.tail)
    for g, group in enumerate(groups):
        criteria = rubrics[g].criteria if rubrics else None
        insert = tuple(chat.encode(tokenizer, rubric_insert(criteria))) if criteria else ()
        for t, traj in enumerate(group.trajectories):
            for s, step in enumerate(traj.steps):
                samples.append(
                    StepSample(
                        prefix=step.prompt_ids[:-tail],
                        tail=step.prompt_ids[-tail:],
                        response=step.response_ids,
                        old_logprobs=step.logprobs,
                        advantage=float(advantages[g][t][s]),
                        insert=insert,
                    )
                )
                index.append(StepKey(g, t, s))
    return samples, index
