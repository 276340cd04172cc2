"""Success rates as ALFWorld papers report them: per task type (Pick, Look, Clean, Heat, Cool,
Pick2) and over all episodes. For a deterministic evaluation play every game of a split once,
in ``load_split`` order, and pass the (task type, won) pairs here."""

from __future__ import annotations

import math
from collections.abc import Iterable

from orsd_jax.envs.alfworld.tasks import COLUMNS, TASK_TYPES

ALL = "All"


def _tally(results: Iterable[tuple[str, bool]]) -> dict[str, tuple[int, int]]:
    """Column -> (episodes won, episodes played)."""
    won = dict.fromkeys(TASK_TYPES, 0)
    played = dict.fromkeys(TASK_TYPES, 0)
    for task_type, success in results:
        if task_type not in played:
            raise ValueError(f"unknown ALFWorld task type {task_type!r}; expected one of {TASK_TYPES}")
        played[task_type] += 1
        won[task_type] += bool(success)
    tally = {COLUMNS[t]: (won[t], played[t]) for t in TASK_TYPES}
    tally[ALL] = (sum(won.values()), sum(played.values()))
    return tally


def success_table(results: Iterable[tuple[str, bool]]) -> dict[str, float]:
    """Column -> success rate in [0, 1]; NaN for a task type with no episodes."""
    return {col: won / played if played else math.nan for col, (won, played) in _tally(results).items()}


def success_markdown(results: Iterable[tuple[str, bool]], title: str = "success") -> str:
    """A one-row markdown table of success in percent, with episode counts underneath."""
    tally = _tally(results)
    header = "| | " + " | ".join(tally) + " |"
    rule = "|---|" + "---:|" * len(tally)
    rates = [f"{100 * won / played:.1f}" if played else "-" for won, played in tally.values()]
    counts = [f"{won}/{played}" for won, played in tally.values()]
    rows = [f"| {title} (%) | " + " | ".join(rates) + " |", "| won/played | " + " | ".join(counts) + " |"]
    return "\n".join([header, rule, *rows])
