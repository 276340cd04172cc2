"""ORSD's rubric stage: write candidate bundles, verify them, keep the best-aligned one."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from orsd_jax.rollout import Group
from orsd_jax.rubrics.generate import (
    RubricConfig,
    generate_bundles,
    group_prompt,
    rubric_insert,
    rubric_prompt,
)
from orsd_jax.rubrics.parse import MAX_CRITERIA, MIN_CRITERIA, ParsedBundle, bundle_regex, parse_bundle
from orsd_jax.rubrics.select import MODES, Selection, average_ranks, select_bundle, spearman
from orsd_jax.rubrics.verify import (
    DASHSCOPE,
    EndpointConfig,
    LocalModelVerifier,
    OpenAIVerifier,
    Verifier,
    VerifierStats,
)


@dataclasses.dataclass(frozen=True)
class GroupRubric:
    """What the rubric stage decided for one group."""

    bundles: tuple[ParsedBundle, ...]  # the K candidates as parsed
    satisfaction: np.ndarray  # float[K, G]: mean criterion score per trajectory; NaN if not verified
    selection: Selection

    @property
    def criteria(self) -> tuple[str, ...] | None:
        """The chosen bundle's criteria, or None when the group gets no rubric."""
        return None if self.selection.index is None else self.bundles[self.selection.index].criteria


def verify_and_select(
    verifier: Verifier,
    group: Group,
    bundles: Sequence[ParsedBundle],
    mode: str,
    rng: np.random.Generator,
    rewards: Sequence[float] | np.ndarray | None = None,
    min_correlation: float | None = None,
) -> GroupRubric:
    """Scores the valid bundles on every trajectory and selects one (``mode``: spearman/single/random)
    by rank correlation with ``rewards [G]``: the returns the advantages use (default: the outcome
    rewards); ``min_correlation``: see ``select_bundle``."""
    valid = [b for b, bundle in enumerate(bundles) if bundle.valid]
    satisfaction = np.full((len(bundles), len(group.trajectories)), np.nan)
    if valid:
        scores = verifier.score_many(group.task.description, group.trajectories, [bundles[b].criteria for b in valid])
        for b, s in zip(valid, scores):
            satisfaction[b] = s.mean(axis=1)  # NaN for a trajectory that could not be scored
    targets = np.asarray(group.rewards if rewards is None else rewards, float)
    return GroupRubric(tuple(bundles), satisfaction, select_bundle(satisfaction, targets, mode, rng, min_correlation))


def rubric_metrics(results: Sequence[GroupRubric]) -> dict[str, float]:
    """Per-step statistics of the rubric stage, for the logs."""
    bundles = [b for r in results for b in r.bundles]
    chosen = [r.selection.correlations[r.selection.index] for r in results if r.selection.index is not None]
    spreads = [np.ptp(c[~np.isnan(c)]) for r in results if np.sum(~np.isnan(c := r.selection.correlations)) > 1]
    verified = [np.isfinite(r.satisfaction).all(axis=1) for r in results]
    reasons: dict[str, int] = {}
    for r in results:
        if r.selection.reason:
            reasons[r.selection.reason] = reasons.get(r.selection.reason, 0) + 1
    out = {
        "rubric/bundles": float(len(bundles)),
        "rubric/valid_bundles": float(sum(b.valid for b in bundles)),
        # Repeated criteria (see ``parse``) and the bundles rejected with repeats among them.
        "rubric/repeated_criteria": float(sum(b.repeats for b in bundles)),
        "rubric/rejected_with_repeats": float(sum(not b.valid and b.repeats > 0 for b in bundles)),
        "rubric/verified_bundles": float(sum(v.sum() for v in verified)),
        "rubric/criteria_per_valid_bundle": float(np.mean([len(b.criteria) for b in bundles if b.valid]))
        if any(b.valid for b in bundles)
        else 0.0,
        "rubric/groups_with_rubric": float(len(chosen)),
        "rubric/chosen_correlation": float(np.mean(chosen)) if chosen else float("nan"),
        "rubric/correlation_spread": float(np.mean(spreads)) if spreads else float("nan"),
    }
    for reason, count in reasons.items():
        out[f"rubric/no_rubric/{reason.replace(' ', '_')}"] = float(count)
    return out


__all__ = [
    "DASHSCOPE",
    "MAX_CRITERIA",
    "MIN_CRITERIA",
    "MODES",
    "GroupRubric",
    "LocalModelVerifier",
    "OpenAIVerifier",
    "ParsedBundle",
    "RubricConfig",
    "Selection",
    "Verifier",
    "EndpointConfig",
    "VerifierStats",
    "average_ranks",
    "bundle_regex",
    "generate_bundles",
    "group_prompt",
    "parse_bundle",
    "rubric_insert",
    "rubric_metrics",
    "rubric_prompt",
    "select_bundle",
    "spearman",
    "verify_and_select",
]
