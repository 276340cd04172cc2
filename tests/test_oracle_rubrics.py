"""Oracle rubrics: generated games' plans and WebShop goals as bundles the project's parser accepts."""

import dataclasses
import re

import pytest

from orsd_jax.demos import alfworld_walkthrough
from orsd_jax.envs.alfworld import TASK_TYPES, Difficulty, generate_games, load_split
from orsd_jax.envs.webshop import load_world
from orsd_jax.envs.webshop.goals import NO_PRICE_BOUND, split_indices
from orsd_jax.rubrics import parse_bundle, rubric_insert
from orsd_jax.rubrics.oracle import ALFWORLD_PADDING, alfworld_oracle, plan_criteria, runs, step_phrases, webshop_oracle

# Every task type twice; "hidden" puts the targets in closed containers (open steps, pick2 plans of 10).
VISIBLE = Difficulty("easy-uniform", (3, 5), (0, 2), (1, 1), "visible", False, (1,) * 6)
HIDDEN = Difficulty("easy-hidden", (4, 6), (0, 2), (1, 2), "hidden", True, (1,) * 6)
# The third person of each command's verb, as the criteria say it.
VERBS = {
    "go": "goes to",
    "take": "takes",
    "move": "moves",
    "open": "opens",
    "close": "closes",
    "heat": "heats",
    "cool": "cools",
    "clean": "cleans",
    "use": "uses",
    "examine": "examines",
    "slice": "slices",
}


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    tasks = []
    for difficulty in (VISIBLE, HIDDEN):
        root = tmp_path_factory.mktemp(difficulty.name)
        generate_games(root, {"train": 12}, seed=0, difficulty=difficulty, workers=1)
        tasks += load_split(root, "train")
    assert {t.task_type for t in tasks} == set(TASK_TYPES)
    return tasks


def assert_bundle(criteria: tuple[str, ...]) -> None:
    """5-8 distinct criteria that the parser reads back unchanged, as a list and inside the rubric insert."""
    assert 5 <= len(criteria) <= 8 and len(set(criteria)) == len(criteria)
    for text in ("\n".join(f"{i}. {c}" for i, c in enumerate(criteria, start=1)), rubric_insert(criteria)):
        parsed = parse_bundle(text)
        assert parsed.valid, parsed.reason
        assert parsed.criteria == criteria


def assert_plan_in_order(plan: list[str], criteria: tuple[str, ...]) -> None:
    """Every command's verb and names ("desk 1") are found in the criteria, each after the previous."""
    text, cursor = " | ".join(criteria).lower(), 0
    for command in plan:
        for word in [VERBS[command.split()[0]], *re.findall(r"[a-z]+ \d+", command)]:
            found = text.find(word, cursor)
            assert found >= 0, f"{word!r} of {command!r} not found after {text[:cursor]!r} in {criteria}"
            cursor = found + len(word)


def test_generated_games_plans_are_covered_in_order(games):
    lengths = set()
    for task in games:
        plan = alfworld_walkthrough(task)
        criteria = alfworld_oracle(task)
        assert_bundle(criteria)
        assert_plan_in_order(plan, criteria)
        steps = min(len(plan), 8)  # criteria holding plan steps; the rest is padding
        assert criteria[steps:] == tuple(p.format(n=len(plan)) for p in ALFWORLD_PADDING)[: max(0, 5 - steps)]
        lengths.add(len(plan))
    assert min(lengths) < 5 and max(lengths) > 8  # padded and merged bundles both occur


def test_a_short_plan_is_one_criterion_per_step_then_padding():
    plan = ["go to desk 1", "take statue 1 from desk 1", "use desklamp 1"]
    assert plan_criteria(plan) == (
        "Goes to the desk 1 before anything else",
        "Takes the statue 1 from the desk 1",
        "Uses the desklamp 1 while holding the statue 1",
        "Finishes the task in at most 3 actions",
        "Does not repeat an action that had no effect",
    )


def test_a_long_plan_is_merged_into_eight_runs_of_consecutive_steps():
    plan = [cmd for i in range(1, 6) for cmd in (f"go to cabinet {i}", f"open cabinet {i}", f"close cabinet {i}")]
    criteria = plan_criteria(plan)
    assert_bundle(criteria)
    assert len(criteria) == 8
    assert [len(c.split(", then ")) for c in criteria] == [2] * 7 + [1]
    assert criteria[0] == "Goes to the cabinet 1 before anything else, then opens the cabinet 1"
    assert_plan_in_order(plan, criteria)
    assert [list(r) for r in runs(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_repeated_steps_stay_distinct():
    """pick2 plans go to the same place twice; a repeat is named as such, so the parser keeps both."""
    plan = [
        "go to shelf 1",
        "take pen 1 from shelf 1",
        "go to desk 1",
        "move pen 1 to desk 1",
        "go to shelf 1",
        "take pen 2 from shelf 1",
        "go to desk 1",
        "move pen 2 to desk 1",
    ]
    phrases = step_phrases(plan)
    assert phrases[2] == "goes to the desk 1 while holding the pen 1"
    assert phrases[4] == "goes to the shelf 1 for the second time"
    assert_bundle(plan_criteria(plan))
    assert step_phrases(["look"] * 3)[2] == "looks around for the third time"
    with pytest.raises(ValueError, match="empty plan"):
        plan_criteria([])


def as_parsed(words: str) -> str:
    """A goal's words as criteria hold them: the parser drops emphasis marks and collapses spaces (a
    few option values hold non-breaking spaces)."""
    return " ".join(re.sub(r"[*_`]", " ", words).split())


@pytest.fixture(scope="module")
def goals(webshop_data):
    all_goals = load_world(webshop_data).goals
    # The test split, and the goals with the most options and attributes and without a price bound.
    extremes = sorted(all_goals, key=lambda g: (len(g.goal_options), len(g.attributes)))[-50:]
    unbounded = [g for g in all_goals if g.price_upper >= NO_PRICE_BOUND][:50]
    return [all_goals[i] for i in split_indices(len(all_goals), "test")] + extremes + unbounded


def test_webshop_bundles_name_every_attribute_and_option(goals):
    for goal in goals:
        criteria = webshop_oracle(goal)
        assert_bundle(criteria)
        text = " | ".join(criteria)
        assert goal.query in criteria[0]
        for needed in (*goal.attributes, *goal.option_values):
            assert as_parsed(needed) in text, (needed, criteria)
        assert (f"{goal.price_upper:.2f} dollars" in text) == (goal.price_upper < NO_PRICE_BOUND)
    assert {len(webshop_oracle(g)) for g in goals} >= {5, 6, 7}


def test_webshop_options_merge_when_they_do_not_fit_and_short_goals_are_padded(goals):
    goal = goals[0]
    many = dataclasses.replace(goal, goal_options=tuple((f"option{i}", f"value {i}") for i in range(6)))
    criteria = webshop_oracle(many)
    assert_bundle(criteria)
    assert sum("Chooses" in c for c in criteria) == 1 and all(f"value {i}" in criteria[2] for i in range(6))
    human = dataclasses.replace(goal, goal_options=("x-large", "navy blue"), attributes=(), price_upper=NO_PRICE_BOUND)
    criteria = webshop_oracle(human)
    assert_bundle(criteria)
    assert "Chooses the option x-large" in criteria and "Chooses the option navy blue" in criteria
    bare = dataclasses.replace(human, goal_options=())
    assert webshop_oracle(bare)[-2:] == (
        "Buys in at most 3 actions",
        "Does not search again after a matching product is found",
    )
