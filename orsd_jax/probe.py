"""The credit probe: does the rubric's log-likelihood gap point at the expert's actions?

ORSD's premise is that reading a rubric makes the policy's expert-consistent tokens more likely
and its mistakes less likely, so that ``gap_j = log p(y_j | x, rubric) - log p(y_j | x)`` is a
useful per-token credit. The probe measures it on played episodes, forward passes only:

- **Pooled**: every step of every episode, scored with and without each source's rubric; does the
  step's mean gap (and its action tokens' mean gap) separate expert-consistent steps from the
  others (AUC, a bootstrap interval over games)?
- **Within a state**: every admissible action of a probed state scored as an answer, with and
  without the rubric; is the expert's action ranked first, and does the gap rank it above the
  others? This removes what differs between states (the per-state offset of the gap).
- **Format tokens**: the gap on the answer's tags and stop token; a systematic gap there is a bias
  ORSD applies to every step of every group with a rubric, whatever the action was.

Scoring uses the training forward (``CausalLM.hidden_states`` under ``batch.attention_mask`` and
``loss.slot_logprobs``) on packed rows that share a prompt prefix among several branches: one
branch per source's rubric plus one without (a step), or one per admissible action (a state).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from orsd_jax.batch import PAD, attention_mask
from orsd_jax.loss import slot_logprobs
from orsd_jax.probe_stats import auc, bootstrap_auc, bootstrap_auc_difference, within_state_auc

OTHER, ACTION, FORMAT = 0, 1, 2  # token classes of an answer
_TAGS = ("<think>", "</think>", "<action>", "</action>")

Branch = tuple[Sequence[int], Sequence[int]]  # (context after the shared prefix, scored response)


@dataclasses.dataclass(frozen=True)
class BranchRows:
    """Rows of a shared prefix followed by branches that each see the prefix and themselves."""

    tokens: np.ndarray  # int32[B, T]
    positions: np.ndarray  # int32[B, T]
    reach: np.ndarray  # int32[B, T]: the last index of each token's subtree (``Batch.reach``), PAD
    index: np.ndarray  # int32[B, K, Y]: the position predicting each response token
    targets: np.ndarray  # int32[B, K, Y]: the response tokens
    mask: np.ndarray  # bool[B, K, Y]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_branches(
    rows: Sequence[tuple[Sequence[int], Sequence[Branch]]],
    *,
    seq_multiple: int = 128,
    response_multiple: int = 32,
    branch_multiple: int = 1,
) -> BranchRows:
    """Packs ``(shared prefix, branches)`` rows: each branch restarts its positions after the prefix
    and sees the prefix and itself (``reach``), as ``orsd_jax.batch`` lays out the without-rubric
    branch. Sizes are rounded up to the multiples (one compile per bucket)."""
    if not rows or any(not shared or not branches for shared, branches in rows):
        raise ValueError("every row needs a non-empty shared prefix and at least one branch")
    k = _round_up(max(len(branches) for _, branches in rows), branch_multiple)
    y = _round_up(max(len(r) for _, branches in rows for _, r in branches), response_multiple)
    t = _round_up(max(len(s) + sum(len(c) + len(r) for c, r in b) for s, b in rows), seq_multiple)
    out = BranchRows(
        tokens=np.zeros((len(rows), t), np.int32),
        positions=np.zeros((len(rows), t), np.int32),
        reach=np.full((len(rows), t), PAD, np.int32),
        index=np.zeros((len(rows), k, y), np.int32),
        targets=np.zeros((len(rows), k, y), np.int32),
        mask=np.zeros((len(rows), k, y), bool),
    )
    for i, (shared, branches) in enumerate(rows):
        p = len(shared)
        end = p + sum(len(c) + len(r) for c, r in branches) - 1  # the prefix's subtree: the whole row
        out.tokens[i, :p], out.positions[i, :p], out.reach[i, :p] = shared, np.arange(p), end
        start = p
        for b, (context, response) in enumerate(branches):
            n = len(context) + len(response)
            out.tokens[i, start : start + n] = [*context, *response]
            out.positions[i, start : start + n] = np.arange(p, p + n)
            out.reach[i, start : start + n] = start + n - 1
            # Response token j sits at branch index len(context) + j; the token before predicts it
            # (the prefix's last token when the branch has no context).
            before = [start + len(context) + j - 1 for j in range(len(response))]
            out.index[i, b, : len(response)] = [q if q >= start else p - 1 for q in before]
            out.targets[i, b, : len(response)] = response
            out.mask[i, b, : len(response)] = True
            start += n
    return out


@functools.partial(jax.jit, static_argnums=(0, 6, 7))
def _branch_logprobs(graphdef, params, tokens, positions, reach, index, temperature, chunk_size, targets):
    model = nnx.merge(graphdef, params)
    hidden, _ = model.hidden_states(tokens, positions, mask=attention_mask(reach))
    b, k, y = index.shape
    logp, _ = slot_logprobs(
        model,
        hidden,
        index.reshape(b * k, y),
        targets.reshape(b * k, y),
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return logp.reshape(b, k, y)


def branch_logprobs(
    model,
    rows: Sequence[tuple[Sequence[int], Sequence[Branch]]],
    *,
    temperature: float = 1.0,
    chunk_size: int = 64,
    rows_per_call: int = 4,
    branch_multiple: int = 1,
) -> list[list[np.ndarray]]:
    """Per row, per branch, ``float32[len(response)]``: the log-probs of the branch's response."""
    graphdef, params = nnx.split(model)
    out: list[list[np.ndarray]] = []
    for start in range(0, len(rows), rows_per_call):
        chunk = list(rows[start : start + rows_per_call])
        padded = chunk + [chunk[-1]] * (rows_per_call - len(chunk))  # one shape per bucket
        packed = pack_branches(padded, branch_multiple=branch_multiple)
        logp = np.asarray(
            _branch_logprobs(
                graphdef,
                params,
                packed.tokens,
                packed.positions,
                packed.reach,
                packed.index,
                temperature,
                chunk_size,
                packed.targets,
            )
        )
        for i, (_, branches) in enumerate(chunk):
            out.append([logp[i, b, : len(r)] for b, (_, r) in enumerate(branches)])
    return out


