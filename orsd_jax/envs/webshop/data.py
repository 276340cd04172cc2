"""The official WebShop data files: locating them, streaming them, normalising products.

Normalisation follows the original loader (facts, not code): products with a bad or repeated
ASIN are dropped; the title, description and bullet points become ``title``, ``description``
and ``bullet_points``; ``pricing`` becomes one or two floats (``[100.0]`` when missing) with the
``$a`` / ``$a to $b`` tag shown on pages; option names and values are lower-cased and ``/`` in a
value becomes `` | ``; attributes come from the attribute file (``DUMMY_ATTR`` when absent).
Only the fields the environment uses are kept, so the full 1.18M-product catalog can be read
(streamed, never ``json.load``-ed whole) into bounded memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

DATA_ENV_VAR = "WEBSHOP_DATA"
SMALL_FILES = ("items_shuffle_1000.json", "items_ins_v2_1000.json")
FULL_FILES = ("items_shuffle.json", "items_ins_v2.json")
HUMAN_FILE = "items_human_ins.json"

# WebShop's setup.sh downloads each file from Google Drive with gdown; these are its file ids.
_GDOWN_IDS = {
    "items_shuffle_1000.json": "1EgHdxQ_YxqIQlvvq5iKlCrkEKR6-j0Ib",
    "items_ins_v2_1000.json": "1IduG0xl544V_A_jv3tHXC0kyFi7PnyBu",
    "items_shuffle.json": "1A2whVgOO0euk5O13n2iYDM0bQRkkRduB",
    "items_ins_v2.json": "1s2j6NgHljiZzQNL3veZaAiyW_qDEgBNi",
    "items_human_ins.json": "14Kb5SPBk_jfdLZ_CDBNitW98QLDlKR5O",
}
_CHUNK_CHARS = 1 << 20


class WebShopDataError(FileNotFoundError):
    """The WebShop data files are missing or unreadable."""


def _how_to_obtain(files: tuple[str, ...]) -> str:
    lines = "\n".join(f"    gdown https://drive.google.com/uc?id={_GDOWN_IDS[f]}  # {f}" for f in files)
    return (
        "Obtain them with WebShop's own setup (github.com/princeton-nlp/WebShop: `./setup.sh -d small`, "
        "or `-d all` for the full catalog), which runs, inside WebShop/data/:\n"
        f"{lines}\n"
        f"then pass that directory as data_dir or set ${DATA_ENV_VAR} to it."
    )


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """The data directory: the argument, else ``$WEBSHOP_DATA``; absolute, and existing."""
    if data_dir is None:
        data_dir = os.environ.get(DATA_ENV_VAR)
        if not data_dir:
            raise WebShopDataError(
                f"No WebShop data directory given: pass data_dir or set ${DATA_ENV_VAR} to a directory "
                f"holding {' and '.join(SMALL_FILES)}. " + _how_to_obtain(SMALL_FILES)
            )
    path = Path(data_dir).expanduser().resolve()
    if not path.is_dir():
        raise WebShopDataError(f"WebShop data directory {path} does not exist. " + _how_to_obtain(SMALL_FILES))
    return path


def require_files(data_dir: Path, names: tuple[str, ...]) -> tuple[Path, ...]:
    """The paths of ``names`` under ``data_dir``; one clear error naming every missing file."""
    missing = tuple(n for n in names if not (data_dir / n).is_file())
    if missing:
        raise WebShopDataError(f"WebShop data missing in {data_dir}: {', '.join(missing)}. " + _how_to_obtain(missing))
    return tuple(data_dir / n for n in names)


def iter_json(path: Path) -> Iterator[tuple[Any, Any]]:
    """Streams the members of a top-level JSON array ``(index, item)`` or object ``(key, value)``.

    Reads ``_CHUNK_CHARS`` at a time, so a multi-gigabyte file never sits in memory at once.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def skip(chars: str) -> None:
            nonlocal buf, pos, eof
            while True:
                while pos < len(buf) and (buf[pos].isspace() or buf[pos] in chars):
                    pos += 1
                if pos < len(buf) or eof:
                    return
                buf, pos = f.read(_CHUNK_CHARS), 0
                eof = not buf

        def value() -> Any:
            nonlocal buf, pos, eof
            while True:
                try:
                    item, end = decoder.raw_decode(buf, pos)
                    # A number cut at the buffer's end would decode short: demand a following char.
                    if end < len(buf) or eof:
                        pos = end
                        return item
                except json.JSONDecodeError as err:
                    if eof:
                        raise WebShopDataError(f"{path} is not valid JSON: {err}") from err
                more = f.read(_CHUNK_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0

        skip("")
        if pos >= len(buf) or buf[pos] not in "[{":
            raise WebShopDataError(f"{path} is not a JSON array or object")
        is_array = buf[pos] == "["
        pos += 1
        index = 0
        while True:
            skip(",")
            if pos >= len(buf):
                raise WebShopDataError(f"{path} ends before its closing bracket")
            if buf[pos] in "]}":
                return
            if is_array:
                yield index, value()
                index += 1
            else:
                key = value()
                skip(":")
                yield key, value()


@dataclasses.dataclass(frozen=True, slots=True)
class Product:
    asin: str
    title: str  # the scraped ``name``; the reward's type check reads it too
    category: str  # beauty, electronics, fashion, garden, grocery
    query: str  # the scrape query, lower-cased and stripped
    product_category: str  # "A › B › C"
    description: str
    bullet_points: tuple[str, ...]
    pricing: tuple[float, ...]  # one price or a (low, high) range
    price_tag: str  # "$12.99" or "$12.99 to $19.99", as pages show it
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (name, values) in the scraped order
    attributes: tuple[str, ...]

    @property
    def options_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.options)


