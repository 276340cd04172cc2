"""Statistics for the credit probe: does a score rank expert-consistent steps above the others?

``auc`` is the probability that a positive's score exceeds a negative's, ties counting 1/2: the
Mann-Whitney U statistic over ``n_pos * n_neg``. Steps of one game are not independent (one
rubric, one policy state), so ``bootstrap_auc`` resamples whole clusters (games) with
replacement and reports a 95% percentile interval. ``within_state_auc`` counts only pairs that
share a state, which removes what differs between states (the step's position, the game) from
the comparison.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

CONFIDENCE = 0.95


def _weighted_auc(pos: np.ndarray, neg: np.ndarray, pos_w: np.ndarray, neg_w: np.ndarray) -> float:
    """``sum_{p,n} w_p w_n ([s_p > s_n] + [s_p = s_n] / 2) / (sum w_p * sum w_n)``, in O(n log n)."""
    total = pos_w.sum() * neg_w.sum()
    if total <= 0:
        return float("nan")
    order = np.argsort(neg, kind="stable")
    neg, cum = neg[order], np.r_[0.0, np.cumsum(neg_w[order])]
    below = cum[np.searchsorted(neg, pos, side="left")]  # weight of negatives scored below each positive
    at_or_below = cum[np.searchsorted(neg, pos, side="right")]
    return float(np.sum(pos_w * (below + at_or_below)) / 2 / total)


def _codes(values: Sequence[Hashable]) -> np.ndarray:
    """0, 1, ... for the distinct values of ``values``, in order of first appearance."""
    index: dict[Hashable, int] = {}
    return np.array([index.setdefault(v, len(index)) for v in values], dtype=np.int64)


def _scores(values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, float).reshape(-1)
    if np.isnan(array).any():
        raise ValueError("scores hold NaN: an AUC needs every score ordered")
    return array


def auc(positive_scores: Sequence[float] | np.ndarray, negative_scores: Sequence[float] | np.ndarray) -> float:
    """P(positive > negative) + P(tie) / 2 over all pairs; NaN when either side is empty."""
    pos, neg = _scores(positive_scores), _scores(negative_scores)
    return _weighted_auc(pos, neg, np.ones(len(pos)), np.ones(len(neg)))


def within_state_auc(
    scores: Sequence[float] | np.ndarray, labels: Sequence[bool] | np.ndarray, states: Sequence[Hashable]
) -> float:
    """The AUC over (positive, negative) pairs of the same state only, every such pair weighing
    the same; NaN when no state has both a positive and a negative."""
    scores, labels = _scores(scores), np.asarray(labels, bool).reshape(-1)
    if not len(scores) == len(labels) == len(states):
        raise ValueError(f"{len(scores)} scores, {len(labels)} labels and {len(states)} states")
    state_ids = _codes(states)
    favourable = pairs = 0.0
    for s in range(int(state_ids.max(initial=-1)) + 1):
        here = state_ids == s
        pos, neg = scores[here & labels], scores[here & ~labels]
        if len(pos) and len(neg):
            favourable += auc(pos, neg) * len(pos) * len(neg)
            pairs += len(pos) * len(neg)
    return favourable / pairs if pairs else float("nan")


def _resampled_aucs(
    scores: np.ndarray, labels: np.ndarray, clusters: Sequence[Hashable], n_boot: int, seed: int
) -> tuple[float, np.ndarray]:
    """The AUC of ``scores`` and its ``n_boot`` cluster resamples (NaN where a resample lacks a
    class), each resample drawn as ``bootstrap_auc`` says: for one seed and one set of clusters,
    the same draws whatever the scores, so two scores' resamples pair up."""
    if not len(scores) == len(labels) == len(clusters):
        raise ValueError(f"{len(scores)} scores, {len(labels)} labels and {len(clusters)} clusters")
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    cluster_ids = _codes(clusters)
    n_clusters = int(cluster_ids.max()) + 1 if len(cluster_ids) else 0
    pos, neg = scores[labels], scores[~labels]
    point = auc(pos, neg)
    if n_clusters == 0:
        return point, np.full(n_boot, np.nan)
    draws = np.random.default_rng(seed).integers(n_clusters, size=(n_boot, n_clusters))
    pos_cluster, neg_cluster = cluster_ids[labels], cluster_ids[~labels]
    resampled = []
    for draw in draws:
        times = np.bincount(draw, minlength=n_clusters).astype(float)  # draws of each cluster
        resampled.append(_weighted_auc(pos, neg, times[pos_cluster], times[neg_cluster]))
    return point, np.asarray(resampled)


def _interval(resampled: np.ndarray) -> tuple[float, float]:
    """The 95% percentile interval of the finite resamples (NaN when none is)."""
    finite = resampled[np.isfinite(resampled)]
    if not len(finite):
        return float("nan"), float("nan")
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(finite, [tail, 100 - tail])
    return float(lo), float(hi)


def bootstrap_auc(
    scores: Sequence[float] | np.ndarray,
    labels: Sequence[bool] | np.ndarray,
    clusters: Sequence[Hashable],
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(AUC, lower, upper): the AUC of ``scores`` with ``labels`` (True: positive) and its 95%
    percentile interval from ``n_boot`` cluster resamples.

    Resample ``b`` draws ``C`` clusters with replacement (the ``C`` distinct values of
    ``clusters``, numbered in order of first appearance), ``draws[b]`` of
    ``draws = np.random.default_rng(seed).integers(C, size=(n_boot, C))``, and weighs every item
    by the number of times its cluster was drawn. Resamples without a positive
    or without a negative have no AUC and are left out of the percentiles (``np.percentile``'s
    linear interpolation); the interval is NaN when none is left.
    """
    point, resampled = _resampled_aucs(_scores(scores), np.asarray(labels, bool).reshape(-1), clusters, n_boot, seed)
    return (point, *_interval(resampled))


def bootstrap_auc_difference(
    first: Sequence[float] | np.ndarray,
    second: Sequence[float] | np.ndarray,
    labels: Sequence[bool] | np.ndarray,
    clusters: Sequence[Hashable],
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(AUC(first) - AUC(second), lower, upper): two scores of the same items, the interval from
    the same cluster resamples for both (``bootstrap_auc``'s), so what the items share cancels."""
    labels = np.asarray(labels, bool).reshape(-1)
    a, resampled_a = _resampled_aucs(_scores(first), labels, clusters, n_boot, seed)
    b, resampled_b = _resampled_aucs(_scores(second), labels, clusters, n_boot, seed)
    return (a - b, *_interval(resampled_a - resampled_b))
