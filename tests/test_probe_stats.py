"""The probe's AUC against SciPy's Mann-Whitney U, and the cluster bootstrap's interval."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import mannwhitneyu

from orsd_jax.probe_stats import auc, bootstrap_auc, bootstrap_auc_difference, within_state_auc

# Small integers: many ties.
SCORES = st.lists(st.integers(-3, 3).map(float), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(SCORES, SCORES)
def test_auc_is_mann_whitney_u_over_the_pairs(pos, neg):
    u = mannwhitneyu(pos, neg, alternative="two-sided").statistic  # U of the first sample
    assert auc(pos, neg) == pytest.approx(u / (len(pos) * len(neg)))


def test_auc_on_continuous_scores_and_edge_cases():
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(0.5, 1, 500), rng.normal(0, 1, 700)
    assert auc(pos, neg) == pytest.approx(mannwhitneyu(pos, neg).statistic / (500 * 700))
    assert auc([1.0, 2.0], [0.0]) == 1.0 and auc([0.0], [1.0, 2.0]) == 0.0 and auc([1.0], [1.0]) == 0.5
    assert np.isnan(auc([], [1.0])) and np.isnan(auc([1.0], []))
    with pytest.raises(ValueError, match="NaN"):
        auc([float("nan")], [1.0])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 2), st.booleans(), st.integers(0, 3)), min_size=1, max_size=25))
def test_within_state_auc_counts_only_pairs_of_one_state(items):
    scores, labels, states = (list(column) for column in zip(*items))
    pairs = [(p, n) for p, n in itertools.product(items, items) if p[1] and not n[1] and p[2] == n[2]]
    got = within_state_auc(scores, labels, states)
    if not pairs:
        assert np.isnan(got)
    else:
        assert got == pytest.approx(np.mean([(p[0] > n[0]) + 0.5 * (p[0] == n[0]) for p, n in pairs]))


def test_within_state_auc_removes_a_shift_between_states():
    """State 'b' scores everything 10 higher: pooled pairs mix the states, within-state pairs do not."""
    scores = [1.0, 0.0, 11.0, 10.0, 10.5]
    labels = [True, False, True, False, False]
    states = ["a", "a", "b", "b", "b"]
    assert within_state_auc(scores, labels, states) == 1.0
    assert auc([1.0, 11.0], [0.0, 10.0, 10.5]) < 1.0


def test_bootstrap_resamples_whole_clusters_by_hand():
    """Three games; the resamples are redone here by concatenating the drawn games' items."""
    games = {"g1": ([0.9, 0.2], [True, False]), "g2": ([0.4, 0.4, 0.1], [True, False, False]), "g3": ([0.3], [True])}
    scores = [s for g in games.values() for s in g[0]]
    labels = [lab for g in games.values() for lab in g[1]]
    clusters = [name for name, g in games.items() for _ in g[0]]
    point, lo, hi = bootstrap_auc(scores, labels, clusters, n_boot=7, seed=5)

    draws = np.random.default_rng(5).integers(3, size=(7, 3))
    by_hand = []
    for draw in draws:
        items = [item for c in draw for item in zip(*games[f"g{c + 1}"])]
        pos, neg = [s for s, lab in items if lab], [s for s, lab in items if not lab]
        if pos and neg:
            by_hand.append(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))
    assert point == pytest.approx(auc([0.9, 0.4, 0.3], [0.2, 0.4, 0.1]))
    assert (lo, hi) == pytest.approx(tuple(np.percentile(by_hand, [2.5, 97.5])))


def test_paired_difference_resamples_both_scores_with_the_same_games_by_hand():
    """Two scores of the same items: each resample's difference is redone here by concatenating
    the drawn games' items, both AUCs from the same draw."""
    games = {
        "g1": ([0.9, 0.2], [0.1, 0.3], [True, False]),
        "g2": ([0.4, 0.4, 0.1], [0.5, 0.2, 0.6], [True, False, False]),
        "g3": ([0.3, 0.8], [0.7, 0.0], [True, False]),
    }
    first, second, labels = ([x for g in games.values() for x in g[k]] for k in range(3))
    clusters = [name for name, g in games.items() for _ in g[0]]
    diff, lo, hi = bootstrap_auc_difference(first, second, labels, clusters, n_boot=9, seed=2)

    def hand_auc(items):
        pos, neg = [s for s, lab in items if lab], [s for s, lab in items if not lab]
        return np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]) if pos and neg else None

    by_hand = []
    for draw in np.random.default_rng(2).integers(3, size=(9, 3)):
        picked = [games[f"g{c + 1}"] for c in draw]
        a = hand_auc([i for g in picked for i in zip(g[0], g[2])])
        b = hand_auc([i for g in picked for i in zip(g[1], g[2])])
        if a is not None:
            by_hand.append(a - b)
    pos = np.array(labels)
    assert diff == pytest.approx(
        auc(np.array(first)[pos], np.array(first)[~pos]) - auc(np.array(second)[pos], np.array(second)[~pos])
    )
    assert (lo, hi) == pytest.approx(tuple(np.percentile(by_hand, [2.5, 97.5])))
    # The same scores twice differ by exactly nothing, in every resample.
    assert bootstrap_auc_difference(first, first, labels, clusters, n_boot=20) == (0.0, 0.0, 0.0)


def _games(n_games: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Six steps per game, a game effect shared by its steps, positives shifted up by 0.7."""
    labels = rng.random((n_games, 6)) < 0.4
    scores = rng.normal(0, 1, (n_games, 1)) + rng.normal(0, 1, (n_games, 6)) + 0.7 * labels
    return scores.ravel(), labels.ravel(), np.repeat(np.arange(n_games), 6)


def test_bootstrap_interval_holds_the_estimate_and_shrinks_with_more_games():
    widths = []
    for n_games in (20, 80, 320):
        point, lo, hi = bootstrap_auc(*_games(n_games, np.random.default_rng(n_games)), n_boot=400, seed=0)
        assert lo <= point <= hi and 0.5 < point < 1
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    assert widths[2] < 0.6 * widths[0]


def test_bootstrap_is_reproducible_and_perfect_separation_has_no_width():
    data = _games(30, np.random.default_rng(1))
    assert bootstrap_auc(*data, n_boot=200, seed=3) == bootstrap_auc(*data, n_boot=200, seed=3)
    assert bootstrap_auc(*data, n_boot=200, seed=3) != bootstrap_auc(*data, n_boot=200, seed=4)
    scores, labels, clusters = data
    assert bootstrap_auc(labels.astype(float), labels, clusters, n_boot=50) == (1.0, 1.0, 1.0)


def test_bootstrap_leaves_out_resamples_without_both_classes():
    """Game a holds the only positives and b the only negatives: a resample of a twice has no AUC."""
    point, lo, hi = bootstrap_auc([1.0, 0.0], [True, False], ["a", "b"], n_boot=50, seed=0)
    assert (point, lo, hi) == (1.0, 1.0, 1.0)
    point, lo, hi = bootstrap_auc([1.0, 2.0], [True, True], ["a", "b"], n_boot=10)
    assert np.isnan(point) and np.isnan(lo) and np.isnan(hi)
    with pytest.raises(ValueError, match="2 scores, 2 labels and 1 clusters"):
        bootstrap_auc([1.0, 2.0], [True, False], ["a"])
