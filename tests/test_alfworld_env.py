"""AlfworldEnv on generated games: the TextEnv contract, verl-agent's reward and step limit, and
groups stepped in worker processes, checked against the engine and a sequential run."""

import functools
import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
from textworld.envs.pddl import textgen

from orsd_jax.envs import EnvPool, Task, parse_action
from orsd_jax.envs.alfworld import EASY, AlfworldEnv, GameDataError, build_prompt, generate_games, load_split
from orsd_jax.envs.alfworld.engine import NOTHING_HAPPENS


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> list[Task]:
    root = tmp_path_factory.mktemp("games")
    generate_games(root, {"train": 4}, seed=11, difficulty=EASY, workers=1)
    return load_split(root, "train")


def _walkthrough(task: Task) -> list[str]:
    return json.loads(Path(task.key).read_text())["walkthrough"]


def test_reset_shows_the_intro_and_admissible_commands(tasks):
    env = AlfworldEnv()
    first = env.reset(tasks[0])
    assert first.observation.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert first.observation.rstrip().endswith(f"Your task is to: {tasks[0].description}.")
    assert "look" in first.admissible_actions and "help" not in first.admissible_actions
    assert list(first.admissible_actions) == sorted(first.admissible_actions)
    assert (first.reward, first.done, first.won, first.score) == (0.0, False, False, 0.0)
    assert env.reset(tasks[0]) == first  # same game again: same start
    assert env.reset(tasks[1]).observation != first.observation


def test_walkthrough_wins_with_reward_on_the_last_step_only(tasks):
    env = AlfworldEnv()
    for task in tasks:
        env.reset(task)
        steps = [env.step(command) for command in _walkthrough(task)]
        assert [s.reward for s in steps] == [0.0] * (len(steps) - 1) + [10.0]
        assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]
        assert steps[-1].won and steps[-1].score == 1.0
        assert steps[-1].info == {"gamefile": task.key, "task_type": task.task_type, "steps": len(steps)}
        with pytest.raises(RuntimeError, match="over"):
            env.step("look")


def test_unparsed_answers_are_no_ops_that_use_up_steps(tasks):
    env = AlfworldEnv(max_steps=3)
    start = env.reset(tasks[0])
    steps = [env.step("") for _ in range(3)]
    assert all(s.observation == NOTHING_HAPPENS for s in steps)
    assert all(s.admissible_actions == start.admissible_actions for s in steps)
    assert [s.done for s in steps] == [False, False, True]
    assert not steps[-1].won and steps[-1].reward == 0.0
    with pytest.raises(RuntimeError, match="3 steps"):
        env.step("")
    walk = _walkthrough(tasks[0])
    env.reset(tasks[0])  # a reset starts the count again
    assert env.step(walk[0]).observation != NOTHING_HAPPENS


def test_misuse_gives_clear_errors(tasks, tmp_path):
    with pytest.raises(RuntimeError, match="before reset"):
        AlfworldEnv().step("look")
    with pytest.raises(ValueError, match="max_steps"):
        AlfworldEnv(max_steps=0)
    env = AlfworldEnv()
    with pytest.raises(ValueError, match="webshop"):
        env.reset(Task("webshop", "0", "fashion", "buy a hat"))
    env.reset(tasks[0])
    with pytest.raises(TypeError, match="string"):
        env.step(None)
    with pytest.raises(GameDataError, match="/nonexistent/game.tw-pddl"):
        env.reset(Task("alfworld", "/nonexistent/game.tw-pddl", "pick", "nothing"))
    broken = tmp_path / "game.tw-pddl"
    broken.write_text("{")
    with pytest.raises(GameDataError, match=str(broken)):
        env.reset(Task("alfworld", str(broken), "pick", "nothing"))
    assert env.reset(tasks[0]).observation.startswith("-= Welcome")  # still usable


def test_pickles_for_spawned_workers(tasks):
    env = AlfworldEnv(max_steps=7)
    env.reset(tasks[0])
    clone = pickle.loads(pickle.dumps(env))
    assert clone.max_steps == 7
    assert clone.reset(tasks[0]) == env.reset(tasks[0])
    env.close()


def test_prompt_answer_and_env_fit_together(tasks):
    """An answer in the format the prompt asks for parses to an admissible command the env takes."""
    env = AlfworldEnv()
    start = env.reset(tasks[0])
    prompt = build_prompt(tasks[0].description, start.observation, start.admissible_actions, [], 0)
    command = _walkthrough(tasks[0])[0]
    assert f"'{command}'" in prompt
    parsed = parse_action(f"<think>I should look there.</think><action>{command}</action>", start.admissible_actions)
    assert parsed.valid and env.step(parsed.action).observation != NOTHING_HAPPENS


def _play(stepper, tasks_per_env, plans):
    """Resets, then steps each env through its plan (None once it has none left)."""
    history = [stepper.reset(tasks_per_env)]
    for t in range(max(map(len, plans))):
        history.append(stepper.step([plan[t] if t < len(plan) else None for plan in plans]))
    return history


class _Sequential:
    def __init__(self, n):
        self.envs = [AlfworldEnv() for _ in range(n)]

    def reset(self, tasks):
        return [env.reset(task) for env, task in zip(self.envs, tasks)]

    def step(self, actions):
        return [None if a is None else env.step(a) for env, a in zip(self.envs, actions)]


def test_groups_in_worker_processes_match_sequential_play(tasks):
    group = 3
    per_env = [task for task in tasks[:2] for _ in range(group)]  # two tasks, three copies each
    plans = [_walkthrough(task) if i % group else ["", *_walkthrough(task)] for i, task in enumerate(per_env)]
    with EnvPool(functools.partial(AlfworldEnv, max_steps=50), len(per_env), n_workers=2) as pool:
        parallel = _play(pool, per_env, plans)
    sequential = _play(_Sequential(len(per_env)), per_env, plans)
    assert parallel == sequential
    finals = [next(s for s in reversed([h[i] for h in parallel]) if s is not None) for i in range(len(per_env))]
    assert all(step.won for step in finals)
    assert parallel[0][0] == parallel[0][1] == parallel[0][2]  # a group starts from one state


def _random_play(tasks: list[Task], steps: int = 12, seed: int = 0) -> list[list[str]]:
    """Each task twice from reset (the second time from the engine's caches), a seeded random
    admissible command per step: every observation and command list seen."""
    env, rng, seen = AlfworldEnv(max_steps=steps), random.Random(seed), []
    for task in tasks + tasks:
        state, texts = env.reset(task), []
        while True:
            texts += [state.observation, *state.admissible_actions]
            if state.done:
                break
            state = env.step(rng.choice(state.admissible_actions))
        seen.append(texts)
    env.close()
    return seen


UNMEMOISED = """
import json, pickle, sys
from orsd_jax.envs.alfworld import engine
import test_alfworld_env as t
engine._memoise_parses = lambda: None  # TextWorld as installed: every text parsed by TatSu
print(json.dumps(t._random_play(pickle.load(sys.stdin.buffer))))
"""


def test_memoised_parses_give_textworlds_own_play(tasks):
    """The engine's memoised TatSu parses (templates, rule conditions, each game's grammar) against
    TextWorld without them, in a fresh process: the same observations and commands, step by step."""
    child = subprocess.run(
        [sys.executable, "-c", UNMEMOISED],
        input=pickle.dumps(tasks),
        capture_output=True,
        check=True,
        cwd=Path(__file__).parent,
    )
    assert _random_play(tasks) == json.loads(child.stdout)
    assert textgen._parse_and_convert.cache_info().hits > 0  # the memoised path is the one that ran
