"""Loading the official WebShop files, product normalisation, goals and splits."""

import json
import random
from collections import Counter

import pytest

from orsd_jax.envs.webshop import data
from orsd_jax.envs.webshop.data import (
    HUMAN_FILE,
    SMALL_FILES,
    WebShopDataError,
    iter_json,
    load_catalog,
    normalise_product,
    resolve_data_dir,
)
from orsd_jax.envs.webshop.goals import (
    N_TEST_GOALS,
    PRICE_STEPS,
    draw_prices,
    make_goal_set,
    option_segment,
    split_indices,
    synthetic_goals,
)
from orsd_jax.envs.webshop.world import load_goals, load_world


@pytest.fixture(scope="module")
def world(webshop_data):
    return load_world(webshop_data)


def test_missing_files_are_named_with_how_to_get_them(tmp_path, monkeypatch):
    with pytest.raises(WebShopDataError) as err:
        load_catalog(tmp_path)
    message = str(err.value)
    assert all(name in message for name in SMALL_FILES)
    assert "setup.sh" in message and "gdown" in message and "WEBSHOP_DATA" in message

    monkeypatch.delenv("WEBSHOP_DATA", raising=False)
    with pytest.raises(WebShopDataError, match="WEBSHOP_DATA"):
        resolve_data_dir(None)
    with pytest.raises(WebShopDataError, match="does not exist"):
        resolve_data_dir(tmp_path / "nowhere")


def test_human_goals_need_their_file(tmp_path, webshop_data):
    for name in SMALL_FILES:
        (tmp_path / name).symlink_to(webshop_data / name)
    with pytest.raises(WebShopDataError, match=HUMAN_FILE):
        load_catalog(tmp_path, human_goals=True)


def test_streaming_reader_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CHUNK_CHARS", 3)  # every value straddles several reads
    items = [12345, -0.5e3, 'a [string], with "quotes" ]', {"k": [1, {"n": None}]}, [], True, "ü€"]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(items, indent=1), encoding="utf-8")
    assert [v for _, v in iter_json(path)] == items
    mapping = {"B1": {"attributes": ["x", "y"]}, "B2": 7, "B3": "z"}
    path.write_text(json.dumps(mapping), encoding="utf-8")
    assert dict(iter_json(path)) == mapping
    path.write_text("[1, 2", encoding="utf-8")
    with pytest.raises(WebShopDataError, match="closing bracket"):
        list(iter_json(path))
    path.write_text('[{"a": 1}, {"b": ]', encoding="utf-8")
    with pytest.raises(WebShopDataError, match="not valid JSON"):
        list(iter_json(path))


def test_streaming_reader_on_official_file(webshop_data):
    path = webshop_data / "items_ins_v2_1000.json"
    assert dict(iter_json(path)) == json.loads(path.read_text(encoding="utf-8"))


def test_product_normalisation():
    raw = {
        "asin": "B0TEST",
        "name": "Soft Towel",
        "category": "garden",
        "query": "  Bath Towels ",
        "product_category": "Home › Bath",
        "full_description": "Very soft.",
        "small_description": "One bullet",
        "pricing": "$1,019.99$1,299.00",
        "customization_options": {
            "Color": [{"value": " Navy/Red "}, {"value": "WHITE"}],
            "Size": None,  # options without values are dropped
        },
    }
    product = normalise_product(raw, ("cotton",))
    assert product.title == "Soft Towel" and product.query == "bath towels"
    assert product.bullet_points == ("One bullet",)
    assert product.pricing == (1019.99, 1299.0) and product.price_tag == "$1019.99 to $1299.0"
    assert product.options == (("color", ("navy | red", "white")),)
    assert product.attributes == ("cotton",)
    bare = normalise_product({**raw, "pricing": "", "customization_options": ""})
    assert bare.pricing == (100.0,) and bare.price_tag == "$100.0"
    assert bare.options == () and bare.attributes == ("DUMMY_ATTR",)
    with pytest.raises(WebShopDataError, match="B0TEST"):
        normalise_product({**raw, "pricing": "$1.2.3"})


def test_catalog_from_official_files(world, webshop_data):
    products = world.catalog.products
    assert len(products) == 1000 and len(world.catalog.by_asin) == 1000
    first = products[0]
    assert first.asin == "B06Y3VLDFB" and first.price_tag == "$877.8" and first.query == "console tables"
    assert first.attributes == ("console table", "solid wood") and first.options == ()
    ranged = world.catalog.by_asin["B08ZRR3DZT"]
    assert ranged.price_tag == "$19.99 to $27.99"
    assert 19.99 <= world.goal_set.prices["B08ZRR3DZT"] <= 27.99
    assert [p.asin for p in load_catalog(webshop_data, num_products=25).products] == [p.asin for p in products[:25]]


