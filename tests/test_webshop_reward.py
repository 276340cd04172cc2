"""WebShop's purchase reward, factor by factor, against values computed by hand.

The fuzzy scores quoted below are thefuzz's ``token_set_ratio`` (Indel similarity of the token
intersection and the sorted token strings), computed by hand in the comments.
"""

import dataclasses

import pytest
from thefuzz import fuzz

from orsd_jax.envs.webshop.data import Product
from orsd_jax.envs.webshop.goals import Goal
from orsd_jax.envs.webshop.reward import (
    attribute_matches,
    get_reward,
    normalize_color,
    option_matches,
    title_nouns,
    type_match,
)

PRODUCT = Product(
    asin="B000000001",
    title="Gentle shampoo with tea tree oil",
    category="beauty",
    query="shampoo",
    product_category="Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
    description="A gentle shampoo made with Natural Ingredients.",
    bullet_points=("Sulfate free formula", "16 fl oz"),
    pricing=(12.0,),
    price_tag="$12.0",
    options=(("color", ("navy | red", "black")), ("item shape", ("rectangular",)), ("size", ("large", "x-large"))),
    attributes=("tea tree oil", "wireless charger"),
)

GOAL = Goal(
    asin=PRODUCT.asin,
    category="beauty",
    query="shampoo",
    name="Organic shampoo for dry hair",
    product_category=PRODUCT.product_category,
    instruction_text="i need a shampoo",
    attributes=("tea tree", "natural ingredients", "sulfate free", "wireless charging", "paraben free"),
    price_upper=20.0,
    goal_options=(("color", "navy | red"), ("item shape", "rectangular"), ("size", "large")),
    weight=1.0,
)

CHOSEN = {"color": "navy | red", "item shape": "rectangular", "size": "large"}


def nouns_from(table):
    return lambda title: table[title]


def test_fuzzy_threshold_is_strictly_above_85():
    # "wireless charging" vs "wireless charger": the sorted strings share "wireless " and "charg"
    # (14 chars) out of 17 + 16: 2*14/33 = 84.8 -> 85, not above the threshold.
    assert fuzz.token_set_ratio("wireless charger", "wireless charging") == 85
    assert attribute_matches(PRODUCT, ("wireless charging",)) == 0
    # "machine wash" vs "machine washable": 2*12/28 = 85.7 -> 86, a match.
    assert fuzz.token_set_ratio("machine washable", "machine wash") == 86
    assert attribute_matches(dataclasses.replace(PRODUCT, attributes=("machine washable",)), ("machine wash",)) == 1


def test_attribute_factor_partial_credit():
    # tea tree: subset of the attribute "tea tree oil" (100); natural ingredients: in the
    # lower-cased description; sulfate free: in the bullet points; wireless charging: 85 against
    # "wireless charger" and nowhere in the text; paraben free: nowhere.
    assert attribute_matches(PRODUCT, GOAL.attributes) == 3
    assert attribute_matches(PRODUCT, ("tea tree",)) == 1
    assert attribute_matches(PRODUCT, ("natural ingredients",)) == 1
    assert attribute_matches(PRODUCT, ("sulfate free",)) == 1
    assert attribute_matches(PRODUCT, ("paraben free",)) == 0


def test_colour_normalisation_is_substring_for_values_and_elementwise_for_pairs():
    assert normalize_color("navy | red") == "navy"  # navy comes before red in the colour list
    assert normalize_color("light blue") == "blue"  # blue comes before light
    assert normalize_color("rectangular") == "tan"  # rec-TAN-gular: the original's quirk
    assert normalize_color("x-large") == "x-large"
    assert normalize_color(("color", "black")) == "black"  # an element equal to a colour
    assert normalize_color(("color", "navy | red")) == ("color", "navy | red")


def test_option_factor_partial_credit():
    # color: "navy" is a token subset of the pair's "color navy red" -> 100.
    # item shape: the bought value became "tan", which shares no token with "item shape
    # rectangular" -> no match (the original scores the right option wrong here too).
    # size: "large" is a subset of "size large" -> 100.
    assert option_matches(CHOSEN, GOAL.goal_options) == 2
    assert option_matches({"size": "x-large"}, (("size", "large"),)) == 0  # "x large" vs "size large": 83
    assert option_matches({}, GOAL.goal_options) == 0
    # Human goals list values; "light blue" and "blue" both normalise to "blue".
    assert option_matches({"color": "light blue"}, ("blue",)) == 1


def test_price_factor():
    cheap = get_reward(PRODUCT, GOAL, 19.99, CHOSEN, nouns_from({GOAL.name: ("x",), PRODUCT.title: ("x",)}))
    dear = get_reward(PRODUCT, GOAL, 20.01, CHOSEN, nouns_from({GOAL.name: ("x",), PRODUCT.title: ("x",)}))
    assert cheap.r_price is True and dear.r_price is False
    # 3 of 5 attributes, 2 of 3 options, price: (3 + 2 + 1) / 9 = 2/3; without the price 5/9.
    assert cheap.score == pytest.approx(6 / 9)
    assert dear.score == pytest.approx(5 / 9)
    assert (cheap.w_att, cheap.w_option, cheap.w_price) == pytest.approx((5 / 9, 3 / 9, 1 / 9))
    assert (cheap.r_att, cheap.r_option) == pytest.approx((3 / 5, 2 / 3))


