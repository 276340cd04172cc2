"""Expert labels of WebShop steps, from the oracle's route computed on the live session.

Let ``d(s)`` be the number of steps the oracle's route (``OraclePolicy``: search the goal's title,
page to the goal, open it, click the goal's option values, buy) needs from state ``s`` to buy the
goal product with every goal option value its item page offers. It is the shortest of:

- fresh, from any page: ``search[title]`` (1) + ``next >`` to the page ``p`` listing the goal in
  that search's results (p - 1) + open it (1) + one click per offered goal value (n) + ``buy now``
  (1); none when the title search does not list the goal;
- on page ``k`` of a search listing the goal on page ``p``: |p - k| paging clicks + 1 + n + 1;
- on the goal's item page: its offered goal values not chosen yet + 1; on its description,
  features or reviews page 1 more (``< prev`` returns to the item page, keeping the options);
- on another product's item page: ``< prev`` (back to the same results page, options forgotten)
  + the route from there; on its sub-pages 1 more.

Once the episode has ended, ``d`` is 0 if the purchase won (score 1), else infinite (None): a
purchase that does not win and a step that reaches the env's ``max_steps`` both end it, so label
with the ``max_steps`` the episode was played with. An action taken in ``s`` and leading to
``s'`` is **expert-consistent** iff ``d(s') = d(s) - 1``. As in ALFWorld this accepts every action
that starts a shortest route (e.g. a different search that also lists the goal on page 1), while
a detour (a wrong product, a sub-page, a search that does not list the goal), a wrong or repeated
option value, a premature ``buy now`` and a no-op are not consistent, and the step that returns
to a shortest route is. Caveat: a search for other words that lists the goal on an earlier page
than the title search lowers ``d`` by more than 1 and is not consistent (never on the
1000-product data, where every goal is on page 1 of its title search).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from orsd_jax.envs.base import EnvStep, Task
from orsd_jax.envs.webshop.env import Session, WebShopEnv, parse_command
from orsd_jax.envs.webshop.goals import Goal
from orsd_jax.envs.webshop.pages import RESULTS_PER_PAGE, SUB_PAGES, item_page
from orsd_jax.envs.webshop.search import search_argument
from orsd_jax.envs.webshop.world import World

Route = tuple[str, ...]
PREV, NEXT, BUY = "click[< prev]", "click[next >]", "click[buy now]"


@dataclasses.dataclass(frozen=True)
class ExpertLabel:
    """One step: the action and the oracle's shortest routes from the states before and after it."""

    action: str
    route_before: Route | None  # None: no route (d infinite)
    route_after: Route | None  # () once a purchase has won

    @property
    def distance_before(self) -> int | None:
        return None if self.route_before is None else len(self.route_before)

    @property
    def distance_after(self) -> int | None:
        return None if self.route_after is None else len(self.route_after)

    @property
    def consistent(self) -> bool:
        """``d(s') = d(s) - 1``: the action starts a shortest route from the state it was taken in."""
        if self.route_before is None or self.route_after is None:
            return False
        return len(self.route_after) == len(self.route_before) - 1

    @property
    def planned(self) -> bool:
        """The action is the first of the route ``d`` counts (a stricter label; ties go to the
        route that stays on the current search); compared as the env parses commands."""
        if not self.route_before:
            return False
        return parse_command(self.action) == parse_command(self.route_before[0])


def option_clicks(world: World, goal: Goal, options: tuple[tuple[str, str], ...] = ()) -> Route:
    """The clicks of the goal values that the goal's item page offers and ``options`` (a session's
    chosen ``(name, value)`` pairs) do not hold yet, in the goal's order, as the oracle clicks them."""
    clickables = item_page(goal.instruction_text, world.catalog.by_asin[goal.asin]).clickables
    chosen = dict(options)
    clicks = []
    for value in goal.option_values:
        command = f"click[{value}]"
        label = parse_command(command)[1]  # what the env looks up: the argument, lower-cased
        target = clickables.get(label) if label is not None else None
        # A value offered under a button's label would press the button, not choose the value.
        if target is not None and target.kind == "option" and chosen.get(target.option_name) != label:
            clicks.append(command)
    return tuple(clicks)


