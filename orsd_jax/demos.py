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
from orsd_jax.envs.webshop.goals import option_segment
from orsd_jax.rollout import PromptBuilder, RolloutConfig, fit_prompt

_ALFWORLD_REASONS = [
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
]


# WebShop's commands, without the restated task (an instruction is about 40 tokens to copy in every
# answer). On the product page the reason restates the goal's options instead and names the one after
# the last click: with one earlier page in the prompt, the last click is all the policy sees of what
# it has chosen (reasons that restated the whole task got one of the goal's options in 35 of 124
# option clicks and won no goal with options, docs/results/warmstart.md). A product id has ten
# letters and digits.
_WEBSHOP_REASONS = [
    (re.compile(r"search\[(.+)\]"), "I search for the task's own words."),
    (re.compile(r"click\[(?=[a-z]*\d)([a-z0-9]{10})\]"), "The product {0} matches the task, so I open it."),
    (re.compile(r"click\[(next >|< prev)\]"), "The product the task describes is not on this page."),
]
_OPTION_CLICK = re.compile(r"click\[(.+)\]")


def _product_page_reason(task_description: str, value: str, previous: str | None) -> str:
    """Why click ``value`` (``buy now`` or an option): the goal's options, then where the last
    click left off."""
    stated = option_segment(task_description)
    last = m.group(1) if previous and (m := _OPTION_CLICK.fullmatch(previous)) else None
    if value == "buy now":
        if stated is None or last not in stated[1]:
            return "This product has what the task asks for, so I buy it."
        return f"The task asks for {stated[0]}. I chose {last} last, the last of them, so I buy it."
    if stated is None:
        return f"The task asks for {value}, so I choose it."
    if last is not None and last in stated[1]:
        return f"The task asks for {stated[0]}. I chose {last} last, so next I choose {value}."
    return f"The task asks for {stated[0]}. I choose {value} first."


@dataclasses.dataclass(frozen=True)
class Demonstration:
    game: str
    step: int
    user_text: str
    prompt_ids: tuple[int, ...]
    answer: str
    answer_ids: tuple[int, ...]  # the answer's tokens followed by the end-of-turn token


def demo_answer(task_description: str, command: str, reasoning: bool = True, previous: str | None = None) -> str:
    """``<think>why</think><action>command</action>``; the why is built from the task, the command
    and the ``previous`` one (WebShop's product page)."""
    if not reasoning:
        return f"<think></think><action>{command}</action>"

    def reason(reasons):
        return next((why.format(*m.groups()) for pattern, why in reasons if (m := pattern.fullmatch(command))), None)

    if command.startswith("search["):
        return f"<think>{reason(_WEBSHOP_REASONS)}</think><action>{command}</action>"
    if click := _OPTION_CLICK.fullmatch(command):
        why = reason(_WEBSHOP_REASONS) or _product_page_reason(task_description, click.group(1), previous)
        return f"<think>{why}</think><action>{command}</action>"
    why = reason(_ALFWORLD_REASONS) or ""
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
            answer = demo_answer(task.description, command, reasoning, records[step - 1][2] if step else None)
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
