"""Expert labels of WebShop steps on the real env and data: the oracle's episodes, detours and
mistakes, and the analytic distance against a breadth-first search from random mid-episode states."""

import dataclasses
import pickle
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from orsd_jax.envs.webshop import WebShopEnv, load_goals
from orsd_jax.envs.webshop.expert import goal_distance, label_actions, label_groups, session_route
from orsd_jax.envs.webshop.oracle import OraclePolicy
from orsd_jax.envs.webshop.pages import RESULTS_PER_PAGE, SEARCH_PLACEHOLDER, SUB_PAGES
from orsd_jax.envs.webshop.search import search_argument

N_GOALS = 30  # test goals 0-29; the oracle's purchase misses score 1 on two of them (20 and 28)


@pytest.fixture(scope="module")
def env(webshop_data):
    return WebShopEnv(webshop_data)


@pytest.fixture(scope="module")
def tasks(webshop_data):
    return load_goals(webshop_data, "test")[:N_GOALS]


@pytest.fixture(scope="module")
def oracle_runs(env, tasks):
    """Per task: the oracle's actions and whether its purchase won."""
    runs = []
    for task in tasks:
        step = env.reset(task)
        policy, actions = OraclePolicy(env.goal), []
        while not step.done:
            actions.append(policy(step))
            step = env.step(actions[-1])
        runs.append((actions, step.won))
    return runs


def goal_of(env, task):
    return env.world.goals[int(task.key)]


def search(goal):
    return f"search[{search_argument(goal.name)}]"


def click(label):
    return f"click[{label.lower()}]"


def test_the_oracle_is_expert_consistent_at_every_step(env, tasks, oracle_runs):
    """``d`` at the reset is the oracle's episode length and drops by one per step to 0 at the win."""
    won = 0
    for task, (actions, oracle_won) in zip(tasks, oracle_runs):
        labels = label_actions(env, task, actions)
        assert [label.action for label in labels] == actions
        assert [label.distance_before for label in labels] == list(range(len(actions), 0, -1))
        assert all(label.planned for label in labels)
        if oracle_won:
            won += 1
            assert all(label.consistent for label in labels)
            assert labels[-1].route_after == ()
        else:  # the right purchase, short of score 1 (see test_webshop_env): only the buy misses
            assert all(label.consistent for label in labels[:-1]) and not labels[-1].consistent
            assert labels[-1].route_after is None
    assert won >= 25, won


def test_a_detour_is_not_expert_and_the_way_back_is(env, tasks):
    """A wrong product and a sub-page each cost a step; the ``< prev`` back is on a shortest route."""
    task = tasks[1]  # two goal options
    goal = goal_of(env, task)
    first, second = goal.option_values
    env.reset(task)
    env.step(search(goal))
    wrong = next(a for a in env.session.results[:RESULTS_PER_PAGE] if a != goal.asin)
    actions = [
        search(goal),
        click(wrong),
        "click[< prev]",
        click(goal.asin),
        f"click[{first}]",
        "click[description]",
        "click[< prev]",
        f"click[{second}]",
        "click[buy now]",
    ]
    labels = label_actions(env, task, actions)
    assert env.session.options == (("color", first), ("size", second))  # the sub-page kept the first
    assert [label.distance_before for label in labels] == [5, 4, 5, 4, 3, 2, 3, 2, 1]
    assert labels[-1].distance_after == 0
    assert [label.consistent for label in labels] == [True, False, True, True, True, False, True, True, True]
    # From the wrong item, ``< prev`` ties with a new title search; the route d counts keeps the search.
    assert [label.planned for label in labels] == [True, False, True, True, True, False, True, True, True]


def test_mistakes_are_not_expert(env, tasks):
    task, other_task = tasks[1], tasks[2]
    goal, other = goal_of(env, task), goal_of(env, other_task)
    # Another product's title: a search that does not list the goal, at the start and later.
    assert goal.asin not in env.world.engine.search(search_argument(other.name).lower())
    labels = label_actions(env, task, [search(other), search(goal), search(other), search(goal)])
    assert [label.distance_before for label in labels] == [5, 5, 4, 5]
    assert [label.consistent for label in labels] == [False, True, False, True]
    # Invalid commands change nothing: the start page's listed but inert button, a button of
    # another page, an unknown label, an unparsed answer.
    invalid = ["click[search]", "click[buy now]", "click[foo]", ""]
    labels = label_actions(env, task, [*invalid, search(goal), *invalid])
    assert [label.distance_before for label in labels] == [5] * 5 + [4] * 4
    assert [label.consistent for label in labels] == [False] * 4 + [True] + [False] * 4
    # A wrong colour, the right one, the right one again (no change) and a wrong one over it.
    colours = dict(env.world.catalog.by_asin[goal.asin].options)["color"]
    first = goal.option_values[0]
    wrong_colour = next(c for c in colours if c != first)
    picks = [f"click[{c}]" for c in (wrong_colour, first, first, wrong_colour)]
    labels = label_actions(env, task, [search(goal), click(goal.asin), *picks])
    assert [label.distance_before for label in labels] == [5, 4, 3, 3, 2, 2]
    assert [label.consistent for label in labels] == [True, True, False, True, False, False]
    # Buying before choosing the options ends the episode without the win: d is infinite.
    labels = label_actions(env, task, [search(goal), click(goal.asin), "click[buy now]", search(goal)])
    assert len(labels) == 3  # nothing is played after the end
    assert (labels[-1].distance_before, labels[-1].route_after, labels[-1].consistent) == (3, None, False)
    assert env.session.view == "done" and env.session.options == ()


