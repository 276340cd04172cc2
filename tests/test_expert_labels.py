"""Expert labels from the real engine's planner on generated games: walkthroughs, detours, ties."""

import re

import pytest

from orsd_jax.demos import alfworld_walkthrough
from orsd_jax.envs.alfworld import TASK_TYPES, Difficulty, generate_games, load_split
from orsd_jax.envs.alfworld.engine import make_engine
from orsd_jax.envs.alfworld.expert import ExpertLabel, expert_plan, label_actions

VISIBLE = Difficulty("easy-uniform", (3, 5), (0, 2), (1, 1), "visible", False, (1,) * 6)
HIDDEN = Difficulty("easy-hidden", (4, 6), (0, 2), (1, 2), "hidden", True, (1,) * 6)


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    tasks = {}
    for difficulty in (VISIBLE, HIDDEN):
        root = tmp_path_factory.mktemp(difficulty.name)
        generate_games(root, {"train": 6}, seed=0, difficulty=difficulty, workers=1)
        tasks[difficulty.name] = load_split(root, "train")
        assert {t.task_type for t in tasks[difficulty.name]} == set(TASK_TYPES)
    return tasks


@pytest.fixture(scope="module")
def engine():
    return make_engine(plan=True)


def _start(engine, task):
    engine.load(task.key)
    return engine.reset()


def test_the_walkthrough_is_expert_consistent_at_every_step(games, engine):
    """The engine's plan shortens by one per walkthrough step and is as long as the stored
    walkthrough: the two planners agree on the optimal length from every state on the way."""
    for task in games["easy-uniform"] + games["easy-hidden"]:
        plan = alfworld_walkthrough(task)
        labels = label_actions(engine, task, plan + ["look"])  # nothing is played after the win
        assert [label.action for label in labels] == plan
        assert all(label.consistent for label in labels)
        assert [len(label.plan_before) for label in labels] == list(range(len(plan), 0, -1))
        assert labels[-1].plan_after == ()


def test_a_detour_is_not_expert_and_the_way_back_is(games, engine):
    """Visible games hold one object of the task (pick2: two, both on the plan), so a place off
    the plan is a detour, at the start or while holding the object."""
    tested = 0
    for task in games["easy-uniform"]:
        plan = alfworld_walkthrough(task)
        places = [a for a in _start(engine, task)["admissible_commands"] if a.startswith("go to ") and a not in plan]
        if not places:
            continue  # a room with nothing but the plan's places
        # At the start, and (unless taking the object wins) while holding it.
        take = next(i for i, command in enumerate(plan) if command.startswith("take "))
        detours = [0, take + 2] if take + 1 < len(plan) else [0]
        actions = [places[0], *plan[: take + 1], places[-1], *plan[take + 1 :]][: len(plan) + len(detours)]
        labels = label_actions(engine, task, actions)
        assert [label.consistent for label in labels] == [i not in detours for i in range(len(actions))]
        for i in detours:
            assert len(labels[i].plan_after) == len(labels[i].plan_before)  # any place is one go to from the next
            assert len(labels[i + 1].plan_after) == len(labels[i].plan_before) - 1
        tested += len(detours)
    assert tested >= 8


def test_refused_commands_change_nothing_and_are_not_expert(games, engine):
    task = games["easy-uniform"][0]
    plan = expert_plan(_start(engine, task))
    labels = label_actions(engine, task, ["fly to the moon", ""])
    assert labels == [ExpertLabel("fly to the moon", plan, plan), ExpertLabel("", plan, plan)]
    assert not any(label.consistent or label.planned for label in labels)


def test_every_shortest_first_step_is_expert_not_only_the_planners(games, engine):
    """pick2 (visible): either object may be fetched first, so going to either place is expert,
    though the planner lists one; any other first move is not."""
    (task,) = [t for t in games["easy-uniform"] if t.task_type == "pick2"]
    sources = {
        f"go to {m.group(1)}" for c in alfworld_walkthrough(task) if (m := re.fullmatch(r"take .+ from (.+)", c))
    }
    assert len(sources) == 2
    labels = [label_actions(engine, task, [a])[0] for a in _start(engine, task)["admissible_commands"]]
    assert {label.action for label in labels if label.consistent} == sources
    assert sum(label.planned for label in labels) == 1


def _replay(engine, commands):
    """The state after ``commands`` from the start of the game loaded in ``engine``."""
    state = engine.reset()
    for command in commands:
        state, _, _ = engine.step(command)
    return state


def test_no_shorter_sequence_wins_a_three_step_game(games, engine):
    """The planner's length is the optimum: no sequence of one or two commands (searched
    exhaustively over distinct states) wins a game whose plan has three."""
    task = next(t for ts in games.values() for t in ts if len(expert_plan(_start(engine, t))) == 3)
    player = make_engine()  # no replanning: faster
    player.load(task.key)
    frontier, seen = [()], set()
    for _ in range(2):
        grown = []
        for prefix in frontier:
            for action in _replay(player, prefix)["admissible_commands"]:
                state = _replay(player, (*prefix, action))
                assert not state["won"], (*prefix, action)
                facts = frozenset(map(str, state["_facts"]))
                if facts not in seen:
                    seen.add(facts)
                    grown.append((*prefix, action))
        frontier = grown
    assert len(seen) > 10
