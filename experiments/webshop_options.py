"""Does a WebShop policy choose the options its goal names? Replays an evaluation's answers.

    python -m experiments.webshop_options RUN/eval_steps.jsonl [--data-dir DIR]

Every episode of ``eval_steps.jsonl`` (written by ``experiments.evaluate`` and the warm start's
evaluation) is played again in the real environment with the same commands, so option clicks
are those that changed the chosen options on a product page, not a guess from the text. Prints
per goal option count: episodes, wins, option clicks and how many named a goal option, and
purchases whose chosen options hold every goal option.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
from collections.abc import Iterable, Sequence

from orsd_jax.envs.actions import parse_action
from orsd_jax.envs.base import Task
from orsd_jax.envs.webshop import WebShopEnv
from orsd_jax.envs.webshop.world import goal_task


@dataclasses.dataclass(frozen=True)
class EpisodeOptions:
    goal_options: frozenset[str]  # the goal's option values, lower-cased
    option_clicks: int  # clicks that changed the chosen options
    named_clicks: int  # of those, clicks of a goal option value
    bought: bool
    bought_all: bool  # bought with every goal option chosen
    won: bool


def replay(env: WebShopEnv, task: Task, answers: Sequence[str]) -> EpisodeOptions:
    """``answers`` played as the rollout sends them: the parsed action, or a no-op."""
    step = env.reset(task)
    goal = frozenset(v.lower() for v in env.goal.option_values)
    clicks = named = 0
    for answer in answers:
        if step.done:
            raise ValueError(f"task {task.key}: more answers than the episode's steps")
        before = dict(env.session.options)
        step = env.step(parse_action(answer, step.admissible_actions).action or "")
        changed = [v for k, v in env.session.options if before.get(k) != v]
        clicks += bool(changed)
        named += any(v.lower() in goal for v in changed)
    bought = "reward_info" in step.info
    options = {v.lower() for v in step.info.get("options", {}).values()}
    return EpisodeOptions(goal, clicks, named, bought, bought and goal <= options, step.won)


def by_option_count(episodes: Iterable[EpisodeOptions]) -> str:
    """A markdown table: one row per goal option count and a total row."""
    groups: dict[int, list[EpisodeOptions]] = collections.defaultdict(list)
    for e in episodes:
        groups[len(e.goal_options)].append(e)
    fields = ("won", "option_clicks", "named_clicks", "bought", "bought_all")
    lines = [
        "| goal options | episodes | won | option clicks | naming a goal option | bought | bought with every goal option |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(str(n), groups[n]) for n in sorted(groups)] + [("all", [e for n in sorted(groups) for e in groups[n]])]
    for name, es in rows:
        sums = (sum(getattr(e, f) for e in es) for f in fields)
        lines.append(f"| {name} | {len(es)} | " + " | ".join(map(str, sums)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", help="eval_steps.jsonl of a WebShop evaluation")
    p.add_argument("--data-dir", default=os.environ.get("WEBSHOP_DATA"), help="WebShop data (default $WEBSHOP_DATA)")
    p.add_argument("--max-steps", type=int, default=15, help="the step limit the evaluation ran under, or more")
    args = p.parse_args(argv)
    answers: dict[str, list[str]] = collections.defaultdict(list)
    with open(args.steps) as f:
        for line in f:
            row = json.loads(line)
            answers[row["key"]].append(row["answer"])
    env = WebShopEnv(args.data_dir, max_steps=args.max_steps)
    goals = env.world.goals
    print(by_option_count(replay(env, goal_task(int(k), goals[int(k)]), a) for k, a in answers.items()))


if __name__ == "__main__":
    main()