def test_label_groups_shapes(env, tasks, oracle_runs):
    """Per group, per trajectory, per step; a missing action is "" and steps after the end are False."""
    actions = oracle_runs[0][0]

    def trajectory(steps):
        return SimpleNamespace(steps=[SimpleNamespace(action=a) for a in steps])

    groups = [
        SimpleNamespace(task=tasks[0], trajectories=[trajectory(actions + ["click[< prev]"]), trajectory([None])]),
        SimpleNamespace(task=tasks[1], trajectories=[trajectory([search(goal_of(env, tasks[1])), "click[foo]"])]),
    ]
    assert label_groups(env, groups) == [[[True] * len(actions) + [False], [False]], [[True, False]]]


def _key(session):
    # The purchase reads the options as a dict: the order they were first chosen in is immaterial.
    return dataclasses.replace(session, options=tuple(sorted(session.options)))


def no_win_within(env, step, depth, wins):
    """Breadth-first search over the env's own transitions, each state a pickled copy: True iff no
    purchase within ``depth`` steps wins. Actions: every clickable, and the goal's title search as
    the one search (the only search ``d`` counts). ``wins`` caches purchases by goal, asin, options."""
    title = search(env.goal)
    frontier, seen = [(env, step)], {_key(env.session)}
    for level in range(depth):
        last, grown = level == depth - 1, []
        for state, shown in frontier:
            saved = pickle.dumps(state)
            actions = [a for a in shown.admissible_actions if a != SEARCH_PLACEHOLDER]
            for action in [*actions, title]:
                if action == "click[buy now]":
                    bought = (state.goal, state.session.asin, frozenset(state.session.options))
                    if bought not in wins:
                        wins[bought] = pickle.loads(saved).step(action).won
                    if wins[bought]:
                        return False
                elif not last:  # a state one level further could only win one step later
                    copy = pickle.loads(saved)
                    after = copy.step(action)
                    if _key(copy.session) not in seen:
                        seen.add(_key(copy.session))
                        grown.append((copy, after))
        frontier = grown
    return True


def _kind(env):
    s, goal = env.session, env.goal
    if s.view == "results":
        listed = goal.asin in s.results and s.results.index(goal.asin) // RESULTS_PER_PAGE + 1 != s.page
        return "results, paging to the goal" if listed else "results"
    if s.view == "item" and s.asin == goal.asin:
        return "goal item, options chosen" if s.options else "goal item"
    return "other item" if s.view == "item" else "sub-page" if s.view in SUB_PAGES else s.view


def test_distance_matches_a_breadth_first_search_from_random_states(webshop_data, tasks, oracle_runs):
    """From states reached by random admissible actions, ``d`` is the shortest win: the breadth-first
    search finds none within d - 1 steps, and playing ``session_route`` (d steps) wins."""
    env = WebShopEnv(webshop_data, max_steps=50)  # room for the walk, the search and the route
    rng = random.Random(0)
    winnable = [t for t, (_, won) in zip(tasks, oracle_runs) if won]
    goals = env.world.goals
    kinds, wins = Counter(), {}
    for _ in range(40):
        task = rng.choice(winnable)
        step = env.reset(task)
        goal = env.goal
        other = goals[rng.randrange(len(goals))]
        # The scrape query lists the goal on a later page for some goals (paging both ways).
        searches = [search(goal), f"search[{goal.query}]", search(other), f"search[{goal.query} {other.query}]"]
        towards = {"click[next >]", "click[< prev]", click(goal.asin), *(f"click[{v}]" for v in goal.option_values)}
        for _ in range(rng.randint(1, 8)):
            actions = [a for a in step.admissible_actions if a != "click[buy now]"]
            useful = [a for a in actions if a in towards]
            action = rng.choice(useful if useful and rng.random() < 0.5 else actions)
            step = env.step(rng.choice(searches) if action == SEARCH_PLACEHOLDER else action)
        d = goal_distance(env, step)
        assert d is not None  # every goal is listed by its title search
        assert no_win_within(pickle.loads(pickle.dumps(env)), step, d - 1, wins), (task.key, env.session, d)
        played = pickle.loads(pickle.dumps(env))
        route = session_route(env.world, goal, env.session)
        assert route is not None and len(route) == d
        assert [played.step(a).won for a in route] == [False] * (d - 1) + [True]
        kinds[_kind(env)] += 1
    expected = {"start", "results", "results, paging to the goal", "goal item, options chosen", "other item"}
    assert set(kinds) >= expected | {"sub-page"}, kinds
