"""Rubric parsing, rendering and Spearman bundle selection."""

import dataclasses
import json
import re

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from orsd_jax.envs.base import Task
from orsd_jax.rollout import Step, Trajectory
from orsd_jax.rubrics import average_ranks, bundle_regex, parse_bundle, rubric_insert, select_bundle, spearman
from orsd_jax.rubrics.generate import RubricConfig, rubric_prompt
from orsd_jax.rubrics.render import render_group, render_trajectory

FIVE = [
    "The agent goes to the countertop before opening any drawer.",
    "The agent picks up the mug as soon as it sees it.",
    "The agent never repeats the same action twice in a row.",
    "The agent opens closed receptacles before searching them.",
    "The agent puts the object in the target receptacle at the end.",
]


def test_numbered_bulleted_and_json_lists():
    numbered = "\n".join(f"{k}. {c}" for k, c in enumerate(FIVE, start=1))
    assert parse_bundle(numbered).criteria == tuple(FIVE) and parse_bundle(numbered).valid
    for marker in ("-", "*", "\u2022", "(1)", "1)"):
        text = "Here are the criteria:\n" + "\n".join(f"{marker} {c}" for c in FIVE) + "\nThat is all."
        assert parse_bundle(text).criteria == tuple(FIVE), marker
    assert parse_bundle(json.dumps(FIVE)).criteria == tuple(FIVE)
    assert parse_bundle(json.dumps([f"{k}. {c}" for k, c in enumerate(FIVE, start=1)])).criteria == tuple(FIVE)
    objects = json.dumps({"criteria": [{"id": k, "criterion": c, "weight": 1} for k, c in enumerate(FIVE)]})
    assert parse_bundle("```json\n" + objects + "\n```").criteria == tuple(FIVE)
    assert parse_bundle(json.dumps({str(k): c for k, c in enumerate(FIVE)})).criteria == tuple(FIVE)


def test_cleaning_labels_emphasis_and_thinking():
    text = "<think>1. this is not a criterion at all</think>\n" + "\n".join(
        f"{k}. **Criterion {k}:** {c}" for k, c in enumerate(FIVE, start=1)
    )
    assert parse_bundle(text).criteria == tuple(FIVE)


@pytest.mark.parametrize(
    "text, n_found, reason",
    [
        ("", 0, "empty output"),
        ("   \n ", 0, "empty output"),
        ("The agent should be quick and should look everywhere in the room.", 0, "no list"),
        ("1. The agent looks in the fridge first.", 1, "1 distinct criteria"),
        (
            "\n".join(f"{k}. The agent checks receptacle number {k} early." for k in range(1, 31)),
            30,
            "30 distinct criteria",
        ),
        ("\n".join(f"{k}. {FIVE[0]}" for k in range(1, 9)), 1, "1 distinct criteria"),  # duplicates collapse
        (
            json.dumps([f"{k}. {FIVE[0]}" for k in range(1, 9)]),
            1,
            "1 distinct criteria",
        ),  # also when JSON items are numbered
        ("\n".join(f"{k}. {c.upper()}!" for k, c in enumerate(FIVE + FIVE[:2], 1)), 5, ""),  # case/punct duplicates
        ("1. ok\n2. yes\n3. no\n4. a b\n5. go", 0, "no list"),  # too short to be criteria
        ('{"criteria": "not a list"}', 0, "no list"),
        ("[1, 2, 3]", 0, "no list"),
        (None, 0, "empty output"),
    ],
)
def test_adversarial_text_never_raises(text, n_found, reason):
    bundle = parse_bundle(text)
    assert len(bundle.criteria) == n_found
    assert reason in bundle.reason and bundle.valid == (reason == "")


@given(
    st.lists(
        st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=160), min_size=3, max_size=10
    )
)
@settings(max_examples=300, deadline=None)
def test_the_bundle_grammar_admits_exactly_what_parses_line_by_line(items):
    """Whatever a constrained writer can finish parses to its own lines; outside 5-8 lines, or with
    a line of the wrong length or numbering, the grammar does not match (an independent check)."""
    text = "".join(f"{k}. {item}\n" for k, item in enumerate(items, start=1))
    lines_ok = all(10 <= len(item) <= 150 and not item[0].isspace() and not {"\n", "<"} & set(item) for item in items)
    matches = re.fullmatch(bundle_regex(), text) is not None
    assert matches == (5 <= len(items) <= 8 and lines_ok)
    if matches:
        bundle = parse_bundle(text)
        # The parser may still drop short or duplicate lines, and it trims what it cleans (whitespace,
        # markdown emphasis anywhere in a line: "00000:*0" reads "00000:0"); it adds nothing.
        assert len(bundle.criteria) <= len(items)
        plain = [re.sub(r"[*_`]", "", " ".join(item.split())) for item in items]
        assert all(any(c in p for p in plain) for c in bundle.criteria)
    assert re.fullmatch(bundle_regex(), text.replace("\n2. ", "\n3. ", 1)) is None  # out of order


