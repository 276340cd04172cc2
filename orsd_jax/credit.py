"""Per-token credit: the values the ORSD loss computes for every response token.

``OrsdLoss`` returns, beside the loss, its intermediate quantities per token (``VALUES``):
log-probs with and without the rubric, their gap, the step sample's advantage and the corrected
token advantage. The train step hands them back, so the trainer records them for the minibatches
of an update from the training forward itself, at the parameters that minibatch's loss used:
``save_credit`` writes them with the update's groups and rubrics to ``steps/<update>/``, and
``load_credit`` reads them back with the text they belong to.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pathlib
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from orsd_jax.batch import StepSample, samples_from_json, samples_to_json

if TYPE_CHECKING:
    from orsd_jax.envs.base import TextEnv
    from orsd_jax.envs.webshop import WebShopEnv
    from orsd_jax.rollout import Group
    from orsd_jax.rubrics import GroupRubric
    from orsd_jax.samples import StepKey

SAMPLES = "samples.json.gz"  # a recorded update's step samples, in its steps/<update>/ folder
VALUES = ("logp_with", "logp_without", "gap", "advantage", "corrected", "gap_clipped")


@dataclasses.dataclass(frozen=True)
class RecordedMinibatch:
    """The per-token values one optimizer step's loss computed (``VALUES``, each ``[N, Y]``) for
    its ``N`` step samples, given as indices into the update's samples; ``mask`` ``[N, Y]``."""

    samples: tuple[int, ...]
    values: dict[str, np.ndarray]
    mask: np.ndarray


def expert_labels(groups: Sequence[Group], make_env: Callable[[], TextEnv]) -> list[list[list[bool]]]:
    """Per group, trajectory and step: the action was expert-consistent (it shortens the expert's
    remaining route by one: ALFWorld's planner on the live game, WebShop's route to the goal
    product, replayed on an env of ``make_env``, which has the episodes' step limit)."""
    if not groups:
        return []
    if groups[0].task.env == "alfworld":
        from orsd_jax.envs.alfworld import expert as alfworld_expert

        return alfworld_expert.label_groups(groups)
    from orsd_jax.envs.webshop import expert as webshop_expert

    env = make_env()
    try:
        return webshop_expert.label_groups(typing.cast("WebShopEnv", env), groups)
    finally:
        env.close()


def rubric_record(r: GroupRubric) -> dict:
    """A group's rubric stage as JSON: the candidates (criteria and why one was rejected), their
    satisfaction per trajectory, correlations, and the selection."""
    return {
        "candidates": [{"criteria": list(b.criteria), "reason": b.reason} for b in r.bundles],
        "satisfaction": _nan_as_none(r.satisfaction),
        "correlations": [None if np.isnan(c) else float(c) for c in r.selection.correlations],
        "chosen": r.selection.index,
        "reason": r.selection.reason,
    }


def save_credit(
    run_dir: str | os.PathLike,
    update: int,
    groups: Sequence[Group],
    returns: Sequence[np.ndarray],
    rubrics: Sequence[GroupRubric] | None,
    index: Sequence[StepKey],
    minibatches: Sequence[RecordedMinibatch],
    make_env: Callable[[], TextEnv],
    samples: Sequence[StepSample] = (),
) -> pathlib.Path:
    """What the credit maps show, in ``steps/<update>/``: the groups as text with each
    trajectory's return (``returns[g][t]``), the rubric candidates and selection, the per-token
    values of the recorded minibatches (``index[i]``: where step sample ``i`` came from) and
    whether each step's action was expert-consistent (``expert_labels``, on an env of ``make_env``).
    ``samples``: the update's step samples as the training stage read them (``samples.json.gz``,
    ``load_samples``), so that it can be replayed apart (``benchmarks.pack_rows --samples-from``)."""
    directory = pathlib.Path(run_dir) / "steps" / f"{update:05d}"
    directory.mkdir(parents=True, exist_ok=True)
    expert = expert_labels(groups, make_env)
    payload = {
        "groups": [
            {
                "task": dataclasses.asdict(g.task),
                "trajectories": [
                    {
                        "won": t.won,
                        "score": t.score,
                        "reward": t.reward,
                        "return": float(r),
                        "steps": [
                            {
                                "observation": s.observation,
                                "response": s.response_text,
                                "action": s.action,
                                "valid": s.valid,
                                "valid_format": s.valid_format,
                                "reward": s.reward,
                                "response_ids": list(s.response_ids),
                                "expert": e,
                            }
                            for s, e in zip(t.steps, labels)
                        ],
                    }
                    for t, r, labels in zip(g.trajectories, group_returns, experts)
                ],
            }
            for g, group_returns, experts in zip(groups, returns, expert)
        ],
        "rubrics": None if rubrics is None else [rubric_record(r) for r in rubrics],
    }
    (directory / "step.json").write_text(json.dumps(payload))
    if samples:
        with gzip.open(directory / SAMPLES, "wt") as f:
            json.dump(samples_to_json(samples), f)
    for k, m in enumerate(minibatches):
        rows = np.array([index[i] for i in m.samples])
        # numpy's stub matches the unpacked arrays against its allow_pickle parameter.
        np.savez_compressed(directory / f"credit_{k}.npz", rows=rows, mask=m.mask, **m.values)  # type: ignore[arg-type]
    return directory


