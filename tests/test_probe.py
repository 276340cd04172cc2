"""The credit probe's pieces: rows of branches sharing a prefix (by hand, and scored against plain
forwards and against the training loss's own packed batch), token classes, and the summary."""

import dataclasses

import numpy as np
import pytest
from flax import nnx
from helpers import CONFIG, sequence_logprobs, tiny_model

from orsd_jax.batch import PAD, StepSample, build_batch
from orsd_jax.loss import response_logprobs
from orsd_jax.probe import (
    ACTION,
    FORMAT,
    OTHER,
    ProbeState,
    ProbeStep,
    branch_logprobs,
    pack_branches,
    summarise,
    token_classes,
)
from orsd_jax.probe_stats import auc


def test_pack_branches_by_hand():
    rows = pack_branches([([11, 12], [([21], [31, 32]), ([], [33])])], seq_multiple=8, response_multiple=4)
    np.testing.assert_array_equal(rows.tokens[0], [11, 12, 21, 31, 32, 33, 0, 0])
    np.testing.assert_array_equal(rows.positions[0], [0, 1, 2, 3, 4, 2, 0, 0])
    # The prefix's subtree is the row; each branch's, the rest of the branch.
    np.testing.assert_array_equal(rows.reach[0], [5, 5, 4, 4, 4, 5, PAD, PAD])
    # Branch 1: 31 is predicted by 21 (row 2), 32 by 31 (row 3). Branch 2 has no context: 33 is
    # predicted by the prefix's last token (row 1).
    np.testing.assert_array_equal(rows.index[0], [[2, 3, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(rows.targets[0], [[31, 32, 0, 0], [33, 0, 0, 0]])
    np.testing.assert_array_equal(rows.mask[0], [[1, 1, 0, 0], [1, 0, 0, 0]])
    with pytest.raises(ValueError, match="shared prefix"):
        pack_branches([([], [([1], [2])])])


def test_branch_logprobs_equal_plain_forwards_and_the_training_batch():
    graphdef, params = tiny_model()
    model = nnx.merge(graphdef, params)
    rng = np.random.RandomState(3)
    prefix, tail, response = rng.randint(0, 96, 9).tolist(), [5, 6], rng.randint(0, 96, 5).tolist()
    inserts = [rng.randint(0, 96, n).tolist() for n in (3, 6)]
    branches = [(insert + tail, response) for insert in inserts] + [(tail, response)]
    (got,) = branch_logprobs(model, [(prefix, branches)], temperature=0.7, chunk_size=4, rows_per_call=2)
    for logp, (context, _) in zip(got, branches):  # each branch alone, as one plain causal sequence
        seq = prefix + context + response
        plain, _ = sequence_logprobs(graphdef, params, [seq], [len(seq) - len(response)], len(response))
        np.testing.assert_allclose(logp, np.asarray(plain)[0], atol=1e-5)
    # The training loss's packed batch of the same step gives the same with and without log-probs.
    batch = build_batch([StepSample(prefix, tail, response, [0.0] * 5, 0.0, insert=inserts[0])])
    with_rubric, without, _ = response_logprobs(model, batch, temperature=0.7, chunk_size=4)
    np.testing.assert_allclose(got[0], np.asarray(with_rubric)[0, :5], atol=1e-5)
    np.testing.assert_allclose(got[2], np.asarray(without)[0, :5], atol=1e-5)
    assert CONFIG.vocab_size == 96


def test_token_classes():
    pieces = ["<think>", "ok", "</think>", "<action>", "go", " to", " desk 1", "</action>", "<|im_end|>"]
    expected = [FORMAT, OTHER, FORMAT, FORMAT, ACTION, ACTION, ACTION, FORMAT, FORMAT]
    np.testing.assert_array_equal(token_classes(pieces), expected)
    # A tag split over tokens is format on both pieces; no action tags: no action tokens.
    np.testing.assert_array_equal(
        token_classes(["<act", "ion>", "look", "</action>"]), [FORMAT, FORMAT, ACTION, FORMAT]
    )
    assert ACTION not in token_classes(["I think", " so"])


def _step(game, expert, gap, advantage=1.0, trajectory=0, ret=0.0):
    classes = np.array([FORMAT, ACTION, ACTION, FORMAT], np.int8)
    return ProbeStep(
        game, "look", trajectory, 0, expert, True, False, ret, advantage, classes, {"oracle": np.asarray(gap, float)}
    )


def test_summary_by_hand():
    steps = [
        _step("g1", True, [0.0, 1.0, 1.0, 0.0], trajectory=0, ret=10.0),
        _step("g1", False, [0.0, -1.0, -3.0, 0.0], advantage=-0.5, trajectory=1, ret=0.0),
        _step("g2", True, [0.5, 0.0, 0.0, 0.5], trajectory=0, ret=10.0),
        _step("g2", False, [0.2, 0.2, 0.2, 0.2], advantage=0.1, trajectory=1, ret=0.0),
    ]
    state = ProbeState(
        "g1",
        ("a", "b", "c"),
        np.array([True, False, False]),
        np.array([-1.0, -0.5, -3.0]),
        {"oracle": np.array([-0.2, -0.6, -3.5])},
    )
    (row,) = summarise(steps, [state], ["oracle"], coef=0.5, clip=1.0, n_boot=50)
    # Step means: 0.5, -1.0, 0.25, 0.2; expert {0.5, 0.25} vs other {-1.0, 0.2}: every pair favourable.
    assert row["auc_step"] == auc([0.5, 0.25], [-1.0, 0.2]) == 1.0
    # Action-token means: 1.0, -2.0, 0.0, 0.2 -> expert {1, 0} vs {-2, 0.2}: 3 of 4 pairs.
    assert row["auc_action"] == 0.75
    assert row["gap_expert"] == pytest.approx(0.375) and row["gap_other"] == pytest.approx(-0.4)
    assert row["gap_format_tokens"] == pytest.approx((0 + 0 + 0 + 0 + 0.5 + 0.5 + 0.2 + 0.2) / 8)
    # Sign flips: A = -0.5 with gaps -1 (clip) and -3 -> corrected -1.0 and -1.0 (no flip);
    # A = -0.5 with gap 0 -> no flip; A = 0.1 with 0.2 -> 0.2 (no flip); A = 1 with 0 / 1 -> none.
    assert row["sign_flips"] == 0.0
    # Trajectory gaps 0.5, -1, 0.25, 0.2 (ranks 4, 1, 3, 2) against returns 10, 0, 10, 0 (3.5, 1.5,
    # 3.5, 1.5): rank deviations (1.5, -1.5, 0.5, -0.5) and (1, -1, 1, -1) -> 4 / sqrt(5 * 4).
    assert row["gap_outcome_spearman"] == pytest.approx(4 / np.sqrt(20))
    # Within the state: the expert's answer is second without the rubric (-1 < -0.5), first with it.
    assert (row["top1_without"], row["top1_with"]) == (0.0, 1.0)
    # Gaps 0.8 (expert), -0.1, -0.5: the expert's gap is above both others.
    assert row["within_state_auc"] == 1.0


def test_a_source_paired_with_a_reference_on_the_steps_both_scored():
    """Source "b" gives g1's steps no rubric: the pairing with "a" keeps g2 and g3's four steps."""
    gaps = {  # step means of a, b (None: no rubric); expert first in each game
        ("g1", True): (0.9, None),
        ("g1", False): (-0.9, None),
        ("g2", True): (0.1, 0.4),
        ("g2", False): (0.3, 0.2),
        ("g3", True): (0.2, 0.5),
        ("g3", False): (0.0, 0.1),
    }
    steps = [
        dataclasses.replace(
            _step(game, expert, [a] * 4),
            gaps={"a": np.full(4, a)} | ({} if b is None else {"b": np.full(4, b)}),
        )
        for (game, expert), (a, b) in gaps.items()
    ]
    rows = summarise(steps, [], ["a", "b"], coef=0.5, clip=1.0, n_boot=50, paired={"b": "a"})
    assert "paired_with" not in rows[0]
    b = rows[1]
    assert (b["paired_with"], b["paired_steps"]) == ("a", 4.0)
    # On g2 and g3: a ranks experts {0.1, 0.2} against {0.3, 0.0}: 2 of 4 pairs; b {0.4, 0.5} against {0.2, 0.1}: all.
    assert (b["paired_auc"], b["paired_auc_reference"], b["paired_auc_diff"]) == (1.0, 0.5, 0.5)
    assert b["paired_auc_diff_lo"] <= 0.5 <= b["paired_auc_diff_hi"]
