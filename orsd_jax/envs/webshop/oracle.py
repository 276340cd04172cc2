"""A scripted policy that buys the goal product: the reference run for the environment's tests.

It searches the goal product's title (or, ``search="instruction"``, the goal's own words, which
a policy can copy from its prompt), opens the product (paging through the results when it is not
on the first page), clicks each goal option value the page offers, and buys.
"""

from __future__ import annotations

from orsd_jax.envs.base import EnvStep, Task
from orsd_jax.envs.webshop.env import WebShopEnv
from orsd_jax.envs.webshop.goals import Goal
from orsd_jax.envs.webshop.pages import SEARCH_PLACEHOLDER
from orsd_jax.envs.webshop.search import search_argument

SEARCHES = ("title", "instruction")


class OraclePolicy:
    def __init__(self, goal: Goal, search: str = "title"):
        if search not in SEARCHES:
            raise ValueError(f"unknown oracle search {search!r}; expected one of {SEARCHES}")
        self._goal = goal
        self._query = search_argument(goal.name if search == "title" else goal.instruction_text)
        self._pending = list(goal.option_values)

    def __call__(self, step: EnvStep) -> str:
        actions = set(step.admissible_actions)
        open_product = f"click[{self._goal.asin.lower()}]"
        if SEARCH_PLACEHOLDER in actions:
            return f"search[{self._query}]"
        if open_product in actions:
            return open_product
        if "click[buy now]" in actions:
            while self._pending:
                choose = f"click[{self._pending.pop(0)}]"
                if choose in actions:
                    return choose
            return "click[buy now]"
        if "click[next >]" in actions:
            return "click[next >]"
        return ""  # lost: wait for the step limit


def oracle_episode(env: WebShopEnv, task: Task, search: str = "title") -> tuple[list[str], EnvStep]:
    """Plays one episode of ``task`` with the oracle: its commands and the last step. The env is
    deterministic, so replaying the commands (a demonstration's walkthrough) gives the same pages."""
    step, actions = env.reset(task), []
    policy = OraclePolicy(env.goal, search)
    while not step.done:
        actions.append(policy(step))
        step = env.step(actions[-1])
    return actions, step


def run_oracle(env: WebShopEnv, task: Task) -> EnvStep:
    """Plays one episode with the oracle; returns the last step."""
    return oracle_episode(env, task)[1]