def test_synthetic_goals_as_the_original_builds_them(world):
    goals = world.goals
    # The original's README reports "Loaded 6910 goals" for the 1000-product set.
    assert len(goals) == 6910
    product = world.catalog.by_asin["B08ZRR3DZT"]  # 5 sizes x 8 colours
    mine = [g for g in goals if g.asin == product.asin]
    assert len(mine) == 40
    price = world.goal_set.prices[product.asin]
    bound = mine[0].price_upper
    assert bound in [s for s in PRICE_STEPS if s > price][1:4]  # the larger of two of the first four
    assert {g.price_upper for g in mine} == {bound}
    texts = {g.instruction_text for g in mine}
    assert (
        f"Find me women's dresses with polyester spandex for daily wear with color: light blue, "
        f"and size: x-small, and price lower than {bound:.2f} dollars"
    ) in texts
    assert {g.goal_options for g in mine} == {
        (("color", c), ("size", s)) for c in dict(product.options)["color"] for s in dict(product.options)["size"]
    }
    counts = Counter(a for g in goals for a in g.attributes)
    for g in mine:
        assert g.weight == pytest.approx(sum(1 / counts[a] for a in g.attributes) / len(g.attributes))


def test_option_segment_reads_back_every_goals_options(world):
    """The instruction's options, parsed back, are the goal's own, in order, for all 6,910 goals
    (instructions such as "... with printing technology with size: 28\" x 28\"" included)."""
    parsed = [option_segment(g.instruction_text) for g in world.goals]
    assert [p[1] if p else () for p in parsed] == [g.option_values for g in world.goals]
    assert sum(p is None for p in parsed) == sum(not g.goal_options for g in world.goals) > 0
    assert option_segment(
        'Find me pillows with printing technology with size: 28" x 28", and price lower than 30.00 dollars'
    ) == (
        'size: 28" x 28"',
        ('28" x 28"',),
    )
    assert option_segment("Find me players with quad core, and price lower than 360.00 dollars") is None


def test_shuffle_and_splits(world, webshop_data):
    rng = random.Random(42)
    prices = draw_prices(world.catalog.products, rng)
    ordered = synthetic_goals(world.catalog, prices, rng)
    # The original shuffles with the global generator: random.seed(233); random.shuffle(goals).
    order, saved = list(range(len(ordered))), random.getstate()
    random.seed(233)
    random.shuffle(order)
    random.setstate(saved)
    assert list(world.goals) == [ordered[i] for i in order]
    assert make_goal_set(world.catalog).goals == world.goals  # reproducible, bounds included

    test, train = load_goals(webshop_data, "test"), load_goals(webshop_data, "train")
    assert [t.key for t in test] == [str(i) for i in range(N_TEST_GOALS)]
    assert len(train) == len(world.goals) - N_TEST_GOALS and train[0].key == str(N_TEST_GOALS)
    goal = world.goals[int(test[7].key)]
    assert test[7].description == goal.instruction_text and test[7].task_type == goal.category
    assert test[7].env == "webshop"
    with pytest.raises(ValueError, match="split"):
        split_indices(10, "eval")


def test_human_goals(tmp_path, webshop_data):
    for name in SMALL_FILES:
        (tmp_path / name).symlink_to(webshop_data / name)
    entry = {"instruction": "i want a navy towel.", "instruction_attributes": ["soft"], "instruction_options": ["navy"]}
    human = {"B06Y3VLDFB": [entry, {**entry, "instruction_attributes": []}], "NOT-LOADED": [entry]}
    (tmp_path / HUMAN_FILE).write_text(json.dumps(human))
    (goal,) = make_goal_set(load_catalog(tmp_path, human_goals=True), human=True).goals  # no attributes: skipped
    # Price 877.8: bounds 880..910, two sampled, the larger kept.
    assert goal.price_upper in (890.0, 900.0, 910.0)
    assert goal.instruction_text == f"i want a navy towel, and price lower than {goal.price_upper:.2f} dollars"
    assert goal.goal_options == ("navy",) and goal.weight == 1.0 and goal.option_values == ("navy",)
