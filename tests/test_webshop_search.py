"""Product search: the analyzer, BM25 scores against a brute-force Lucene formula, ranking rules."""

import math
from collections import Counter

import numpy as np
import pytest

from orsd_jax.envs.webshop.search import K1, SEARCH_RETURN_N, B, analyze, document_text
from orsd_jax.envs.webshop.world import load_world


@pytest.fixture(scope="module")
def world(webshop_data):
    return load_world(webshop_data)


@pytest.fixture(scope="module")
def brute(world):
    """Lucene 8's BM25 written out term by term: idf * tf / (tf + k1 (1 - b + b dl / avgdl))."""
    docs = [Counter(analyze(document_text(p))) for p in world.catalog.products]
    lengths = np.array([sum(d.values()) for d in docs], dtype=np.float64)
    df = Counter(t for d in docs for t in d)
    n, avgdl = len(docs), lengths.mean()

    def scores(query: str) -> np.ndarray:
        out = np.zeros(n)
        for term in analyze(query):  # a repeated query term counts again
            if term not in df:
                continue
            idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
            for i, d in enumerate(docs):
                if d[term]:
                    out[i] += idf * d[term] / (d[term] + K1 * (1 - B + B * lengths[i] / avgdl))
        return out

    return scores


def test_analyzer_matches_lucene_english_analysis():
    # lower-casing, hyphen split, possessive removed, stop words dropped, Porter stems
    assert analyze("Men's Running-Shoes for the Beach, SIZE 10.5!") == ["men", "run", "shoe", "beach", "size", "10.5"]
    assert analyze("3.5oz U.S.A. 1,000 don't") == ["3.5oz", "u.s.a", "1,000", "don't"]
    assert analyze("The and of with it's") == []
    assert analyze("tea Tea TEA") == ["tea", "tea", "tea"]
    assert analyze("!!! ... ___ ---") == []


QUERIES = [
    "men's running shoes size 10",
    "organic green tea",
    "wireless bluetooth headphones noise cancelling",
    "tea tea tea",
    "long lasting lipstick, red!",
]


def test_scores_equal_brute_force_bm25(world, brute):
    queries = QUERIES + [p.title for p in world.catalog.products[:20]]
    for query in queries:
        np.testing.assert_allclose(world.engine.scores(query), brute(query), rtol=2e-6, atol=2e-6)


def test_ranking_rules(world, brute):
    asins = world.engine.asins
    for query in QUERIES + [p.title for p in world.catalog.products[20:30]]:
        scores = brute(query)
        matching = [i for i in range(len(asins)) if scores[i] > 0]
        # Lucene keeps the best 50 (ties by document id), then orders by score rounded to 1e-4.
        top = sorted(matching, key=lambda i: (-scores[i], asins[i]))[:SEARCH_RETURN_N]
        expected = [asins[i] for i in sorted(top, key=lambda i: (-round(scores[i], 4), asins[i]))]
        assert world.engine.search(query) == expected


def test_query_handling(world):
    search = world.engine.search
    base = search("red shoes")
    assert base and len(base) == len(set(base)) <= SEARCH_RETURN_N
    assert search("RED Shoes") == base
    assert search("red, shoes!!") == base
    assert search("(red) - [shoes]") == base
    for empty in ("", "   ", "!!! ???", "the and of", "qwertyuiopzzz"):
        assert search(empty) == []


def test_own_title_in_top_10(world):
    products = world.catalog.products
    found = sum(p.asin in world.engine.search(p.title)[:10] for p in products)
    assert found / len(products) >= 0.90, found
