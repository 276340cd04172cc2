"""Rubric memory across updates (beyond the paper; ``RubricConfig.memory_examples`` and
``memory_candidate``, both off in every preset).

The paper's rubrics come from each group alone: nothing learnt about which criteria separate good
from bad episodes of a kind of task outlives its update. The memory keeps the criteria of every
selected bundle, keyed by the task's type (ALFWorld's pick, look, ...; WebShop's product category),
each with its record: how often it was selected, its mean Spearman correlation when selected, its
mean gap alignment (the gap-return correlation, with ``--selection gap-alignment``), and the
updates it was first and last selected in. Criteria are one entry when their words match after
case, punctuation and ordinal prefixes (``parse.criterion_key``). Each key holds at most
``size`` entries; past that, the entries with the weakest correlation record go (fewer
selections, then the older, on ties).

Two uses: the writer's prompt shows the ``M`` best-recorded criteria of the task's type as
examples (``rubric_prompt(..., examples=)``), and the remembered bundle of the type (its best 5-8
entries) joins the K fresh candidates, verified and ranked like them.

Values are immutable: ``remember`` returns a new memory. The trainer keeps it in each
checkpoint's record (exact resume) and writes it to ``RUN/rubric_memory.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence

from orsd_jax.checkpoints import refused_writes
from orsd_jax.rollout import Group
from orsd_jax.rubrics import GroupRubric
from orsd_jax.rubrics.parse import MAX_CRITERIA, MIN_CRITERIA, ParsedBundle, criterion_key


@dataclasses.dataclass(frozen=True)
class Remembered:
    criterion: str  # as first written
    selected: int  # times it was in a selected bundle
    correlation: float  # mean Spearman correlation of those bundles
    alignment: float | None  # mean gap-return correlation of those bundles (gap-alignment selection)
    aligned: int  # how many of the selections measured an alignment
    first_update: int
    last_update: int

    def rank(self) -> tuple[float, int, int]:
        """Sort key, best first: correlation record, selections, recency."""
        return (-self.correlation, -self.selected, -self.last_update)


@dataclasses.dataclass(frozen=True)
class RubricMemory:
    size: int = 16  # entries per key
    entries: Mapping[str, tuple[Remembered, ...]] = dataclasses.field(default_factory=dict)  # best first

    def __post_init__(self):
        if self.size < MIN_CRITERIA:
            raise ValueError(f"a rubric memory of {self.size} entries per key cannot hold a bundle ({MIN_CRITERIA})")

    def remember(
        self, key: str, criteria: tuple[str, ...], correlation: float, alignment: float | None, update: int
    ) -> RubricMemory:
        """The memory after a bundle of ``criteria`` was selected for a task of type ``key`` (a
        bundle without a defined correlation, as ``single`` selection can give, is not remembered)."""
        if not math.isfinite(correlation):
            return self
        if alignment is not None and not math.isfinite(alignment):
            alignment = None  # not measured
        kept = {criterion_key(e.criterion): e for e in self.entries.get(key, ())}
        for criterion in criteria:
            old = kept.get(criterion_key(criterion)) or Remembered(criterion, 0, 0.0, None, 0, update, update)
            n, m = old.selected, old.aligned
            kept[criterion_key(criterion)] = dataclasses.replace(
                old,
                selected=n + 1,
                correlation=(old.correlation * n + correlation) / (n + 1),
                alignment=old.alignment if alignment is None else ((old.alignment or 0.0) * m + alignment) / (m + 1),
                aligned=m + (alignment is not None),
                last_update=update,
            )
        best = tuple(sorted(kept.values(), key=Remembered.rank)[: self.size])
        return dataclasses.replace(self, entries={**self.entries, key: best})

    def examples(self, key: str, m: int) -> tuple[str, ...]:
        """The ``m`` best-recorded criteria for ``key`` (fewer when fewer are known)."""
        return tuple(e.criterion for e in self.entries.get(key, ())[:m])

    def bundle(self, key: str) -> tuple[str, ...] | None:
        """The remembered bundle for ``key``: its best ``MAX_CRITERIA`` criteria, None below ``MIN_CRITERIA``."""
        found = self.examples(key, MAX_CRITERIA)
        return found if len(found) >= MIN_CRITERIA else None

    def age(self, key: str, criteria: tuple[str, ...], update: int) -> float:
        """Mean updates since each of ``criteria`` was first selected (0 for one the memory lacks)."""
        first = {criterion_key(e.criterion): e.first_update for e in self.entries.get(key, ())}
        return sum(update - first.get(criterion_key(c), update) for c in criteria) / max(len(criteria), 1)

    def to_json(self) -> dict:
        return {"size": self.size, "entries": {k: [dataclasses.asdict(e) for e in v] for k, v in self.entries.items()}}

    @classmethod
    def from_json(cls, data: Mapping) -> RubricMemory:
        entries = {k: tuple(Remembered(**e) for e in v) for k, v in data["entries"].items()}
        return cls(size=int(data["size"]), entries=entries)


def save(memory: RubricMemory, path: pathlib.Path) -> None:
    """The memory as readable JSON at ``path``, replaced whole (a reader never sees half of it)."""
    partial = path.with_suffix(".json.tmp")
    with refused_writes("the rubric memory", path):
        partial.write_text(json.dumps(memory.to_json(), indent=1))
    os.replace(partial, path)


# The rubric stage's use of the memory (``trainer.rubric_stage``).


def offer(
    memory: RubricMemory, groups: Sequence[Group], bundles: Sequence[Sequence[ParsedBundle]]
) -> tuple[list[tuple[ParsedBundle, ...]], list[int | None]]:
    """Each group's candidates with its type's remembered bundle appended (K + 1 of them), and the
    remembered one's index per group (None where the memory holds no bundle for the type yet)."""
    out, offered = [], []
    for group, candidates in zip(groups, bundles):
        remembered = memory.bundle(group.task.task_type)
        offered.append(None if remembered is None else len(candidates))
        out.append((*candidates, *([] if remembered is None else [ParsedBundle(remembered, "")])))
    return out, offered