def _results_route(world: World, goal: Goal, session: Session) -> Route | None:
    """From page ``session.page`` of the search whose hits are ``session.results``."""
    if goal.asin not in session.results:
        return None
    page = session.results.index(goal.asin) // RESULTS_PER_PAGE + 1
    paging = (NEXT,) * (page - session.page) if page >= session.page else (PREV,) * (session.page - page)
    return (*paging, f"click[{goal.asin.lower()}]", *option_clicks(world, goal), BUY)


def fresh_route(world: World, goal: Goal) -> Route | None:
    """From any page: the title search, then the results route; None if it does not list the goal."""
    search = f"search[{search_argument(goal.name)}]"
    keywords = parse_command(search)[1]
    if not keywords:
        return None
    rest = _results_route(world, goal, Session("results", keywords, 1, tuple(world.engine.search(keywords))))
    return None if rest is None else (search, *rest)


def session_route(world: World, goal: Goal, session: Session) -> Route | None:
    """The shortest oracle route from a session of an episode that has not ended (``d`` = its
    length); None when there is none. The ``done`` view is an ended episode: see ``expert_route``."""
    if session.view == "done":
        raise ValueError("the episode has ended: its distance depends on whether the purchase won")
    local: Route | None = None
    if session.view == "results":
        local = _results_route(world, goal, session)
    elif session.view == "item" or session.view in SUB_PAGES:
        up = (PREV,) if session.view in SUB_PAGES else ()
        if session.asin == goal.asin:
            local = (*up, *option_clicks(world, goal, session.options), BUY)
        else:  # the item's ``< prev`` shows the same results page again, without the options
            back = dataclasses.replace(session, view="results", asin=None, options=())
            rest = _results_route(world, goal, back)
            local = None if rest is None else (*up, PREV, *rest)
    # Listed first, so a tie keeps the current search (the route ``planned`` follows).
    return min((r for r in (local, fresh_route(world, goal)) if r is not None), key=len, default=None)


def expert_route(env: WebShopEnv, step: EnvStep) -> Route | None:
    """The route from ``env``'s state, ``step`` being what its last reset or step returned:
    () once a purchase has won, None once the episode has ended otherwise."""
    if step.done:
        return () if step.won else None
    return session_route(env.world, env.goal, env.session)


def goal_distance(env: WebShopEnv, step: EnvStep) -> int | None:
    """``d`` of ``env``'s state (``step`` as for ``expert_route``); None: infinite."""
    route = expert_route(env, step)
    return None if route is None else len(route)


def label_actions(env: WebShopEnv, task: Task, actions: Sequence[str]) -> list[ExpertLabel]:
    """Plays ``actions`` on ``task`` from a reset of ``env`` and labels each one; the actions after
    the step that ends the episode are not played."""
    step = env.reset(task)
    route = expert_route(env, step)
    labels = []
    for action in actions:
        step = env.step(action)
        labels.append(ExpertLabel(action, route, after := expert_route(env, step)))
        route = after
        if step.done:
            break
    return labels


def label_episodes(env: WebShopEnv, episodes: Sequence[tuple[Task, Sequence[str]]]) -> list[list[bool]]:
    """Per episode ``(task, actions played)``, each step's ``consistent`` label (an action after the
    end, which ``env`` does not play, is not consistent), played one after another in ``env``."""
    out = []
    for task, actions in episodes:
        labels = [label.consistent for label in label_actions(env, task, actions)]
        out.append(labels + [False] * (len(actions) - len(labels)))
    return out


def label_groups(env: WebShopEnv, groups) -> list[list[list[bool]]]:
    """``label_episodes`` of every trajectory of ``rollout.Group``s: per group, per trajectory, per step."""
    episodes = [(g.task, [s.action or "" for s in t.steps]) for g in groups for t in g.trajectories]
    flat = iter(label_episodes(env, episodes))
    return [[next(flat) for _ in g.trajectories] for g in groups]
