"""The ALFWorld prompt: verl-agent's fields in verl-agent's order, history windowing and numbering,
byte-stable output; and the success table."""

import math

import pytest

from orsd_jax.envs.alfworld import build_prompt, success_markdown, success_table

INTRO = (
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
    "you see a countertop 1, and a fridge 1.\n\nYour task is to: put a cool apple in countertop."
)
ACTIONS = ("go to countertop 1", "go to fridge 1", "inventory", "look")
HISTORY = [
    (INTRO, "go to countertop 1"),
    ("You arrive at countertop 1. On the countertop 1, you see a apple 1.", "take apple 1 from countertop 1"),
    ("You pick up the apple 1 from the countertop 1.", "go to fridge 1"),
]


def _in_order(text: str, parts: list[str]) -> bool:
    positions = [text.find(p) for p in parts]
    return all(p >= 0 for p in positions) and positions == sorted(positions)


def test_first_step_shows_role_intro_actions_and_format():
    prompt = build_prompt("put a cool apple in countertop", INTRO, ACTIONS, [], 0)
    quoted = "\n ".join(f"'{a}'" for a in ACTIONS)
    assert _in_order(prompt, ["ALFRED", INTRO, quoted, "<think>", "</think>", "<action>", "</action>"])
    assert prompt.count("Your task is to:") == 1  # only the intro's own line


def test_later_steps_show_task_count_window_and_current_state():
    obs = "You arrive at fridge 1. The fridge 1 is closed."
    prompt = build_prompt("put a cool apple in countertop", obs, ACTIONS, HISTORY, 3)
    entries = [f"[Observation {k}: '{HISTORY[k - 1][0]}', Action {k}: '{HISTORY[k - 1][1]}']" for k in (2, 3)]
    assert _in_order(
        prompt,
        [
            "ALFRED",
            "Your task is to: put a cool apple in countertop",
            "3 step(s)",
            "last 2 observation(s)",
            "\n".join(entries),
            "step 4",
            obs,
            "'go to countertop 1'\n 'go to fridge 1'",
            "<think>",
            "<action>",
        ],
    )
    assert "Observation 1:" not in prompt


@pytest.mark.parametrize("history_length, shown", [(0, []), (1, [3]), (2, [2, 3]), (5, [1, 2, 3])])
def test_history_window(history_length, shown):
    prompt = build_prompt("t", "o", ACTIONS, HISTORY, 3, history_length=history_length)
    assert [k for k in (1, 2, 3) if f"[Observation {k}:" in prompt] == shown
    assert (f"last {len(shown)} observation(s)" in prompt) == bool(shown)
    assert "You have taken 3 step(s) so far." in prompt


def test_truncated_history_keeps_absolute_step_numbers():
    prompt = build_prompt("t", "o", ACTIONS, HISTORY[-1:], 9)
    assert "[Observation 9: 'You pick up the apple 1 from the countertop 1.', Action 9: 'go to fridge 1']" in prompt
    assert "step 10" in prompt


def test_prompt_is_a_pure_function():
    history = [list(h) for h in HISTORY]
    first = build_prompt("t", "o", list(ACTIONS), history, 3)
    assert build_prompt("t", "o", tuple(ACTIONS), [tuple(h) for h in history], 3) == first
    assert history == [list(h) for h in HISTORY]


def test_inconsistent_arguments_are_refused():
    with pytest.raises(ValueError, match="step_count"):
        build_prompt("t", "o", ACTIONS, [], -1)
    with pytest.raises(ValueError, match="3 entries"):
        build_prompt("t", "o", ACTIONS, HISTORY, 2)


def test_success_table_per_type_and_overall():
    results = [("pick", True), ("pick", False), ("look", True), ("clean", False), ("pick2", True), ("pick2", True)]
    table = success_table(results)
    assert list(table) == ["Pick", "Look", "Clean", "Heat", "Cool", "Pick2", "All"]
    assert table["Pick"] == 0.5 and table["Look"] == 1.0 and table["Clean"] == 0.0 and table["Pick2"] == 1.0
    assert math.isnan(table["Heat"]) and math.isnan(table["Cool"])
    assert table["All"] == sum(won for _, won in results) / len(results)
    markdown = success_markdown(results, title="valid_seen")
    assert "| valid_seen (%) | 50.0 | 100.0 | 0.0 | - | - | 100.0 | 66.7 |" in markdown
    assert "| won/played | 1/2 | 1/1 | 0/1 | 0/0 | 0/0 | 2/2 | 4/6 |" in markdown
    with pytest.raises(ValueError, match="unknown ALFWorld task type"):
        success_table([("slice", True)])
