"""BM25 product search standing in for WebShop's Lucene index (pyserini's default searcher).

Indexed text per product, as the original's index: lower-cased title, description, first bullet
point and ``"name: v1, v2, and name2: ..."`` option text. Analysis approximates Lucene's English
analyzer: UAX#29-like words (hyphens split; ``3.5oz``, ``don't``, ``1,000``, ``u.s.a`` stay whole),
trailing possessive ``'s`` removed, lower-casing, Lucene's 33 English stop words, original Porter
stemming. Scoring is Lucene's BM25 (k1 0.9, b 0.4) by ``bm25s``; each query token counts, repeats
included; documents matching no token are never returned; the top 50 are kept with ties broken
by ASIN, then ordered by score rounded to 1e-4 (as Anserini's tie adjuster does).

Known difference: Lucene stores document lengths in one lossy byte (exact below 24 tokens,
about 3 significant bits above); we use exact lengths, which can swap near-tied documents.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np
import Stemmer

from orsd_jax.envs.webshop.data import Product
from orsd_jax.envs.webshop.imports import import_without

K1 = 0.9
B = 0.4
SEARCH_RETURN_N = 50

LUCENE_STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there "
    "these they this to was will with".split()
)
# A word is a run of letters/digits/underscores; a single ' ’ . : between two letters, or
# . , ; ' ’ between two digits, does not break it (UAX#29's MidLetter/MidNum rules).
_WORD = re.compile(r"\w+(?:(?:(?<=[^\W\d_])['’.:](?=[^\W\d_])|(?<=\d)[.,;'’](?=\d))\w+)*")
_POSSESSIVES = ("'s", "’s", "＇s")


@functools.cache
def _porter() -> Stemmer.Stemmer:
    return Stemmer.Stemmer("porter")


def analyze(text: str) -> list[str]:
    """The index terms of ``text``, in order, repeats kept."""
    words = [w[:-2] if w.endswith(_POSSESSIVES) else w for w in _WORD.findall(text.lower())]
    # A run of underscores alone is no word for Lucene.
    return _porter().stemWords([w for w in words if w.strip("_") and w not in LUCENE_STOP_WORDS])


def search_argument(text: str) -> str:
    """``text`` as the argument of a ``search[...]`` command: brackets would break the command."""
    return " ".join(text.replace("[", " ").replace("]", " ").split())


def document_text(product: Product) -> str:
    """The text the original indexes for a product (its ``contents`` field)."""
    option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product.options)
    first_bullet = product.bullet_points[0] if product.bullet_points else ""
    return " ".join((product.title, product.description, first_bullet, option_text)).lower()


class SearchEngine:
    """BM25 over a fixed product list; ``search(query)`` returns up to 50 ASINs, best first."""

    def __init__(self, products: Sequence[Product]):
        self.asins = tuple(p.asin for p in products)
        # Rank of each document's ASIN in string order: Lucene breaks score ties by document id.
        self._asin_rank = np.argsort(np.argsort(np.array(self.asins)))
        # Documents as int32 term-id arrays: lists of strings would not fit the full catalog.
        vocab: dict[str, int] = {}
        docs = [
            np.fromiter((vocab.setdefault(t, len(vocab)) for t in analyze(document_text(p))), dtype=np.int32)
            for p in products
        ]
        self._bm25 = import_without("bm25s", "jax").BM25(k1=K1, b=B, method="lucene", idf_method="lucene")
        self._bm25.index((docs, vocab), show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query`` (zeros when no term is known)."""
        terms = analyze(query)
        if not terms:
            return np.zeros(len(self.asins), dtype=np.float32)
        return self._bm25.get_scores(terms)

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[str]:
        scores = self.scores(query)
        hits = np.flatnonzero(scores > 0)
        top = hits[np.lexsort((self._asin_rank[hits], -scores[hits]))][:k]
        rounded = np.round(scores[top].astype(np.float64), 4)
        return [self.asins[i] for i in top[np.lexsort((self._asin_rank[top], -rounded))]]