def token_classes(pieces: Sequence[str]) -> np.ndarray:
    """``int8[Y]`` per answer token: ``ACTION`` inside ``<action>...</action>``, ``FORMAT`` on the
    think/action tags and special tokens (``<|...|>``), ``OTHER`` elsewhere (the reasoning)."""
    text = "".join(pieces)
    lowered = text.lower()
    tags = [(m, m + len(tag)) for tag in _TAGS for m in _find_all(lowered, tag)]
    opened, closed = lowered.find("<action>"), lowered.find("</action>")
    action = (opened + len("<action>"), closed) if 0 <= opened < closed else (0, 0)
    out, at = np.zeros(len(pieces), np.int8), 0
    for i, piece in enumerate(pieces):
        span = (at, at + len(piece))
        at += len(piece)
        if span[0] < action[1] and action[0] < span[1] and piece.strip():
            out[i] = ACTION
        elif any(span[0] < b and a < span[1] for a, b in tags) or (piece.startswith("<|") and piece.endswith("|>")):
            out[i] = FORMAT
    return out


def _find_all(text: str, sub: str) -> list[int]:
    found, at = [], text.find(sub)
    while at >= 0:
        found.append(at)
        at = text.find(sub, at + 1)
    return found


@dataclasses.dataclass(frozen=True)
class ProbeStep:
    """One played step, its expert label and the per-token gap under each source's rubric."""

    game: str
    task_type: str
    trajectory: int  # within its group
    step: int
    expert: bool  # expert-consistent: the action starts a shortest plan from the state
    valid: bool
    won: bool  # the trajectory's outcome
    ret: float  # the trajectory's return (outcome minus invalid-answer penalties)
    advantage: float  # its GRPO advantage in the group
    classes: np.ndarray  # int8[Y]
    gaps: Mapping[str, np.ndarray]  # source -> float[Y]; a source that gave the group no rubric is absent


@dataclasses.dataclass(frozen=True)
class ProbeState:
    """One probed state: every admissible action's answer log-likelihood, without a rubric and
    with each source's; ``expert`` marks the planner's first command."""

    game: str
    actions: tuple[str, ...]
    expert: np.ndarray  # bool[A]
    without: np.ndarray  # float[A]: summed log-probs of each action's answer
    with_rubric: Mapping[str, np.ndarray]  # source -> float[A]; absent as in ``ProbeStep.gaps``


def _mean(values: np.ndarray, where: np.ndarray) -> float:
    return float(values[where].mean()) if where.any() else float("nan")


