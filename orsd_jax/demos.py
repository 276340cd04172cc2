"""Expert demonstrations for the supervised warm start.

A demonstration replays a game's planner walkthrough in the real engine and records, per step,
exactly the prompt the policy sees during RL (``rollout.fit_prompt`` with the same history rule)
and a target answer in the RL answer format: a short reasoning sentence derived from the task
and the command, then the command, ``<think>...</think><action>...</action>``. With
``reasoning=False`` the think block is empty, which small models learn faster.

The planner knows where every object is; the agent does not (ALFWorld shows an object only once
the agent is at its receptacle). Cloning the plan as is teaches targets the prompt cannot
predict: a warm-started 135M model then guessed the most salient place, mostly the one it stood
at, an inadmissible command. So the demonstrator (``SearchingExpert``) follows the plan except
where the plan walks straight to a hidden object: there it searches, visiting the receptacles in
the order of the admissible list, each time the one after where it stands, until it arrives where
the object is. Every target is then a function of what the prompt shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import re
from typing import Callable, Iterable, Sequence

from orsd_jax import chat
from orsd_jax.envs.base import EnvStep, Task, TextEnv
from orsd_jax.rollout import PromptBuilder, RolloutConfig, Step, Trajectory, fit_prompt
from orsd_jax.rubrics.generate import RubricConfig, group_prompt

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
    why = next((template.format(*m.groups()) for pattern, template in _REASONS if (m := pattern.fullmatch(command))), "")
    return f"<think>My task is to {task_description}. {why}".rstrip() + f"</think><action>{command}</action>"


_GO_TO = re.compile(r"go to (.+)")


class SearchingExpert:
    """A policy (``EnvStep -> command``, ``None`` when done) that plays ``plan`` but searches for
    what the plan takes or uses instead of walking straight to it.

    A search is a plan step ``go to R`` whose next command (after opening ``R``) takes or uses
    something. It is replaced by visits in the admissible list's order: from the place the agent
    stands at, the first ``go to`` entry after it (wrapping around), until the agent is at ``R``.
    Other ``go to`` steps (to a receptacle the task names or its kind implies) are kept.
    """

    def __init__(self, plan: Sequence[str]):
        self.plan, self.next, self.at = list(plan), 0, None

    def _searches(self, i: int) -> bool:
        j = i + 1 + (i + 1 < len(self.plan) and self.plan[i + 1].startswith("open "))
        return j < len(self.plan) and self.plan[j].startswith(("take ", "use "))

    def __call__(self, current: EnvStep) -> str | None:
        while self.next < len(self.plan):
            command, m = self.plan[self.next], _GO_TO.fullmatch(self.plan[self.next])
            if m and self._searches(self.next) and self.at != m.group(1):
                places = [a for a in current.admissible_actions if a.startswith("go to ")]
                here = f"go to {self.at}" if self.at else ""
                command = next((a for a in places if a > here), places[0])
            else:
                self.next += 1
                if m and self.at == m.group(1):  # a search arrived: the plan's own step is done
                    continue
            if go := _GO_TO.fullmatch(command):
                self.at = go.group(1)
            return command
        return None


def _replay(actions: Sequence[str]) -> Callable[[EnvStep], str | None]:
    remaining = iter(actions)
    return lambda current: next(remaining, None)


def record_episode(
    env: TextEnv,
    task: Task,
    policy: Sequence[str] | Callable[[EnvStep], str | None],
    config: RolloutConfig,
    build_prompt: PromptBuilder,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
) -> list[tuple[str, list[int], str, str]]:
    """Plays ``policy`` (a list of commands, or ``EnvStep -> command``, ``None`` to stop) until the
    episode ends and returns, per step, (user text, prompt ids, action, observation) exactly as the
    rollout builds them."""
    current = env.reset(task)
    if not callable(policy):
        policy = _replay(policy)
    history: list[tuple[str, str]] = []
    records = []
    while not current.done and (action := policy(current)) is not None:
        text, ids, _ = fit_prompt(
            build_prompt, fmt, tokenizer, config.max_prompt_tokens, task, current.observation,
            current.admissible_actions, history, len(history), config.history_length,
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
) -> list[Demonstration]:
    """Demonstrations of a ``SearchingExpert`` on every task's plan (``walkthrough(task) -> commands``)."""
    demos = []
    end = [fmt.stop_token_ids[0]]
    for task in tasks:
        records = record_episode(env, task, SearchingExpert(walkthrough(task)), config, build_prompt,
                                 tokenizer=tokenizer, fmt=fmt)  # fmt: skip
        for step, (text, ids, command, _) in enumerate(records):
            answer = demo_answer(task.description, command, reasoning)
            demos.append(Demonstration(task.key, step, text, tuple(ids), answer, tuple(chat.encode(tokenizer, answer) + end)))
    return demos