def load_samples(path: str | os.PathLike) -> list[StepSample]:
    """A recorded update's step samples (``save_credit``): its ``steps/<update>/`` folder or the file."""
    path = pathlib.Path(path)
    with gzip.open(path / SAMPLES if path.is_dir() else path, "rt") as f:
        return samples_from_json(json.load(f))


def _nan_as_none(values: np.ndarray) -> list:
    """``values.tolist()`` with None for NaN (JSON has no NaN)."""
    out = values.astype(object)
    out[np.isnan(values)] = None
    return out.tolist()


@dataclasses.dataclass(frozen=True)
class StepCredit:
    """One step sample of a recorded update with its per-token values (each ``[Y]``, Y = response length)."""

    group: int
    trajectory: int
    step: int
    task: str
    observation: str
    response: str
    response_ids: tuple[int, ...]
    pieces: tuple[str, ...]  # the response as text, one piece per token; they concatenate to the decoded response
    won: bool
    reward: float
    criteria: tuple[str, ...] | None  # the group's selected rubric (None: the group got none)
    values: dict[str, np.ndarray]
    expert: bool | None = None  # the action was expert-consistent (``expert_labels``; None: not recorded)


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    task: str
    rewards: tuple[float, ...]  # returns: outcome reward minus invalid-answer penalties
    candidates: tuple[tuple[str, ...], ...]  # the K bundles' criteria (empty for an unparseable one)
    correlations: tuple[float | None, ...]  # Spearman of each bundle's satisfaction with the rewards
    chosen: int | None
    reason: str  # why the group got no rubric ("" when it got one)


@dataclasses.dataclass(frozen=True)
class CreditRecord:
    update: int
    groups: tuple[GroupRecord, ...]
    steps: tuple[StepCredit, ...]  # in (group, trajectory, step) order


def token_pieces(tokenizer, ids: Sequence[int]) -> tuple[str, ...]:
    """Per-token text whose concatenation is ``tokenizer.decode(ids)``. A token that ends inside a
    multi-byte character gets ``""`` and the character goes to the token that completes it."""
    pieces, shown = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(list(ids[: i + 1]))
        if text.endswith("\ufffd") and i + 1 < len(ids) or not text.startswith(shown):
            pieces.append("")
            continue
        pieces.append(text[len(shown) :])
        shown = text
    return tuple(pieces)


def recorded_updates(run_dir: str | os.PathLike) -> list[int]:
    """Updates of ``run_dir`` with recorded per-token credit."""
    steps = pathlib.Path(run_dir) / "steps"
    return sorted(int(d.name) for d in steps.glob("*") if (d / "step.json").is_file() and any(d.glob("credit_*.npz")))


def run_tokenizer(run_dir: str | os.PathLike):
    """The tokenizer of a run's policy, also for a run that has not exported one yet."""
    from orsd_jax.models import load_tokenizer, resolve

    run = pathlib.Path(run_dir)
    for directory in (run / "policy", run / "initial_policy"):
        if (directory / "tokenizer_config.json").is_file():
            return load_tokenizer(directory)
    model = json.loads((run / "config.json").read_text())["model"]  # config.to_json's record
    return load_tokenizer(resolve(model["warmstart"]["model"] if model["warmstart"] else model["name"]))


def load_credit(run_dir: str | os.PathLike, update: int | None = None, tokenizer=None) -> CreditRecord:
    """The recorded update ``update`` (default: the last) of a run (``tokenizer``: default ``run_tokenizer``)."""
    run = pathlib.Path(run_dir)
    updates = recorded_updates(run)
    if not updates:
        raise FileNotFoundError(f"{run} has no recorded credit (steps/<update>/step.json and credit_*.npz)")
    update = updates[-1] if update is None else update
    if update not in updates:
        raise FileNotFoundError(f"update {update} of {run} was not recorded; recorded: {updates}")
    tokenizer = run_tokenizer(run) if tokenizer is None else tokenizer
    directory = run / "steps" / f"{update:05d}"
    payload = json.loads((directory / "step.json").read_text())
    rubrics = payload["rubrics"] or [None] * len(payload["groups"])
    groups = []
    for g, r in zip(payload["groups"], rubrics):
        rewards = tuple(float(t["return"]) for t in g["trajectories"])
        if r is None:
            groups.append(GroupRecord(g["task"]["description"], rewards, (), (), None, "no rubric stage"))
        else:
            groups.append(
                GroupRecord(
                    g["task"]["description"],
                    rewards,
                    tuple(tuple(c["criteria"]) for c in r["candidates"]),
                    tuple(r["correlations"]),
                    r["chosen"],
                    r["reason"],
                )
            )
    values: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
    for path in sorted(directory.glob("credit_*.npz")):
        with np.load(path) as data:
            for i, key in enumerate(map(tuple, data["rows"].tolist())):
                n = int(data["mask"][i].sum())
                values[key] = {name: data[name][i, :n] for name in VALUES}
    steps = []
    for (g, t, s), v in sorted(values.items()):
        group, step = payload["groups"][g], payload["groups"][g]["trajectories"][t]["steps"][s]
        traj, rubric = group["trajectories"][t], groups[g]
        ids = tuple(step["response_ids"])
        steps.append(
            StepCredit(
                g,
                t,
                s,
                rubric.task,
                step["observation"],
                step["response"],
                ids,
                token_pieces(tokenizer, ids),
                bool(traj["won"]),
                float(traj["reward"]),
                None if rubric.chosen is None else rubric.candidates[rubric.chosen],
                v,
                step.get("expert"),
            )
        )
    return CreditRecord(update, tuple(groups), tuple(steps))