@pytest.mark.parametrize(
    "goal_nouns, bought_nouns, same_query, same_category, title_score, r_type",
    [
        (("shampoo", "hair", "tree", "shampoo"), ("shampoo", "oil"), False, False, 1 / 4, 1.0),  # overlap > 0.2
        (("a", "b", "c", "d", "e"), ("a", "z"), False, False, 1 / 5, 0.5),  # 0.2 is not above 0.2
        (("a", "b", "c", "d", "e"), ("a", "z"), True, False, 1 / 5, 1.0),  # the query matches
        (("a", "b", "c", "d", "e"), ("a", "z"), False, True, 1 / 5, 1.0),  # two category levels match
        (tuple("abcdefghijk"), ("a",), True, True, 1 / 11, 0.1),  # below 0.1 whatever matches
        (("a", "b"), ("z",), True, True, 0.0, 0.0),  # no shared noun
        ((), ("z",), False, False, 0.2, 0.5),  # goal title without nouns counts 0.2
        ((), ("z",), False, True, 0.2, 1.0),
    ],
)
def test_type_factor(goal_nouns, bought_nouns, same_query, same_category, title_score, r_type):
    product = dataclasses.replace(
        PRODUCT,
        title="bought",
        query=GOAL.query if same_query else "conditioner",
        # Shares "Beauty & Personal Care" and "Hair Care" (2 levels) or only the first (1 level).
        product_category="Beauty & Personal Care › Hair Care › Styling"
        if same_category
        else "Beauty & Personal Care › Skin Care › Face",
    )
    match = type_match(product, GOAL, nouns_from({GOAL.name: goal_nouns, "bought": bought_nouns}))
    assert (match.query_match, match.category_match) == (same_query, same_category)
    assert match.title_score == pytest.approx(title_score)
    assert match.r_type == r_type
    reward = get_reward(product, GOAL, 10.0, CHOSEN, nouns_from({GOAL.name: goal_nouns, "bought": bought_nouns}))
    assert reward.score == pytest.approx(6 / 9 * r_type)


def test_type_factor_with_the_spacy_pipeline():
    # en_core_web_sm tags the nouns a reader would pick; "shampoo" is the one shared noun.
    assert title_nouns(GOAL.name) == ("shampoo", "hair")
    assert title_nouns(PRODUCT.title) == ("shampoo", "tea", "tree", "oil")
    match = type_match(dataclasses.replace(PRODUCT, query="other", product_category="Other"), GOAL)
    assert match.title_score == pytest.approx(1 / 2) and match.r_type == 1.0


def test_exact_product_scores_one_and_breakdown_is_complete():
    goal = dataclasses.replace(
        GOAL, name=PRODUCT.title, attributes=("tea tree", "sulfate free"), goal_options=(("size", "large"),)
    )
    reward = get_reward(PRODUCT, goal, 12.0, {"size": "large"})
    assert reward.score == 1.0
    assert reward.as_dict() == {
        "score": 1.0,
        "r_type": 1.0,
        "r_att": 1.0,
        "w_att": 0.5,
        "r_option": 1.0,
        "w_option": 0.25,
        "r_price": True,
        "w_price": 0.25,
        "query_match": True,
        "category_match": True,
        "title_score": 1.0,
    }


def test_goal_without_options_has_no_option_factor():
    goal = dataclasses.replace(GOAL, name=PRODUCT.title, attributes=("tea tree",), goal_options=())
    reward = get_reward(PRODUCT, goal, 50.0, {})
    # 1 attribute, price over the bound: (1 + 0) / (1 + 0 + 1).
    assert reward.score == pytest.approx(0.5)
    assert reward.r_option is None and reward.w_option is None


def test_trimmed_pipeline_tags_like_the_full_one(webshop_data):
    """The pipeline runs without NER and lemmatizer (for speed); nouns must not change."""
    from orsd_jax.envs.webshop.data import load_catalog
    from orsd_jax.envs.webshop.reward import _spacy_pipeline

    trimmed = _spacy_pipeline()  # imports spaCy (without torch) first
    import spacy

    assert trimmed.meta["version"] == "3.8.0" and "tagger" in trimmed.pipe_names
    full = spacy.load(trimmed.path)
    assert {"ner", "lemmatizer"} <= set(full.pipe_names)
    titles = [p.title for p in load_catalog(webshop_data, num_products=150).products]
    for title, doc in zip(titles, full.pipe(titles)):
        assert title_nouns(title) == tuple(t.text.lower() for t in doc if t.pos_ in ("NOUN", "PROPN"))
