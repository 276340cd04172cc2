"""Expert demonstrations for the supervised warm start.

A demonstration replays a game's planner walkthrough in the real engine and records, per step,
exactly the prompt the policy sees during RL (``rollout.fit_prompt`` with the same history rule)
and a target answer in the RL answer format: a short reasoning sentence derived from the task
and the command, then the command, ``<think>...</think><action>...</action>``. With
``reasoning=False`` the think block is empty, which small models learn faster.

The planner knows where every object is; the agent does not (ALFWorld shows an object only once
the agent is at its receptacle). Demonstrations can therefore start with a few detours to other
receptacles before the plan, so the policy also sees what to do after a fruitless visit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence

from orsd_jax import chat
from orsd_jax.envs.base import EnvStep, Task, TextEnv
from orsd_jax.rollout import PromptBuilder, RolloutConfig, fit_prompt

_REASONS = [
    (re.compile(r"go to (.+)"), "I go to the {0} to look for what the task needs or to use it."),
    (re.compile(r"take (.+) from (.+)"), "The {0} is here at the {1}, so I take it."),
    (re.compile(r"move (.+) to (.+)"), "I hold the {0}, so I put it in or on the {1}."),
    (re.compile(r"open (.+)"), "The {0} is closed; I open it to see inside."),
    (re.compile(r"close (.+)"), "I close the {0}."),
    (re.compile(r"heat (.+) with (.+)"), "The task needs the {0} hot, so I heat it with the {1}."),
    (re.compile(r"cool (.+) with (.+)"), "The task needs the {0} cool, so I cool it with the {1}."),
    (re.compile(r"clean (.+) with (.+)"), "The task needs the {0} clean, so I clean it with the {1}."),
    (re.compile(r"use (.+)"), "I turn on the {0} to look at what I hold under its light."),
    (re.compile(r"examine (.+)"), "I examine the {0} to check it."),
    # WebShop's commands. An option is named in the think before it is clicked, so that the action
    # can copy it from there (not yet measured): without a reason, a warm start clicked one of the
    # goal's options in 6 of its 42 option clicks (docs/results/warmstart.md). A product id has ten
    # letters and digits.
    (re.compile(r"search\[(.+)\]"), "I search for the task's own words."),
    (re.compile(r"click\[buy now\]"), "This product has what the task asks for, so I buy it."),
    (re.compile(r"click\[(?=[a-z]*\d)([a-z0-9]{10})\]"), "The product {0} matches the task, so I open it."),
    (re.compile(r"click\[(next >|< prev)\]"), "The product the task describes is not on this page."),
    (re.compile(r"click\[(.+)\]"), "The task asks for {0}, so I choose it."),
]


@dataclasses.dataclass(frozen=True)
class Demonstration:
    game: str
    step: int
    user_text: str
    prompt_ids: tuple[int, ...]
    answer: str
    answer_ids: tuple[int, ...]  # the answer's tokens followed by the end-of-turn token


def demo_answer(task_description: str, command: str, reasoning: bool = True) -> str:
    """``<think>why</think><action>command</action>``; the why is built from the task and command."""
    if not reasoning:
        return f"<think></think><action>{command}</action>"
    why = next(
        (template.format(*m.groups()) for pattern, template in _REASONS if (m := pattern.fullmatch(command))), ""
    )
    return f"<think>My task is to {task_description}. {why}".rstrip() + f"</think><action>{command}</action>"


def record_episode(
    env: TextEnv,
    task: Task,
    actions: Sequence[str] | Callable[[EnvStep], Sequence[str]],
    config: RolloutConfig,
    build_prompt: PromptBuilder,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
) -> list[tuple[str, list[int], str, str]]:
    """Plays ``actions`` (or ``actions(first observation)``) and returns, per step, (user text,
    prompt ids, action, observation) exactly as the rollout builds them."""
    current = env.reset(task)
    if callable(actions):
        actions = actions(current)
    history: list[tuple[str, str]] = []
    records = []
    for action in actions:
        if current.done:
            break
        text, ids, _ = fit_prompt(
            build_prompt,
            fmt,
            tokenizer,
            config.max_prompt_tokens,
            task,
            current.observation,
            current.admissible_actions,
            history,
            len(history),
            config.history_length,
        )
        records.append((text, ids, action, current.observation))
        history.append((current.observation, action))
        current = env.step(action)
    return records


def walkthrough_demos(
    env: TextEnv,
    tasks: Iterable[Task],
    walkthrough: Callable[[Task], Sequence[str]],
    config: RolloutConfig,
    build_prompt: PromptBuilder,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
    reasoning: bool = True,
    max_detours: int = 0,
    seed: int = 0,
) -> list[Demonstration]:
    """Demonstrations of every task's expert plan (``walkthrough(task) -> commands``), each after
    0..``max_detours`` random detours."""
    demos = []
    end = [fmt.stop_token_ids[0]]
    for index, task in enumerate(tasks):
        rng = random.Random(f"{seed}/{index}")  # not the key: a game's key is its path on this machine
        plan = walkthrough(task)
        records = record_episode(
            env,
            task,
            functools.partial(with_detours, plan, rng=rng, max_detours=max_detours),
            config,
            build_prompt,
            tokenizer=tokenizer,
            fmt=fmt,
        )
        for step, (text, ids, command, _) in enumerate(records):
            answer = demo_answer(task.description, command, reasoning)
            demos.append(
                Demonstration(task.key, step, text, tuple(ids), answer, tuple(chat.encode(tokenizer, answer) + end))
            )
    return demos


def alfworld_walkthrough(task: Task) -> list[str]:
    """The planner's plan stored in an ALFWorld game file."""
    with open(task.key) as f:
        return list(json.load(f)["walkthrough"])


def with_detours(plan: Sequence[str], first: EnvStep, rng: random.Random, max_detours: int) -> list[str]:
    """``plan`` after 0..``max_detours`` visits to other places the first observation offers."""
    if not plan or not plan[0].startswith("go to "):
        return list(plan)
    places = [a for a in first.admissible_actions if a.startswith("go to ") and a != plan[0]]
    return rng.sample(places, min(len(places), rng.randint(0, max_detours))) + list(plan)


def write_jsonl(demos: Sequence[Demonstration], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        for demo in demos:
            f.write(json.dumps(dataclasses.asdict(demo)) + "\n")