def _paired_auc(steps: Sequence[ProbeStep], source: str, reference: str, n_boot: int, seed: int) -> dict:
    both = [s for s in steps if reference in s.gaps]
    row: dict = {"paired_with": reference, "paired_steps": float(len(both))}
    if both:
        labels, games = np.array([s.expert for s in both], bool), [s.game for s in both]
        mine, theirs = (np.array([float(s.gaps[k].mean()) for s in both]) for k in (source, reference))
        row["paired_auc"], row["paired_auc_reference"] = (
            auc(mine[labels], mine[~labels]),
            auc(theirs[labels], theirs[~labels]),
        )
        diff = bootstrap_auc_difference(mine, theirs, labels, games, n_boot, seed)
        row["paired_auc_diff"], row["paired_auc_diff_lo"], row["paired_auc_diff_hi"] = diff
    return row


def summarise(
    steps: Sequence[ProbeStep],
    states: Sequence[ProbeState],
    sources: Sequence[str],
    *,
    coef: float,
    clip: float,
    n_boot: int = 2000,
    seed: int = 0,
    paired: Mapping[str, str] | None = None,
) -> list[dict[str, float | str]]:
    """One row per source: the pooled AUCs with 95% intervals over games, mean gaps, sign flips,
    the gap's correlation with the outcome, format-token gaps, and the within-state measures.
    ``paired``: source -> a reference source; on the steps both scored, the step-gap AUC of each
    and their difference, with its interval from the same game resamples."""
    from scipy.stats import spearmanr

    out: list[dict[str, float | str]] = []
    for source in sources:
        have = [s for s in steps if source in s.gaps]
        if not have:
            out.append({"source": source, "steps": 0.0, "steps_without_rubric": float(len(steps))})
            continue
        labels = np.array([s.expert for s in have], bool)
        games = [s.game for s in have]
        step_gap = np.array([float(s.gaps[source].mean()) for s in have])
        action_gap = np.array([_mean(s.gaps[source], s.classes == ACTION) for s in have])
        has_action = ~np.isnan(action_gap)
        row: dict[str, float | str] = {"source": source, "steps": float(len(have)), "expert_steps": float(labels.sum())}
        row["auc_step"], row["auc_step_lo"], row["auc_step_hi"] = bootstrap_auc(step_gap, labels, games, n_boot, seed)
        row["auc_action"], row["auc_action_lo"], row["auc_action_hi"] = bootstrap_auc(
            action_gap[has_action], labels[has_action], [g for g, h in zip(games, has_action) if h], n_boot, seed
        )
        row["gap_expert"], row["gap_other"] = _mean(step_gap, labels), _mean(step_gap, ~labels)
        tokens = np.concatenate([s.gaps[source] for s in have])
        classes = np.concatenate([s.classes for s in have])
        row["gap_action_tokens"] = _mean(tokens, classes == ACTION)
        row["gap_format_tokens"] = _mean(tokens, classes == FORMAT)
        row["gap_other_tokens"] = _mean(tokens, classes == OTHER)
        advantage = np.concatenate([np.full(len(s.classes), s.advantage) for s in have])
        corrected = advantage + coef * np.clip(tokens, -clip, clip)
        signed = advantage != 0
        row["sign_flips"] = (
            float(np.mean(np.sign(corrected[signed]) != np.sign(advantage[signed]))) if signed.any() else float("nan")
        )
        trajectories: dict[tuple[str, int], list[int]] = {}
        for i, s in enumerate(have):
            trajectories.setdefault((s.game, s.trajectory), []).append(i)
        traj_gap = [float(np.mean(step_gap[idx])) for idx in trajectories.values()]
        traj_ret = [have[idx[0]].ret for idx in trajectories.values()]
        rho = spearmanr(traj_gap, traj_ret).statistic if len(set(traj_ret)) > 1 else float("nan")
        row["gap_outcome_spearman"] = float(rho)
        row["steps_without_rubric"] = float(len(steps) - len(have))
        if paired and (reference := paired.get(source)):
            row |= _paired_auc(have, source, reference, n_boot, seed)
        with_states = [s for s in states if source in s.with_rubric and s.expert.any() and not s.expert.all()]
        if with_states:
            row["states"] = float(len(with_states))
            row["top1_without"] = float(np.mean([s.expert[np.argmax(s.without)] for s in with_states]))
            row["top1_with"] = float(np.mean([s.expert[np.argmax(s.with_rubric[source])] for s in with_states]))
            scores = np.concatenate([s.with_rubric[source] - s.without for s in with_states])
            marks = np.concatenate([s.expert for s in with_states])
            ids = [i for i, s in enumerate(with_states) for _ in s.actions]
            row["within_state_auc"] = within_state_auc(scores, marks, ids)
        out.append(row)
    return out