def test_the_grammar_keeps_special_tokens_out():
    """vLLM's grammar lets a special token through when its text fits, and ``<|im_start|>`` does fit ``[^\\n]``."""
    lines = [f"{k}. {c}\n" for k, c in enumerate(FIVE, start=1)]
    assert re.fullmatch(bundle_regex(), "".join(lines))
    lines[2] = lines[2].replace(" twice", "<|im_start|>user")
    assert re.fullmatch(bundle_regex(), "".join(lines)) is None


def test_a_cut_bundle_loses_its_unfinished_line():
    six = "".join(f"{k}. {c}\n" for k, c in enumerate(FIVE, start=1)) + "6. The agent takes the statue from"
    assert parse_bundle(six).criteria[-1] == "The agent takes the statue from"  # finished text: a line is a line
    assert parse_bundle(six, cut=True).criteria == tuple(FIVE) and parse_bundle(six, cut=True).valid
    five = six.replace(f"5. {FIVE[4]}\n", "")
    assert parse_bundle(five, cut=True).reason == "4 distinct criteria; a bundle needs 5-8 (cut by the token limit)"
    assert (
        parse_bundle("1. The agent goes to the desk", cut=True).reason
        == "no list of criteria found (cut by the token limit)"
    )


def test_a_grammar_line_holds_a_criterion():
    with pytest.raises(ValueError, match="at least 10 characters"):
        RubricConfig(constrained=True, criterion_chars=5)


def test_rubric_insert_lists_the_criteria():
    insert = rubric_insert(FIVE)
    assert insert.startswith("\n\n") and all(f"{k}. {c}" in insert for k, c in enumerate(FIVE, 1))


# Rendering never shows rewards or what followed the last action.


def _trajectory(n_steps, won, final_text="Your score (min 0.0, max 1.0) [SEP] 1.0"):
    steps = tuple(
        Step(
            user_text="",
            prompt_ids=(1,),
            response_ids=(2,),
            logprobs=(-0.1,),
            response_text="",
            observation=f"observation {k}",
            action=f"go to cabinet {k}",
            valid_format=True,
            admissible=True,
            reward=10.0 if (won and k == n_steps - 1) else 0.0,
            truncated=False,
            weight_version=0,
        )
        for k in range(n_steps)
    )
    return Trajectory(Task("alfworld", "g", "pick", "put a mug in desk"), steps, won=won, score=float(won))


def test_render_hides_outcomes_and_fits_budget():
    trajectories = [_trajectory(3, True), _trajectory(40, False)]
    text = render_group(trajectories, budget_tokens=120, count_tokens=lambda s: len(s.split()))
    assert "10" not in text.replace("cabinet 10", "") and "score" not in text and "won" not in text.lower()
    long = render_trajectory(trajectories[1], 120, lambda s: len(s.split()))
    assert len(long.split()) <= 120 and "steps left out" in long
    assert "go to cabinet 0" in long and "go to cabinet 39" in long  # keeps both ends
    prompt = rubric_prompt("put a mug in desk", text, 2)
    assert "between 5 and 8" in prompt and "Attempt 2:\n" in prompt and "steps)" not in prompt


def test_render_group_shows_a_common_start_once():
    same = [_trajectory(3, True), _trajectory(4, False)]
    text = render_group(same, budget_tokens=120, count_tokens=lambda s: len(s.split()))
    assert text.startswith("Every attempt starts from: observation 0\n") and text.count("observation 0") == 1
    assert text.count("Step 1: saw: (the start shown above)") == 2 and "observation 3" in text
    other = _trajectory(2, False)
    other = dataclasses.replace(
        other, steps=(dataclasses.replace(other.steps[0], observation="elsewhere"), *other.steps[1:])
    )
    text = render_group([same[0], other], budget_tokens=120, count_tokens=lambda s: len(s.split()))
    assert "starts from" not in text and "saw: observation 0" in text and "saw: elsewhere" in text


# Selection.


