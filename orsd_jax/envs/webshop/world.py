"""The loaded WebShop world (catalog, goals, prices, search index), built once per process.

Every environment in a process shares one world: EnvPool workers each hold several
environments and the data is immutable, so the load happens once per worker. On the
1000-product set it takes about 1.2 s on one core (products 0.15 s, goals 0.2 s, index 0.8 s
with the bm25s import); spaCy adds 1.5-2.5 s when the first purchase is scored.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from pathlib import Path

from orsd_jax.envs.base import Task
from orsd_jax.envs.webshop.data import Catalog, load_catalog, resolve_data_dir
from orsd_jax.envs.webshop.goals import Goal, GoalSet, Split, make_goal_set, split_indices
from orsd_jax.envs.webshop.search import SearchEngine, search_argument


@dataclasses.dataclass(frozen=True)
class WorldKey:
    data_dir: str
    use_small: bool
    num_products: int | None
    human_goals: bool

    @classmethod
    def make(
        cls,
        data_dir: str | os.PathLike | None,
        use_small: bool = True,
        num_products: int | None = None,
        human_goals: bool = False,
    ) -> WorldKey:
        if num_products is not None and num_products < 1:
            raise ValueError(f"num_products must be positive or None, got {num_products}")
        return cls(str(resolve_data_dir(data_dir)), bool(use_small), num_products, bool(human_goals))


@dataclasses.dataclass(frozen=True)
class World:
    catalog: Catalog
    goal_set: GoalSet
    engine: SearchEngine

    @property
    def goals(self) -> tuple[Goal, ...]:
        return self.goal_set.goals


@functools.cache
def _catalog(key: WorldKey) -> Catalog:
    return load_catalog(
        Path(key.data_dir), use_small=key.use_small, num_products=key.num_products, human_goals=key.human_goals
    )


@functools.cache
def _goal_set(key: WorldKey) -> GoalSet:
    return make_goal_set(_catalog(key), human=key.human_goals)


@functools.cache
def world_for(key: WorldKey) -> World:
    catalog = _catalog(key)
    return World(catalog, _goal_set(key), SearchEngine(catalog.products))


def load_world(
    data_dir: str | os.PathLike | None = None,
    *,
    use_small: bool = True,
    num_products: int | None = None,
    human_goals: bool = False,
) -> World:
    """This process's world for these files and options (built on first use)."""
    return world_for(WorldKey.make(data_dir, use_small, num_products, human_goals))


def goal_task(index: int, goal: Goal) -> Task:
    return Task(env="webshop", key=str(index), task_type=goal.category, description=goal.instruction_text.strip())


# Which goals of a split are played: every one, or those whose product is the first result of
# searching the goal's own words (its instruction, verbatim): about half of them (3,646 of 6,910 on
# the 1000-product set), which a policy can win by copying the instruction into the search.
GOAL_SETS = ("all", "first-hit")


def load_goals(
    data_dir: str | os.PathLike | None,
    split: Split,
    human_goals: bool = False,
    *,
    use_small: bool = True,
    num_products: int | None = None,
    categories: Sequence[str] = (),
    goals: str = "all",
) -> list[Task]:
    """The tasks of a split (test = goals 0-499 of the standard shuffle, train = the rest), in
    order, of ``categories`` only when given, and of the goal set ``goals`` (``GOAL_SETS``)."""
    if goals not in GOAL_SETS:
        raise ValueError(f"unknown WebShop goal set {goals!r}; expected one of {GOAL_SETS}")
    key = WorldKey.make(data_dir, use_small, num_products, human_goals)
    every = _goal_set(key).goals
    tasks = [goal_task(i, every[i]) for i in split_indices(len(every), split)]
    if categories:
        unknown = set(categories) - {g.category for g in every}
        if unknown:
            raise ValueError(
                f"unknown WebShop categories {sorted(unknown)}; the goals have {sorted({g.category for g in every})}"
            )
        tasks = [t for t in tasks if t.task_type in categories]
    if goals == "first-hit":
        engine = world_for(key).engine
        tasks = [t for t in tasks if engine.search(search_argument(t.description))[:1] == [every[int(t.key)].asin]]
    return tasks
