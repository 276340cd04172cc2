"""Credit-aware selection (``--selection gap-alignment``): keep the candidate whose gap ranks the
group's episodes as their returns do.

The paper selects the bundle whose verified *satisfaction* rank-correlates with the outcomes, and
names the limitation: that favours rubrics that separate stronger trajectories without targeting
their use as credit inside a trajectory. This mode measures the use directly: every step of the
group is replayed with each valid candidate inserted (one packed row per step: the shared prompt
prefix, one branch per candidate and one without, ``probe.branch_logprobs``, the training
forward), each trajectory's mean per-token gap is computed, and the candidate whose gaps
rank-correlate best (Spearman) with the returns is kept. It costs one replay forward per step
over ``K + 1`` branches (``time/selection_replay``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from orsd_jax import chat
from orsd_jax.probe import branch_logprobs
from orsd_jax.rollout import Group
from orsd_jax.rubrics.generate import rubric_insert
from orsd_jax.rubrics.parse import ParsedBundle
from orsd_jax.rubrics.select import Selection, spearman


def trajectory_gaps(
    model,
    group: Group,
    bundles: Sequence[ParsedBundle],
    fmt: chat.ChatFormat,
    tokenizer,
    *,
    temperature: float,
    chunk_size: int = 64,
) -> np.ndarray:
    """``float[K, G]``: each trajectory's mean (over its steps) of the step's mean token gap under
    each candidate; NaN rows for invalid candidates."""
    valid = [k for k, b in enumerate(bundles) if b.valid]
    out = np.full((len(bundles), len(group.trajectories)), np.nan)
    if not valid:
        return out
    tail = list(fmt.tail)
    inserts = [chat.encode(tokenizer, rubric_insert(bundles[k].criteria)) for k in valid]
    rows, owner = [], []
    for t, traj in enumerate(group.trajectories):
        for step in traj.steps:
            response = list(step.response_ids)
            branches = [(insert + tail, response) for insert in inserts] + [(tail, response)]
            rows.append((list(step.prompt_ids[: -len(tail)]), branches))
            owner.append(t)
    scored = branch_logprobs(
        model, rows, temperature=temperature, chunk_size=chunk_size, branch_multiple=len(valid) + 1
    )
    step_gaps = np.array(
        [[float(np.mean(logp[i] - logp[-1])) for i in range(len(valid))] for logp in scored]
    )  # [S, K']
    owners = np.array(owner)
    for i, k in enumerate(valid):
        out[k] = [step_gaps[owners == t, i].mean() for t in range(len(group.trajectories))]
    return out


def select_by_gap(gaps: np.ndarray, returns: np.ndarray) -> Selection:
    """The candidate whose trajectory gaps ``[K, G]`` best rank-correlate with ``returns [G]``;
    no rubric when the returns are constant or no candidate's correlation is defined."""
    correlations = np.array([spearman(row, returns) for row in gaps])
    if np.all(np.isnan(gaps)):
        return Selection(None, correlations, "no valid bundle")
    if np.ptp(returns) == 0:
        return Selection(None, correlations, "constant rewards")
    defined = np.flatnonzero(~np.isnan(correlations))
    if not len(defined):
        return Selection(None, correlations, "no bundle with a defined correlation (constant gaps)")
    return Selection(int(defined[np.argmax(correlations[defined])]), correlations, "")
