"""The credit probe's WebShop states: every candidate action of a played state, with the first step of
the route to the goal product as the expert's, on the real environment and data."""

import functools

from experiments.credit_probe import _webshop_states, game_names
from orsd_jax.envs.webshop import WebShopEnv, load_goals, oracle_episode
from orsd_jax.envs.webshop.pages import SEARCH_PLACEHOLDER
from orsd_jax.rollout import Group, Step, Trajectory


def _group(task, actions):
    steps = tuple(Step("", (), (), (), "", "", a, True, True, 0.0, False, 0) for a in actions)
    return Group(task, (Trajectory(task, steps, False, 0.0),))


def test_webshop_states_take_the_route_to_the_goal(webshop_data):
    make_env = functools.partial(WebShopEnv, str(webshop_data))
    tasks = load_goals(webshop_data, "test")[:6]
    env = make_env()
    oracle = [oracle_episode(env, t)[0] for t in tasks[:5]]
    # A detour: the title search, another listed product, back, then the oracle's route.
    search = oracle[0][0]
    env.reset(tasks[0])
    listed = [a for a in env.step(search).admissible_actions if a.startswith("click[b0")]  # product ids
    wrong = next(a for a in listed if a != oracle[0][1])
    detour = [search, wrong, "click[< prev]", *oracle[0][1:]]
    groups = [_group(t, a) for t, a in zip(tasks, oracle)] + [_group(tasks[0], detour)]

    states = _webshop_states(make_env, groups, per_game=20)
    by_step = {(g, k): (actions, expert) for g, k, actions, expert in states}
    for g, played in enumerate(oracle):
        # Every state is probed (the start page offers the search box and its no-op button), and
        # the oracle's own next action is the expert's.
        assert [k for gg, k in by_step if gg == g] == list(range(len(played)))
        assert by_step[(g, 0)] == ((played[0], "click[search]"), played[0])
        for k in range(len(played)):
            actions, expert = by_step[(g, k)]
            assert expert == played[k] and len(actions) > 1 and SEARCH_PLACEHOLDER not in actions
    actions, expert = by_step[(5, 2)]  # on the wrong product's page: back to the results
    assert expert == "click[< prev]" and wrong not in actions
    assert by_step[(5, 3)][1] == oracle[0][1]  # back on the results: the goal product


def test_records_name_games_without_this_machines_paths():
    keys = [
        "/data/games/valid_seen/look-1/trial_0/game.tw-pddl",
        "/data/games/valid_unseen/pick-2/trial_3/game.tw-pddl",
    ]
    assert game_names(keys) == {
        keys[0]: "valid_seen/look-1/trial_0/game.tw-pddl",
        keys[1]: "valid_unseen/pick-2/trial_3/game.tw-pddl",
    }
    assert game_names([keys[0]]) == {keys[0]: "game.tw-pddl"}  # one game: its file name
    assert game_names(["17", "4"]) == {"17": "17", "4": "4"}  # WebShop goal indices
