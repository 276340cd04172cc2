"""Choosing the bundle whose satisfaction best rank-correlates with the outcomes.

``rho_b = Spearman(S_b, R)`` with average ranks for ties: the Pearson correlation of the ranks,
undefined (NaN) when either side is constant or the bundle could not be verified (a NaN in
``S_b``). Modes: ``spearman`` takes the argmax (the first on ties), ``single`` takes the only
bundle, ``random`` picks uniformly among bundles with a defined correlation (the ablation that
keeps the candidates but drops the alignment).

A trajectory that no bundle could score (the verifier failed on its text, so every bundle has NaN
there) is left out of every correlation: the bundles are still ranked, all over the same
trajectories, so their correlations stay comparable. A NaN that only some bundles have is a fault
of that (trajectory, bundle) pair and leaves those bundles undefined, rather than letting each
bundle correlate over its own scored trajectories: correlations over different trajectories do
not compare, and one over two trajectories is +-1 by construction.

A group gets no rubric when no bundle is valid or no trajectory was scored, when its rewards are
constant over the scored trajectories (so it needs two scored trajectories with different
rewards), or when every correlation is undefined; ``reason`` says which. The paper keeps the
argmax whatever its sign, so a group whose best bundle ranks the episodes backwards still reads
it; ``min_correlation`` (off by default) withholds such a rubric.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MODES = ("spearman", "single", "random")


@dataclasses.dataclass(frozen=True)
class Selection:
    index: int | None  # the chosen bundle, None when the group gets no rubric
    correlations: np.ndarray  # float[K], NaN where undefined
    reason: str  # "" when a bundle was chosen


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x [n]``, ties sharing the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    # Boundaries of runs of equal values in sorted order.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x))
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2  # mean of ranks s+1 .. e
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho of two ``[n]`` vectors; NaN if either is constant or holds a NaN."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or np.isnan(a).any() or np.isnan(b).any():
        return float("nan")
    ra, rb = average_ranks(a) - (len(a) + 1) / 2, average_ranks(b) - (len(b) + 1) / 2
    denominator = np.sqrt(np.sum(ra * ra) * np.sum(rb * rb))
    return float(np.sum(ra * rb) / denominator) if denominator > 0 else float("nan")


def select_bundle(
    satisfaction: np.ndarray,
    rewards: np.ndarray,
    mode: str,
    rng: np.random.Generator,
    min_correlation: float | None = None,
) -> Selection:
    """``satisfaction [K, G]`` (NaN rows for invalid bundles, NaN columns for trajectories no
    bundle could score), ``rewards [G]``. Correlations are over the scored trajectories (see the
    module docstring). With ``min_correlation``, the ``spearman`` mode gives no rubric when the best
    correlation is below it."""
    if mode not in MODES:
        raise ValueError(f"unknown selection mode {mode!r}; expected one of {MODES}")
    rewards = np.asarray(rewards, float)
    satisfaction = np.asarray(satisfaction, float).reshape(-1, len(rewards))
    k = satisfaction.shape[0]
    if mode == "single" and k != 1:
        raise ValueError(f"mode 'single' takes exactly one bundle, got {k}")
    scored = ~np.isnan(satisfaction).all(axis=0)
    satisfaction, rewards = satisfaction[:, scored], rewards[scored]
    correlations = np.array([spearman(row, rewards) for row in satisfaction])
    defined = np.flatnonzero(~np.isnan(correlations))
    if k == 0 or not scored.any():
        return Selection(None, correlations, "no valid bundle")
    if np.ptp(rewards) == 0:
        return Selection(None, correlations, "constant rewards")
    if len(defined) == 0:
        return Selection(None, correlations, "no bundle with a defined correlation (constant satisfaction)")
    if mode == "random":
        return Selection(int(rng.choice(defined)), correlations, "")
    best = int(defined[np.argmax(correlations[defined])])
    if min_correlation is not None and correlations[best] < min_correlation:
        return Selection(None, correlations, "best correlation below the minimum")
    return Selection(best, correlations, "")