@dataclasses.dataclass(frozen=True, slots=True)
class SyntheticInstruction:
    text: str
    attributes: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class HumanInstruction:
    text: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Catalog:
    """The normalised products (file order) and the instructions written for them."""

    products: tuple[Product, ...]
    synthetic: Mapping[str, SyntheticInstruction]  # asin -> instruction of items_ins_v2
    human: Mapping[str, tuple[HumanInstruction, ...]] | None  # None unless human goals were asked
    by_asin: Mapping[str, Product] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_asin", {p.asin: p for p in self.products})


def _parse_pricing(asin: str, pricing: Any) -> tuple[tuple[float, ...], str]:
    if not pricing:
        return (100.0,), "$100.0"
    try:
        values = [float(Decimal(re.sub(r"[^\d.]", "", part))) for part in str(pricing).split("$")[1:]]
    except InvalidOperation as err:
        raise WebShopDataError(f"product {asin}: cannot read its pricing {pricing!r}") from err
    if not values:
        raise WebShopDataError(f"product {asin}: cannot read its pricing {pricing!r}")
    if len(values) == 1:
        return (values[0],), f"${values[0]}"
    return (values[0], values[1]), f"${values[0]} to ${values[1]}"


def _parse_options(raw: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not raw:
        return ()
    return tuple(
        (name.lower(), tuple(c["value"].strip().replace("/", " | ").lower() for c in contents))
        for name, contents in raw.items()
        if contents is not None
    )


def normalise_product(raw: Mapping[str, Any], attributes: tuple[str, ...] | None = None) -> Product:
    """One scraped product as the environment sees it (see the module docstring)."""
    bullets = raw["small_description"]
    pricing, price_tag = _parse_pricing(raw["asin"], raw.get("pricing"))
    return Product(
        asin=raw["asin"],
        title=raw["name"],
        category=raw["category"],
        query=raw["query"].lower().strip(),
        product_category=raw["product_category"],
        description=raw["full_description"],
        bullet_points=tuple(bullets) if isinstance(bullets, list) else (bullets,),
        pricing=pricing,
        price_tag=price_tag,
        options=_parse_options(raw["customization_options"]),
        attributes=attributes if attributes is not None else ("DUMMY_ATTR",),
    )


def _iter_raw_products(path: Path, num_products: int | None) -> Iterator[Mapping[str, Any]]:
    seen: set[str] = set()
    for index, raw in iter_json(path):
        if num_products is not None and index >= num_products:
            return
        asin = raw["asin"]
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        yield raw


def load_catalog(
    data_dir: Path, *, use_small: bool = True, num_products: int | None = None, human_goals: bool = False
) -> Catalog:
    """Reads the product and attribute files (and the human instructions when asked for)."""
    names = (SMALL_FILES if use_small else FULL_FILES) + ((HUMAN_FILE,) if human_goals else ())
    paths = require_files(data_dir, names)
    # Normalise while streaming (raw scrape records are large), attach attributes afterwards.
    products = {raw["asin"]: normalise_product(raw, None) for raw in _iter_raw_products(paths[0], num_products)}
    synthetic: dict[str, SyntheticInstruction] = {}
    for asin, entry in iter_json(paths[1]):
        if asin not in products:
            continue
        if "attributes" in entry:
            products[asin] = dataclasses.replace(products[asin], attributes=tuple(entry["attributes"]))
        if entry.get("instruction") is not None:
            synthetic[asin] = SyntheticInstruction(
                entry["instruction"], tuple(entry.get("instruction_attributes") or ())
            )
    human = None
    if human_goals:
        human = {
            asin: tuple(
                HumanInstruction(e["instruction"], tuple(e["instruction_attributes"]), tuple(e["instruction_options"]))
                for e in entries
            )
            for asin, entries in iter_json(paths[2])
            if asin in products
        }
    return Catalog(tuple(products.values()), synthetic, human)