def remember_selected(
    memory: RubricMemory,
    groups: Sequence[Group],
    verified: Sequence[GroupRubric],
    chosen: Sequence[GroupRubric],
    update: int,
) -> RubricMemory:
    """The memory after the update's selections. ``verified``: selection by Spearman correlation;
    ``chosen``: the final one, either ``verified`` itself or a selection by gap alignment (whose
    correlations are the bundles' gap-return correlations, remembered as their alignment)."""
    for group, by_spearman, final in zip(groups, verified, chosen):
        b = final.selection.index
        if b is None:
            continue
        correlation = float(by_spearman.selection.correlations[b])
        alignment = None if final is by_spearman else float(final.selection.correlations[b])
        memory = memory.remember(group.task.task_type, final.bundles[b].criteria, correlation, alignment, update)
    return memory


def memory_metrics(
    before: RubricMemory,
    after: RubricMemory,
    groups: Sequence[Group],
    chosen: Sequence[GroupRubric],
    offered: Sequence[int | None],
    update: int,
) -> dict[str, float]:
    """How often a remembered bundle won, the age of the chosen criteria (in the memory before the
    update), and the memory's size per type after it."""
    picked = [(g, r) for g, r in zip(groups, chosen) if r.selection.index is not None]
    out = {
        "rubric/memory/offered": float(sum(o is not None for o in offered)),
        "rubric/memory/wins": float(sum(o is not None and r.selection.index == o for o, r in zip(offered, chosen))),
        "rubric/memory/age": float(
            sum(before.age(g.task.task_type, r.criteria or (), update) for g, r in picked) / len(picked)
        )
        if picked
        else float("nan"),
    }
    for key, entries in after.entries.items():
        out[f"rubric/memory/size/{key}"] = float(len(entries))
    return out
