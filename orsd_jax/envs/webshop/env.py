"""WebShop as a ``TextEnv``: the original's text-mode transitions on our own pages and search.

Commands are ``search[keywords]`` and ``click[label]``, read with the original's greedy
``name[argument]`` pattern (the argument lower-cased). A search runs from any page whenever its
argument is non-empty; a click runs when its label is a clickable of the current page other
than ``search``. Anything else, the empty command included, is a no-op that leaves the page as
it was, is flagged ``info["action_valid"] = False`` and still counts toward the step limit.

Transitions: ``back to search`` returns to the start page and forgets the search; ``next >`` /
``< prev`` on results change the results page; ``< prev`` on an item page returns to the results
and forgets the chosen options, on a description/features/reviews page returns to the item
page keeping them; an ASIN opens that item; an option value selects it for its option;
``buy now`` ends the episode with the purchase reward. An episode that reaches ``max_steps``
without buying ends with score 0.

Rewards follow verl-agent's training signal by default (``reward="success"``): ``reward`` is 10
when the purchase scores exactly 1, else 0; with ``reward="score"`` it is 10 x the purchase's
score (WebShop's partial credit). ``score`` is the raw WebShop reward (0 without purchase);
``won`` is score == 1.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from orsd_jax.envs.base import EnvStep, Task
from orsd_jax.envs.webshop.goals import Goal
from orsd_jax.envs.webshop.pages import (
    RESULTS_PER_PAGE,
    SUB_PAGES,
    Page,
    View,
    done_page,
    item_page,
    results_page,
    start_page,
    sub_page,
)
from orsd_jax.envs.webshop.reward import RewardBreakdown, get_reward
from orsd_jax.envs.webshop.world import World, WorldKey, world_for

DEFAULT_MAX_STEPS = 15
WIN_REWARD = 10.0
_COMMAND = re.compile(r"(.+)\[(.+)\]")


def parse_command(action: str) -> tuple[str, str | None]:
    """``(name, argument)`` of a command; the argument is None when there are no brackets."""
    match = _COMMAND.match(action)
    if match is None:
        return action, None
    return match.group(1), match.group(2).lower()


@dataclasses.dataclass(frozen=True)
class Session:
    """Where the agent is: the page shown, the last search and the item and options chosen."""

    view: View = "start"
    keywords: str = ""
    page: int = 1
    results: tuple[str, ...] = ()  # ASINs of the last search, best first
    asin: str | None = None
    options: tuple[tuple[str, str], ...] = ()  # option name -> chosen value, in first-chosen order


def _choose(options: tuple[tuple[str, str], ...], name: str, value: str) -> tuple[tuple[str, str], ...]:
    chosen = dict(options)
    chosen[name] = value
    return tuple(chosen.items())


class WebShopEnv:
    """One WebShop session at a time; build many (e.g. in an ``EnvPool``) for groups.

    ``data_dir`` (or ``$WEBSHOP_DATA``) holds the official files; ``use_small`` picks the
    1000-product files, else the full catalog; ``num_products`` keeps the first N products.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        max_steps: int = DEFAULT_MAX_STEPS,
        num_products: int | None = None,
        human_goals: bool = False,
        use_small: bool = True,
        reward: str = "success",
    ):
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        if reward not in ("success", "score"):
            raise ValueError(f"reward must be 'success' or 'score', got {reward!r}")
        self.max_steps = max_steps
        self.reward = reward
        self._key = WorldKey.make(data_dir, use_small, num_products, human_goals)
        self._world: World = world_for(self._key)
        self._goal: Goal | None = None
        self._session = Session()
        self._page: Page | None = None
        self._steps = 0
        self._done = False

    # The world is rebuilt (from the per-process cache) rather than pickled.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_world"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._world = world_for(self._key)

    @property
    def world(self) -> World:
        return self._world

    @property
    def goal(self) -> Goal:
        if self._goal is None:
            raise RuntimeError("no goal yet: call reset(task) first")
        return self._goal

    @property
    def session(self) -> Session:
        """Where the agent is now (a frozen ``Session``: reading it changes nothing)."""
        return self._session

    def reset(self, task: Task) -> EnvStep:
        if task.env != "webshop":
            raise ValueError(f"WebShopEnv cannot play a {task.env!r} task")
        goals = self._world.goals
        try:
            index = int(task.key)
        except ValueError:
            raise ValueError(f"WebShop task key must be a goal index, got {task.key!r}") from None
        if not 0 <= index < len(goals):
            raise ValueError(f"goal index {index} out of range: this world has {len(goals)} goals")
        self._goal = goals[index]
        self._session = Session()
        self._page = self._render()
        self._steps = 0
        self._done = False
        info = {"action_valid": True, "page": "start", "truncated": False}
        return EnvStep(self._page.text, self._page.available_actions, info=info)

    def step(self, action: str) -> EnvStep:
        if self._page is None:
            raise RuntimeError("call reset(task) before step()")
        if self._done:
            raise RuntimeError("this WebShop episode has ended; call reset(task) to start another")
        self._steps += 1
        name, arg = parse_command(action) if isinstance(action, str) else ("", None)
        purchase: RewardBreakdown | None = None
        if name == "search" and arg:
            self._session = Session("results", arg, 1, tuple(self._world.engine.search(arg)))
            valid = True
        elif name == "click" and arg is not None and arg in self._page.clickables and arg != "search":
            purchase = self._click(arg)
            valid = True
        else:
            valid = False
        self._page = self._render(purchase)
        truncated = purchase is None and self._steps >= self.max_steps
        self._done = purchase is not None or truncated
        won = purchase is not None and purchase.score == 1.0
        info: dict[str, Any] = {"action_valid": valid, "page": self._page.view, "truncated": truncated}
        if purchase is not None:
            info.update(asin=self._session.asin, options=dict(self._session.options), reward_info=purchase.as_dict())
        return EnvStep(
            observation=self._page.text,
            admissible_actions=self._page.available_actions,
            reward=WIN_REWARD * (float(won) if self.reward == "success" else purchase.score if purchase else 0.0),
            done=self._done,
            won=won,
            score=purchase.score if purchase is not None else 0.0,
            info=info,
        )

    def close(self) -> None:
        """Nothing to release: the world is shared by the process's environments."""

    def _click(self, label: str) -> RewardBreakdown | None:
        assert self._page is not None  # step() checked it
        s, target = self._session, self._page.clickables[label]
        if label == "buy now":
            assert s.asin is not None  # buy now is only on an item page
            self._session = dataclasses.replace(s, view="done")
            product = self._world.catalog.by_asin[s.asin]
            return get_reward(product, self.goal, self._world.goal_set.prices[s.asin], dict(s.options))
        if label == "back to search":
            s = Session()
        elif label == "next >" and s.view == "results":
            s = dataclasses.replace(s, page=s.page + 1)
        elif label == "< prev" and s.view == "results":
            s = dataclasses.replace(s, page=s.page - 1)
        elif label == "< prev" and s.view in SUB_PAGES:
            s = dataclasses.replace(s, view="item")
        elif label == "< prev" and s.view == "item":
            s = dataclasses.replace(s, view="results", asin=None, options=())
        elif label in SUB_PAGES:
            s = dataclasses.replace(s, view=label)
        elif target.kind == "product":
            s = dataclasses.replace(s, view="item", asin=label.upper())
        elif target.kind == "option":
            s = dataclasses.replace(s, view="item", options=_choose(s.options, target.option_name, label))
        else:  # every button of every page is handled above
            raise AssertionError(f"unhandled clickable {label!r} on the {s.view} page")
        self._session = s
        return None

    def _render(self, purchase: RewardBreakdown | None = None) -> Page:
        s, instruction = self._session, self.goal.instruction_text
        by_asin = self._world.catalog.by_asin
        if s.view == "start":
            return start_page(instruction)
        if s.view == "results":
            shown = s.results[(s.page - 1) * RESULTS_PER_PAGE : s.page * RESULTS_PER_PAGE]
            return results_page(instruction, [by_asin[a] for a in shown], s.page, len(s.results))
        assert s.asin is not None  # the item, its sub-pages and the done page show a chosen item
        if s.view == "item":
            return item_page(instruction, by_asin[s.asin])
        if s.view in SUB_PAGES:
            return sub_page(instruction, by_asin[s.asin], s.view)
        assert purchase is not None  # the done page is rendered once, with the purchase
        return done_page(s.asin, dict(s.options), purchase.score)