# Rubric writing. A 135M model writes no usable rubric untrained, so the CPU warm start also shows
# it the rubric format: for a group of attempts at a game (the plan, a search, a wander, half the
# plan then a wander), a list of process criteria read off the planner's plan.

_CRITERIA = [
    (re.compile(r"take (.+) from (.+)"), "The agent takes the {0} from the {1}."),
    (re.compile(r"(heat|cool|clean) (.+) with (.+)"), "The agent uses the {2} to {0} the {1} before putting it anywhere."),
    (re.compile(r"use (.+)"), "The agent turns on the {0} while holding the object."),
    (re.compile(r"move (.+) to (.+)"), "The agent puts the {0} in or on the {1}."),
]
_HABITS = (
    "The agent only chooses actions from the admissible list.",
    "The agent goes to places that can hold the object instead of wandering.",
    "The agent does not repeat an action that changed nothing.",
    "The agent does not pick up objects the task does not mention.",
)


def plan_criteria(plan: Sequence[str]) -> tuple[str, ...]:
    """Seven process criteria: the plan's key actions in order (up to five), then general habits."""
    found = []
    for command in plan:
        for pattern, template in _CRITERIA:
            if (m := pattern.fullmatch(command)) and (c := template.format(*m.groups())) not in found:
                found.append(c)
    found = found[:5]
    return (*found, *_HABITS[: 7 - len(found)])


def rubric_demo(
    env: TextEnv,
    task: Task,
    plan: Sequence[str],
    rollout: RolloutConfig,
    rubric: RubricConfig,
    build_prompt: PromptBuilder,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
    rng: random.Random,
) -> Demonstration:
    """The rubric writer's prompt for four attempts at ``task`` (as ``generate_bundles`` builds it:
    the plan, a search, a wander, half the plan then a wander) and the plan's criteria as a
    numbered list."""

    def wander(prefix: Sequence[str], n: int) -> Callable[[EnvStep], str | None]:
        """``prefix``, then ``n`` visits to random places."""
        steps = itertools.count()

        def policy(current: EnvStep) -> str | None:
            k = next(steps)
            if k < len(prefix):
                return prefix[k]
            places = [a for a in current.admissible_actions if a.startswith("go to ")]
            return rng.choice(places) if k < len(prefix) + n else None

        return policy

    half = len(plan) // 2
    variants = [plan, SearchingExpert(plan), wander((), len(plan)), wander(plan[:half], len(plan) - half)]
    attempts = []
    for actions in variants:
        records = record_episode(env, task, actions, rollout, build_prompt, tokenizer=tokenizer, fmt=fmt)
        steps = tuple(Step(text, tuple(ids), (), (), "", observation, action, True, 0.0, False, 0)
                      for text, ids, action, observation in records)  # fmt: skip
        attempts.append(Trajectory(task, steps, won=False, score=0.0))  # outcomes are never shown
    ids = group_prompt(task, attempts, rubric, tokenizer=tokenizer, fmt=fmt)
    answer = "\n".join(f"{k}. {c}" for k, c in enumerate(plan_criteria(plan), start=1))
    text = tokenizer.decode(ids)
    return Demonstration(task.key, -1, text, tuple(ids), answer, tuple(chat.encode(tokenizer, answer) + [fmt.stop_token_ids[0]]))


def alfworld_walkthrough(task: Task) -> list[str]:
    """The planner's plan stored in an ALFWorld game file."""
    with open(task.key) as f:
        return list(json.load(f)["walkthrough"])


def write_jsonl(demos: Sequence[Demonstration], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        for demo in demos:
            f.write(json.dumps(dataclasses.asdict(demo)) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[Demonstration]:
    with open(path) as f:
        return [Demonstration(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(line).items()}) for line in f]
