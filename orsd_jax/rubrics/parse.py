"""Reading a rubric bundle out of free model text. Never raises.

Accepted shapes: a JSON array (of strings, or of objects with a ``criterion``/``text``/
``description`` string), a JSON object holding such an array or mapping numbers to strings,
or a numbered or bulleted list
(``1.``, ``1)``, ``(1)``, ``-``, ``*``, ``•``). A ``<think>`` block is ignored. Items are cleaned
(list markers, also inside JSON strings; markdown emphasis; ``Criterion 3:`` labels; whitespace),
items of fewer than 3 words or more than 60 are dropped, and repeated criteria are kept once.
Two criteria repeat each other when their words are equal after case, punctuation and leading
step or ordinal prefixes ("Step 3:", "First,", "Finally") are removed, or when they name the same
numbers and their texts match at a ``difflib`` ratio of at least ``NEAR_DUPLICATE`` (wording
variants such as "takes the laptop from the sidetable" / "take the laptop from the side table"
score 0.97; criteria about another receptacle or object, "goes to the desk 1 first" / "goes to the
drawer 1 first", 0.88).
A bundle is valid with 5 to 8 distinct criteria after cleaning; otherwise it is rejected with a
reason that counts the repeats.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re

MIN_CRITERIA, MAX_CRITERIA = 5, 8
NEAR_DUPLICATE = 0.92
_JSON_ATTEMPTS = 64  # JSON starts tried: each failed attempt can cost a parse of the rest of the text
_ORDINAL = re.compile(
    r"^(?:(?:step|stage|phase|part)\s*(?:\d+|one|two|three|four|five|six|seven|eight)|\d+(?:st|nd|rd|th)"
    r"|first(?:ly)?|second(?:ly)?|third(?:ly)?|fourth|fifth|sixth|seventh|eighth|next|then|finally|lastly)"
    r"\b\s*[:.),-]?\s*"
)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S | re.I)
_MARKER = re.compile(r"^\s*(?:\d{1,2}\s*[.):]|\(\d{1,2}\)|[-*\u2022])\s+")
_ITEM = re.compile(_MARKER.pattern + r"(.+?)\s*$")
_LABEL = re.compile(r"^(?:criterion|criteria|rubric)\s*\d*\s*[:.)-]\s*", re.I)
_EMPHASIS = re.compile(r"[*_`]{1,3}")
_TEXT_KEYS = ("criterion", "text", "description", "content", "name")


@dataclasses.dataclass(frozen=True)
class ParsedBundle:
    criteria: tuple[str, ...]  # cleaned, de-duplicated; empty when nothing was found
    reason: str  # "" when valid
    repeats: int = 0  # items dropped as repeats of an earlier criterion

    @property
    def valid(self) -> bool:
        return not self.reason


def _json_items(text: str) -> list[str] | None:
    """Strings of the first JSON array (or object holding one) in ``text``; None if there is none."""
    decoder = json.JSONDecoder()
    for attempt, start in enumerate(m.start() for m in re.finditer(r"[\[{]", text)):
        if attempt == _JSON_ATTEMPTS:
            return None
        try:
            value, _ = decoder.raw_decode(text[start:])
        except (json.JSONDecodeError, RecursionError):  # deep nesting ("[" * 1000) recurses past the limit
            continue
        if isinstance(value, dict):  # {"criteria": [...]} or {"1": "...", "2": "..."}
            lists = [v for v in value.values() if isinstance(v, list)]
            numbered = [v for k, v in value.items() if re.sub(r"\D", "", k) and isinstance(v, str)]
            value = lists[0] if lists else numbered or None
        if not isinstance(value, list):
            continue
        items = []
        for item in value:
            if isinstance(item, dict):
                item = next((item[k] for k in _TEXT_KEYS if isinstance(item.get(k), str)), None)
            if isinstance(item, str):
                items.append(item)
        return items
    return None


def _clean(item: str) -> str:
    item = _EMPHASIS.sub("", item)
    # JSON items can carry their own numbering ("1. ...", "2. ..."): without it, duplicates collapse.
    item = _LABEL.sub("", _MARKER.sub("", item.strip()))
    return " ".join(item.split()).strip(" \"'")


def criterion_key(item: str) -> str:
    """Lower-case words without punctuation and without leading step or ordinal prefixes."""
    text, previous = item.lower().strip(), None
    while text != previous:
        previous, text = text, _ORDINAL.sub("", text, count=1)
    return " ".join(re.sub(r"[^a-z0-9 ]+", " ", text).split())


def _repeats(key: str, earlier: str) -> bool:
    if key == earlier:
        return True
    numbers = re.findall(r"\d+", key) == re.findall(r"\d+", earlier)
    return numbers and difflib.SequenceMatcher(None, key, earlier).ratio() >= NEAR_DUPLICATE


def bundle_regex(max_chars: int = 150) -> str:
    """The grammar a constrained writer samples under (``RubricConfig.constrained``): lines ``1. `` to
    ``5. `` at least, ``8. `` at most, numbered in order, each a criterion of 10 to ``max_chars``
    characters ending in a newline, none of them ``<`` (which keeps out the tokenizer's special
    tokens, e.g. ``<|im_start|>``, that the grammar would otherwise let through as text, and
    markup). ``parse_bundle`` reads such a text as its lines (unless a line holds a JSON list,
    which it reads first), so a constrained bundle fails on its content (duplicates, items under
    3 words) or by running out of tokens before its fifth line."""
    if max_chars < 10:
        raise ValueError(f"criteria need at least 10 characters, got max_chars={max_chars}")
    item = rf"[^\s<][^\n<]{{9,{max_chars - 1}}}\n"
    optional = ""
    for k in range(MAX_CRITERIA, MIN_CRITERIA, -1):
        optional = f"({k}\\. {item}{optional})?"
    return "".join(f"{k}\\. {item}" for k in range(1, MIN_CRITERIA + 1)) + optional


def parse_bundle(text: str, cut: bool = False) -> ParsedBundle:
    """The bundle in ``text``. ``cut``: the writer ran out of tokens, so whatever follows the last
    newline is an unfinished criterion and is dropped (and a rejection says the text was cut)."""
    if not isinstance(text, str) or not text.strip():
        return ParsedBundle((), "empty output")
    if cut:
        text = text[: text.rfind("\n") + 1]
    bundle = _parse(_THINK.sub("", text))
    return (
        dataclasses.replace(bundle, reason=f"{bundle.reason} (cut by the token limit)")
        if cut and bundle.reason
        else bundle
    )


def _parse(text: str) -> ParsedBundle:
    items = _json_items(text)
    if items is None:
        items = [m.group(1) for line in text.splitlines() if (m := _ITEM.match(line))]
    criteria, repeats = [], 0
    keys: list[str] = []
    for item in map(_clean, items):
        if not 3 <= len(re.findall(r"\w+", item)) <= 60:
            continue
        key = criterion_key(item)
        if any(_repeats(key, earlier) for earlier in keys):
            repeats += 1
            continue
        keys.append(key)
        criteria.append(item)
    if not criteria:
        return ParsedBundle((), "no list of criteria found")
    if not MIN_CRITERIA <= len(criteria) <= MAX_CRITERIA:
        repeated = f" ({repeats} repeated)" if repeats else ""
        reason = f"{len(criteria)} distinct criteria{repeated}; a bundle needs {MIN_CRITERIA}-{MAX_CRITERIA}"
        return ParsedBundle(tuple(criteria), reason, repeats)
    return ParsedBundle(tuple(criteria), "", repeats)
