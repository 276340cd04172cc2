"""Where a group's rubric candidates come from (``RubricConfig.source``).

- ``policy``: the current policy writes K bundles from the group's episodes (the paper's method).
- ``oracle``: one bundle written from privileged knowledge (``oracle``: the planner's plan, the
  WebShop goal), without calling the writer: ORSD's upper bound.
- ``shuffled``: the oracle bundle of another task of the same update, a control whose text is a
  real rubric in the same style that says nothing true about this task.
- ``file``: bundles read from a JSON file mapping task keys to lists of criteria (users' rubrics).

Whatever the source, the verifier scores the candidates and selection runs as for the policy's
bundles, so every group's correlation is logged. ``neutral_like`` is the probe's floor: a text of
the same shape that says nothing about any task.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence

from orsd_jax.envs.base import Task
from orsd_jax.rubrics.parse import ParsedBundle, parse_bundle

SOURCES = ("policy", "oracle", "shuffled", "file")

# Task-free sentences for the neutral text, cut or repeated to each criterion's length.
_NEUTRAL = (
    "The weather report for the coast mentions a mild breeze in the afternoon",
    "A library in the old town opens its reading room on weekday mornings",
    "The recipe calls for two cups of flour and a pinch of salt",
    "Trains on the northern line run every twenty minutes on holidays",
    "The museum guide describes paintings from the early nineteenth century",
    "A gardener waters the roses along the fence before noon",
    "The choir rehearses a new song in the hall on Thursday",
    "Fresh bread is sold at the corner bakery from seven o'clock",
)


def oracle_for(env: str, data_dir: str | os.PathLike | None = None) -> Callable[[Task], tuple[str, ...]]:
    """``task -> criteria``: the oracle bundle of an ALFWorld game or a WebShop goal."""
    from orsd_jax.rubrics.oracle import alfworld_oracle, webshop_oracle

    if env == "alfworld":
        return alfworld_oracle
    from orsd_jax.envs.webshop.world import WorldKey, world_for

    goals = world_for(WorldKey.make(data_dir)).goals
    return lambda task: webshop_oracle(goals[int(task.key)])


def shuffled(bundles: Sequence[tuple[str, ...]], tasks: Sequence[Task]) -> list[tuple[str, ...]]:
    """Each group's bundle is that of the next group whose task differs (cyclically): unrelated
    text in the same style. With a single distinct task there is nothing to shuffle."""
    if len({t.description for t in tasks}) < 2:
        raise ValueError("a shuffled rubric needs at least two different tasks in the update")
    out = []
    for g, task in enumerate(tasks):
        other = next(
            k % len(tasks)
            for k in range(g + 1, g + len(tasks))
            if tasks[k % len(tasks)].description != task.description
        )
        out.append(bundles[other])
    return out


def neutral_like(criteria: Sequence[str]) -> tuple[str, ...]:
    """As many criteria as ``criteria``, each of the same length in characters (to the word), made
    of sentences about no task: the text's presence without its content."""
    out = []
    for k, criterion in enumerate(criteria):
        words, text = [], ""
        pool = " ".join(_NEUTRAL[(k + i) % len(_NEUTRAL)] for i in range(len(_NEUTRAL))).split()
        for word in pool:
            if len(text) + len(word) + 1 > max(len(criterion), 20):
                break
            words.append(word)
            text = " ".join(words)
        out.append(text)
    return tuple(out)


def load_file(path: str | os.PathLike) -> dict[str, tuple[str, ...]]:
    """``{task key: criteria}`` from a JSON object of lists of strings; each list must parse as a
    valid bundle of exactly those criteria, else a ValueError names the key."""
    data = json.loads(pathlib.Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping task keys to lists of criteria")
    out = {}
    for key, criteria in data.items():
        if not (isinstance(criteria, list) and all(isinstance(c, str) for c in criteria)):
            raise ValueError(f"{path}: the rubric of {key!r} is not a list of strings")
        parsed = parse_bundle("\n".join(f"{k}. {c}" for k, c in enumerate(criteria, start=1)))
        if not parsed.valid:
            raise ValueError(f"{path}: the rubric of {key!r} is not a valid bundle: {parsed.reason}")
        out[key] = parsed.criteria
    return out


def candidates(
    source: str,
    tasks: Sequence[Task],
    *,
    oracle: Callable[[Task], tuple[str, ...]] | None = None,
    rubrics: Mapping[str, tuple[str, ...]] | None = None,
) -> list[list[ParsedBundle]]:
    """One candidate per group for the sources that need no writer (``oracle``, ``shuffled``,
    ``file``); a task missing from ``rubrics`` gets an invalid candidate, so no rubric, counted."""
    if source in ("oracle", "shuffled"):
        if oracle is None:
            raise ValueError(f"the {source} source needs the oracle")
        bundles = [oracle(t) for t in tasks]
        chosen = bundles if source == "oracle" else shuffled(bundles, tasks)
        return [[ParsedBundle(tuple(c), "")] for c in chosen]
    if source == "file":
        if rubrics is None:
            raise ValueError("the file source needs its rubrics (RubricConfig.source_file)")
        return [
            [ParsedBundle(rubrics[t.key], "") if t.key in rubrics else ParsedBundle((), "no rubric in the file")]
            for t in tasks
        ]
    raise ValueError(f"source {source!r} has no fixed candidates; expected one of {SOURCES[1:]}")