@settings(max_examples=200, deadline=None)
@given(
    st.integers(3, 12).flatmap(
        lambda g: st.tuples(
            st.lists(
                st.lists(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]), min_size=g, max_size=g), min_size=1, max_size=5
            ),
            st.lists(st.sampled_from([0.0, 0.0, 1.0, 10.0]), min_size=g, max_size=g),
        )
    )
)
def test_spearman_agrees_with_scipy(data):
    satisfaction, rewards = np.array(data[0]), np.array(data[1])
    for row in satisfaction:
        expected = scipy.stats.spearmanr(row, rewards).statistic if np.ptp(row) and np.ptp(rewards) else np.nan
        got = spearman(row, rewards)
        assert (np.isnan(expected) and np.isnan(got)) or abs(got - expected) < 1e-12
        np.testing.assert_allclose(average_ranks(row), scipy.stats.rankdata(row, method="average"))
    selection = select_bundle(satisfaction, rewards, "spearman", np.random.default_rng(0))
    defined = ~np.isnan(selection.correlations)
    if defined.any():
        assert selection.index == int(np.flatnonzero(defined)[np.argmax(selection.correlations[defined])])
    else:
        assert selection.index is None and selection.reason


def test_degenerate_groups_get_no_rubric():
    rng = np.random.default_rng(0)
    sat = np.array([[0.2, 0.8, 0.4, 1.0], [1.0, 0.0, 0.5, 0.5]])
    constant_rewards = select_bundle(sat, np.array([10.0] * 4), "spearman", rng)
    assert constant_rewards.index is None and constant_rewards.reason == "constant rewards"
    constant_sat = select_bundle(np.full((2, 4), 0.6), np.array([0, 10, 0, 10.0]), "spearman", rng)
    assert constant_sat.index is None and "constant satisfaction" in constant_sat.reason
    invalid = select_bundle(np.full((2, 4), np.nan), np.array([0, 10, 0, 10.0]), "spearman", rng)
    assert invalid.index is None and invalid.reason == "no valid bundle"
    empty = select_bundle(np.zeros((0, 4)), np.array([0, 10, 0, 10.0]), "spearman", rng)
    assert empty.index is None and empty.reason == "no valid bundle"


def test_selection_modes():
    rewards = np.array([0.0, 10.0, 0.0, 10.0])
    sat = np.array([[0.1, 0.9, 0.2, 0.8], [np.nan] * 4, [0.9, 0.1, 0.8, 0.2], [0.5, 0.5, 0.5, 0.5]])
    best = select_bundle(sat, rewards, "spearman", np.random.default_rng(0))
    # ranks (1, 4, 2, 3) against (1.5, 3.5, 1.5, 3.5): centred products sum to 4, norms sqrt(5) and 2
    assert best.index == 0 and best.correlations[0] == pytest.approx(4 / np.sqrt(20))
    assert np.isnan(best.correlations[1]) and np.isnan(best.correlations[3])
    picks = {select_bundle(sat, rewards, "random", np.random.default_rng(s)).index for s in range(50)}
    assert picks == {0, 2}  # uniform among bundles with a defined correlation, never the invalid ones
    assert select_bundle(sat[2:3], rewards, "single", np.random.default_rng(0)).index == 0
    with pytest.raises(ValueError, match="exactly one"):
        select_bundle(sat, rewards, "single", np.random.default_rng(0))
    backwards = sat[2:]  # the only defined correlation is -4 / sqrt(20)
    assert select_bundle(backwards, rewards, "spearman", np.random.default_rng(0)).index == 0  # the paper's argmax
    withheld = select_bundle(backwards, rewards, "spearman", np.random.default_rng(0), min_correlation=0.0)
    assert withheld.index is None and withheld.reason == "best correlation below the minimum"
    assert select_bundle(sat, rewards, "spearman", np.random.default_rng(0), min_correlation=0.0).index == 0
    with pytest.raises(ValueError, match="unknown selection mode"):
        select_bundle(sat, rewards, "best", np.random.default_rng(0))


def test_real_outputs_of_the_embedded_model():
    """Rubric writer outputs of the embedded model after the cpu-demo warm start (recorded data)."""
    import json
    import pathlib

    recorded = json.loads((pathlib.Path(__file__).parent / "data" / "rubric_outputs_smollm2.json").read_text())[
        "outputs"
    ]
    parsed = [parse_bundle(text) for text in recorded]
    # Read by hand: criteria of 3-60 words, one per numbered line; too few or none is rejected.
    assert [len(p.criteria) for p in parsed] == [1, 2, 1, 6, 8, 1, 4, 0]
    assert [p.valid for p in parsed] == [False, False, False, True, True, False, False, False]
    assert parsed[3].criteria[0] == "The 4 tasks share an action, set in a time and place that changes in a process."
    assert "7. The agent" in recorded[3] and not any(c == "The agent" for c in parsed[3].criteria)  # cut off: 2 words
    assert len(recorded[1].splitlines()) == 3 and parsed[1].criteria[1].startswith(
        "Step 4:"
    )  # the 70-word item is dropped
    # "1. 4. The agent ...": both numbers are list markers.
    assert parsed[2].criteria == ("The agent turns on the object held by the agent instead of question-pausing.",)
    assert parsed[7].reason == "no list of criteria found"  # markup, no list
