"""The option-choice replay of a WebShop evaluation, on the real env and data: the oracle's
episodes choose every goal option; a wrong value, a non-option click and a broken answer are
counted as what they are."""

import pytest

from experiments.webshop_options import by_option_count, replay
from orsd_jax.envs.webshop import WebShopEnv, load_goals
from orsd_jax.envs.webshop.oracle import oracle_episode


def _answer(command: str) -> str:
    return f"<think></think><action>{command}</action>"


@pytest.fixture(scope="module")
def env(webshop_data):
    return WebShopEnv(webshop_data, max_steps=15)


@pytest.fixture(scope="module")
def two_option_goal(env, webshop_data):
    """The first first-hit test goal with two options, and the oracle's winning commands."""
    for task in load_goals(webshop_data, "test", goals="first-hit"):
        commands, last = oracle_episode(env, task, search="instruction")
        if len(env.goal.option_values) == 2 and last.won:
            return task, commands
    raise AssertionError("no first-hit test goal with two options that the oracle wins")


def test_the_oracle_chooses_every_goal_option(env, two_option_goal):
    task, commands = two_option_goal
    e = replay(env, task, [_answer(c) for c in commands])
    assert len(commands) == 5  # search, open, two options, buy
    assert (e.option_clicks, e.named_clicks, e.bought, e.bought_all, e.won) == (2, 2, True, True, True)
    assert e.goal_options == {v.lower() for v in env.goal.option_values}


def test_a_wrong_value_a_button_and_a_broken_answer(env, two_option_goal):
    task, commands = two_option_goal
    search, open_product, first, second, buy = commands
    env.reset(task)
    chosen = first[len("click[") : -1]
    values = next(vs for _, vs in env.world.catalog.by_asin[env.goal.asin].options if chosen in map(str.lower, vs))
    wrong = next(v.lower() for v in values if v.lower() != chosen)
    answers = [
        _answer(search),
        "no tags at all",  # a no-op
        _answer(open_product),
        _answer("click[description]"),  # a button, not an option
        _answer("click[< prev]"),
        _answer(f"click[{wrong}]"),
        _answer(second),
        _answer(buy),
    ]
    e = replay(env, task, answers)
    assert (e.option_clicks, e.named_clicks, e.bought, e.bought_all, e.won) == (2, 1, True, False, False)
    table = by_option_count([e, replay(env, task, [_answer(c) for c in commands])])
    assert table.splitlines()[2:] == ["| 2 | 2 | 1 | 4 | 3 | 2 | 1 |", "| all | 2 | 1 | 4 | 3 | 2 | 1 |"]


def test_an_option_click_that_ends_the_episode_counts(webshop_data, two_option_goal):
    task, commands = two_option_goal
    short = WebShopEnv(webshop_data, max_steps=3)  # search, open, the first option: the step limit
    e = replay(short, task, [_answer(c) for c in commands[:3]])
    assert (e.option_clicks, e.named_clicks, e.bought, e.bought_all, e.won) == (1, 1, False, False, False)


def test_more_answers_than_steps_is_an_error(env, two_option_goal):
    task, commands = two_option_goal
    with pytest.raises(ValueError, match="more answers than the episode's steps"):
        replay(env, task, [_answer(c) for c in commands] + [_answer("click[buy now]")])
