"""WebShop's pages in its ``text`` observation mode, and what each page lets the agent click.

A page is its visible text segments (stripped, empty ones dropped) joined with " [SEP] ", as
the original renders its HTML templates and joins the text nodes. Clickables follow the
original's lookup table: lower-cased button labels in page order, then lower-cased ASIN links,
then option values; a label seen twice keeps its first position and its last target (a dict).
In text mode the chosen options are not marked: the item page looks the same after a click.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from orsd_jax.envs.webshop.data import Product

SEP = " [SEP] "
SEARCH_PLACEHOLDER = "search[<your query>]"
RESULTS_PER_PAGE = 10
View = Literal["start", "results", "item", "description", "features", "reviews", "done"]
SUB_PAGES: tuple[View, ...] = ("description", "features", "reviews")


@dataclasses.dataclass(frozen=True)
class Clickable:
    kind: Literal["button", "product", "option"]
    option_name: str = ""  # for options: the option the value belongs to


@dataclasses.dataclass(frozen=True)
class Page:
    view: View
    segments: tuple[str, ...]
    has_search_bar: bool
    clickables: Mapping[str, Clickable]  # label -> target, in page order

    @property
    def text(self) -> str:
        return SEP.join(self.segments)

    @property
    def available_actions(self) -> tuple[str, ...]:
        """As verl-agent lists them: the search placeholder, then ``click[label]`` per clickable."""
        search = (SEARCH_PLACEHOLDER,) if self.has_search_bar else ()
        return search + tuple(f"click[{label}]" for label in self.clickables)


def _page(
    view: View,
    segments: Iterable[str],
    *,
    search_bar: bool = False,
    buttons: Sequence[str] = (),
    products: Sequence[str] = (),
    options: Sequence[tuple[str, Sequence[str]]] = (),
) -> Page:
    clickables: dict[str, Clickable] = {}
    for label in buttons:
        clickables[label.lower()] = Clickable("button")
    for asin in products:
        clickables[asin.lower()] = Clickable("product")
    for name, values in options:
        for value in values:
            clickables[value] = Clickable("option", name)
    kept = tuple(s for s in (str(x).strip() for x in segments) if s)
    return Page(view, kept, search_bar, clickables)


def _header(instruction: str) -> tuple[str, ...]:
    return ("Instruction:", instruction)


def start_page(instruction: str) -> Page:
    return _page("start", ("WebShop", *_header(instruction), "Search"), search_bar=True, buttons=("Search",))


def results_page(instruction: str, products: Sequence[Product], page: int, total: int) -> Page:
    """Page ``page`` (1-based) of a search with ``total`` hits; ``products`` are that page's."""
    # "Next >" is always offered, even past the last page; "< Prev" from page 2 on.
    buttons = ("Back to Search", *(("< Prev",) if page > 1 else ()), "Next >")
    listing = [field for p in products for field in (p.asin, p.title, p.price_tag)]
    segments = (*_header(instruction), buttons[0], f"Page {page} (Total results: {total})", *buttons[1:], *listing)
    return _page("results", segments, buttons=buttons, products=[p.asin for p in products])


def item_page(instruction: str, product: Product) -> Page:
    option_text = [text for name, values in product.options for text in (name, *values)]
    segments = (
        *_header(instruction),
        "Back to Search",
        "< Prev",
        *option_text,
        product.title,
        f"Price: {product.price_tag}",
        "Rating: N.A.",  # reviews are not loaded by the original either
        "Description",
        "Features",
        "Reviews",
        "Buy Now",
    )
    buttons = ("Back to Search", "< Prev", "Description", "Features", "Reviews", "Buy Now")
    return _page("item", segments, buttons=buttons, options=product.options)


def sub_page(instruction: str, product: Product, view: View) -> Page:
    content = {"description": (product.description,), "features": product.bullet_points, "reviews": ()}[view]
    segments = (*_header(instruction), "Back to Search", "< Prev", *content)
    return _page(view, segments, buttons=("Back to Search", "< Prev"))


def done_page(asin: str, options: Mapping[str, str], score: float) -> Page:
    """The confirmation page, hidden debugging fields included (they are text nodes too)."""
    segments = (
        "Thank you for shopping with us!",
        "Your code:",
        "None",
        "(Paste it in your MTurk interface.)",
        "Purchased",
        "asin",
        asin,
        "options",
        json.dumps(dict(options), sort_keys=True),
        *("attrs", "None", "category", "None", "query", "None", "product category", "None"),
        *("Target", "asin", "options", "attrs", "price upper", "instuction text", "category"),
        *("product category", "query", "Goal", "None", "Reward"),
        "Your score (min 0.0, max 1.0)",
        str(score),
        "Reward Details",
        "None",
    )
    return _page("done", segments)
