"""Shopping goals, built as the original builds them (facts, not code).

Synthetic goals: one per product that has an instruction and per combination of its option
values (option names sorted), the text ``"<instruction> with k: v, and k2: v2"``; options are
kept as ``(name, value)`` pairs, as the original compares them. Human goals: one per human
instruction that names attributes, options as written. Each goal gets a price bound: of the
first four multiples of 10 above the product's price, two are sampled and the larger kept,
adding ``", and price lower than X.00 dollars"``; with fewer than two the bound is 1e6 and no
clause is added. The goal list is shuffled with ``random.seed(233)``; goals 0-499 are the test
split and the rest train.

The original draws prices (a range is sampled uniformly) and price bounds from the unseeded
global ``random``; we make the same calls in the same order on ``random.Random(42)`` (42 is
verl-agent's default environment seed), so bounds are reproducible. The shuffle only depends on
the number of goals, so goal ``i`` is the same product and options as in the original.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal

from orsd_jax.envs.webshop.data import Catalog, Product

PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))
NO_PRICE_BOUND = 1_000_000.0
PRICE_SEED = 42
SHUFFLE_SEED = 233
N_TEST_GOALS = 500

Split = Literal["train", "test"]

_OPTIONS_HEAD = " with "
_OPTIONS_JOIN = ", and "
_PRICE_CLAUSE = re.compile(r", and price lower than [\d.]+ dollars$")
_OPTION_NAME = re.compile(r"[a-z][a-z ]*")


@dataclasses.dataclass(frozen=True)
class Goal:
    asin: str
    category: str
    query: str
    name: str  # the goal product's title
    product_category: str
    instruction_text: str
    attributes: tuple[str, ...]
    price_upper: float
    # Synthetic goals: (option name, value) pairs; human goals: the option values as written.
    goal_options: tuple[tuple[str, str] | str, ...]
    weight: float

    @property
    def option_values(self) -> tuple[str, ...]:
        return tuple(o[1] if isinstance(o, tuple) else o for o in self.goal_options)


@dataclasses.dataclass(frozen=True)
class GoalSet:
    goals: tuple[Goal, ...]  # shuffled: the index is the task key
    prices: Mapping[str, float]  # asin -> the price a purchase is charged


def draw_prices(products: Iterable[Product], rng: random.Random) -> dict[str, float]:
    return {p.asin: p.pricing[0] if len(p.pricing) == 1 else rng.uniform(p.pricing[0], p.pricing[1]) for p in products}


def _price_bound(price: float, rng: random.Random) -> tuple[float, str]:
    above = [step for step in PRICE_STEPS if step > price][:4]
    if len(above) < 2:
        return NO_PRICE_BOUND, ""
    upper = max(rng.sample(above, 2))
    return upper, f"{_OPTIONS_JOIN}price lower than {upper:.2f} dollars"


def _goal(
    product: Product,
    text: str,
    attributes: Iterable[str],
    upper: float,
    options: Iterable[tuple[str, str] | str],
    weight: float = 1.0,
) -> Goal:
    return Goal(
        asin=product.asin,
        category=product.category,
        query=product.query,
        name=product.title,
        product_category=product.product_category,
        instruction_text=text,
        attributes=tuple(attributes),
        price_upper=upper,
        goal_options=tuple(options),
        weight=weight,
    )


def synthetic_goals(catalog: Catalog, prices: Mapping[str, float], rng: random.Random) -> list[Goal]:
    goals: list[Goal] = []
    for product in catalog.products:
        instruction = catalog.synthetic.get(product.asin)
        if instruction is None:
            continue
        upper, price_text = _price_bound(prices[product.asin], rng)
        options = product.options_dict
        names = sorted(options)
        for values in itertools.product(*(options[n] for n in names)):
            pairs = tuple(zip(names, values))
            option_text = _OPTIONS_HEAD + _OPTIONS_JOIN.join(f"{k}: {v}" for k, v in pairs) if pairs else ""
            goals.append(
                _goal(product, f"{instruction.text}{option_text}{price_text}", instruction.attributes, upper, pairs)
            )
    # Rarer attributes weigh more: the mean of 1 / (number of goals naming the attribute).
    counts = Counter(a for g in goals for a in g.attributes)
    return [
        dataclasses.replace(g, weight=sum(1.0 / counts[a] for a in g.attributes) / len(g.attributes)) for g in goals
    ]


def option_segment(instruction: str) -> tuple[str, tuple[str, ...]] | None:
    """A synthetic goal's options as its instruction states them (``"color: black, and size: 7"``)
    and their values in that order; None when it names none. The first `` with `` whose rest splits
    into ``name: value`` parts (names without " with "): every goal of the 1000-product set parses
    to its own ``option_values`` (tests/test_webshop_goals.py)."""
    body = _PRICE_CLAUSE.sub("", instruction.strip())
    start = 0
    while (at := body.find(_OPTIONS_HEAD, start)) >= 0:
        segment = body[at + len(_OPTIONS_HEAD) :]
        parts = [p.split(": ", 1) for p in segment.split(_OPTIONS_JOIN)]
        if all(len(p) == 2 and _OPTION_NAME.fullmatch(p[0]) and _OPTIONS_HEAD not in p[0] for p in parts):
            return segment, tuple(p[1] for p in parts)
        start = at + 1
    return None


def human_goals(catalog: Catalog, prices: Mapping[str, float], rng: random.Random) -> list[Goal]:
    if catalog.human is None:
        raise ValueError("this catalog was loaded without human instructions (human_goals=False)")
    goals = []
    for product in catalog.products:
        for instruction in catalog.human.get(product.asin, ()):
            if not instruction.attributes:
                continue
            upper, price_text = _price_bound(prices[product.asin], rng)
            text = instruction.text.strip(".") + price_text
            goals.append(_goal(product, text, instruction.attributes, upper, instruction.options))
    return goals


def make_goal_set(catalog: Catalog, human: bool = False) -> GoalSet:
    rng = random.Random(PRICE_SEED)
    prices = draw_prices(catalog.products, rng)
    goals = (human_goals if human else synthetic_goals)(catalog, prices, rng)
    random.Random(SHUFFLE_SEED).shuffle(goals)
    return GoalSet(tuple(goals), prices)


def split_indices(n_goals: int, split: Split) -> range:
    if split == "test":
        return range(min(N_TEST_GOALS, n_goals))
    if split == "train":
        return range(min(N_TEST_GOALS, n_goals), n_goals)
    raise ValueError(f"unknown WebShop split {split!r}; expected 'train' or 'test'")
