"""Advantages: GRPO and GiGPO per step sample (host side, numpy) and ORSD's token correction (jnp).

A *step sample* is one (trajectory, step) pair: one prompt and one sampled response. GRPO and
GiGPO give each step sample a scalar advantage, shared by all of its response tokens; ORSD adds a
per-token correction from the log-likelihood gap with and without the rubric.

Group statistics follow verl-agent: the sample standard deviation (ddof 1), ``eps`` added to the
standard deviation, and a group whose values are all equal (a group of one included) gets 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from orsd_jax.rollout import Group, Step

INVALID_RULES = ("format", "admissible")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """GRPO / GiGPO per step sample. The invalid-answer penalty is charged to the step sample
    that gave the answer: summed into its trajectory's value (per-trajectory statistics) or kept on
    the sample (``across_steps``, verl-agent's default); GiGPO subtracts it from the step's return
    after discounting."""

    across_steps: bool = False  # verl-agent: True (statistics over the group's step samples)
    # None: verl-agent's choice for the method and environment (``verl_agent_normalize_std``).
    normalize_std: bool | None = None
    invalid_penalty: float = 0.1
    # What an invalid answer is: "format" (verl-agent: tags missing or CJK) or "admissible" (also a
    # well-formed command the environment does not admit).
    invalid: str = "format"
    gamma: float = 0.95  # GiGPO discount
    omega: float = 1.0  # GiGPO step-advantage weight

    def __post_init__(self):
        if self.invalid not in INVALID_RULES:
            raise ValueError(f"unknown invalid-answer rule {self.invalid!r}; expected one of {INVALID_RULES}")


def verl_agent_normalize_std(method: str, env: str) -> bool:
    """verl-agent's normalisation: GRPO (and so ORSD) divides by the group's std everywhere
    (``norm_adv_by_std_in_grpo``); GiGPO runs ``mean_std_norm`` on ALFWorld and ``mean_norm``
    (mean only) on WebShop (its example scripts)."""
    return not (method == "gigpo" and env == "webshop")


def _group_index(keys: Sequence[Hashable]) -> np.ndarray:
    """``int[N]``: consecutive ids of equal keys, in order of first appearance."""
    ids: dict[Hashable, int] = {}
    return np.array([ids.setdefault(k, len(ids)) for k in keys], dtype=np.int64)


def _normalize_in_groups(
    values: np.ndarray, index: np.ndarray, normalize_std: bool, eps: float, weights: np.ndarray | None = None
) -> np.ndarray:
    """``(v - mean_g) [/ (std_g + eps)]`` per group ``index [N]``; ``weights [N]`` count each value that often."""
    w = np.ones_like(values) if weights is None else weights.astype(np.float64)
    count = np.bincount(index, w)
    mean = np.bincount(index, w * values) / count
    dev = values - mean[index]
    lo = np.full(len(count), np.inf)
    hi = np.full(len(count), -np.inf)
    np.minimum.at(lo, index, values)
    np.maximum.at(hi, index, values)
    constant = (lo == hi)[index]  # exact test: a mean of equal floats may differ from them by rounding
    if normalize_std:
        var = np.bincount(index, w * dev**2) / np.maximum(count - 1, 1)
        dev = dev / (np.sqrt(var)[index] + eps)
    return np.where(constant, 0.0, dev)


def grpo_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    normalize_std: bool = True,
    eps: float = 1e-6,
    step_counts: np.ndarray | None = None,
) -> np.ndarray:
    """``float[N]``: ``(R - mean_g) / (std_g + eps)`` for trajectory rewards ``R [N]`` in groups ``[N]``.

    Statistics are over trajectories. With ``step_counts [N]`` (steps per trajectory) they are
    over step samples instead, verl-agent's default: trajectory ``i`` counts ``step_counts[i]``
    times. ``normalize_std=False`` only subtracts the mean (Dr. GRPO, GiGPO's ``mean_norm``).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    weights = None if step_counts is None else np.asarray(step_counts)
    return _normalize_in_groups(rewards, _group_index(np.asarray(group_ids).tolist()), normalize_std, eps, weights)


def discounted_returns(step_rewards: np.ndarray, traj_ids: np.ndarray, gamma: float) -> np.ndarray:
    """``float[N]``: ``G_t = r_t + gamma * G_{t+1}`` within each trajectory.

    The samples of a trajectory must appear in step order (they need not be contiguous).
    """
    rewards = np.asarray(step_rewards, dtype=np.float64)
    trajs = np.asarray(traj_ids).tolist()
    out = np.empty_like(rewards)
    following: dict[Hashable, float] = {}  # G of the next step seen so far, per trajectory
    for i in range(len(rewards) - 1, -1, -1):
        out[i] = following[trajs[i]] = rewards[i] + gamma * following.get(trajs[i], 0.0)
    return out


def episode_advantages(
    outcomes: np.ndarray,
    penalties: np.ndarray,
    group_ids: np.ndarray,
    traj_ids: np.ndarray,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    across_steps: bool = False,
) -> np.ndarray:
    """``float[N]`` per step sample: GRPO's episode advantage with the invalid-answer penalty.

    Inputs per step sample ``[N]``: ``outcomes`` the trajectory's outcome reward (equal on its
    samples), ``penalties`` the penalty of the sample's own answer (>= 0). ``across_steps``
    (verl-agent): each sample's value is ``outcome - its penalty`` and statistics run over the
    group's samples; otherwise a trajectory's value is ``outcome - the sum of its penalties`` and
    statistics run over the group's trajectories.
    """
    outcomes, penalties = np.asarray(outcomes, np.float64), np.asarray(penalties, np.float64)
    if across_steps:
        return grpo_advantages(outcomes - penalties, group_ids, normalize_std, eps)
    traj_index = _group_index(np.asarray(traj_ids).tolist())
    totals = np.bincount(traj_index, outcomes) / np.bincount(traj_index) - np.bincount(traj_index, penalties)
    owners = np.empty(len(totals), dtype=np.asarray(group_ids).dtype)
    owners[traj_index] = group_ids
    return grpo_advantages(totals, owners, normalize_std, eps)[traj_index]


def gigpo_advantages(
    step_rewards: np.ndarray,
    group_ids: np.ndarray,
    traj_ids: np.ndarray,
    anchors: Sequence[Hashable],
    *,
    penalties: np.ndarray | None = None,
    gamma: float = 0.95,
    omega: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
    across_steps: bool = False,
) -> np.ndarray:
    """``float[N]`` per step sample: episode advantage plus ``omega`` times the step advantage.

    Inputs are per step sample ``[N]``, the samples of each trajectory in step order:
    ``step_rewards`` the environment reward of the step's transition, ``group_ids`` the task
    group, ``traj_ids`` the trajectory, ``anchors`` the observation the action was conditioned on
    (the anchor state; exact equality within a task group defines an anchor group), ``penalties``
    the invalid-answer penalty of the step (default none).

    - Episode advantage: ``episode_advantages`` of the summed environment rewards.
    - Step advantage: the discounted return ``G_t`` of the environment rewards minus the step's own
      penalty (subtracted after discounting, as verl-agent does, so a penalty never leaks into
      earlier steps' returns), normalised within its anchor group.

    ``normalize_std`` selects mean-std (verl-agent's ALFWorld) or mean-only (WebShop)
    normalisation for both parts.
    """
    step_rewards = np.asarray(step_rewards, dtype=np.float64)
    penalties = np.zeros_like(step_rewards) if penalties is None else np.asarray(penalties, np.float64)
    traj_ids, group_ids = np.asarray(traj_ids), np.asarray(group_ids)
    traj_index = _group_index(traj_ids.tolist())
    outcomes = np.bincount(traj_index, step_rewards)[traj_index]
    episode = episode_advantages(
        outcomes, penalties, group_ids, traj_ids, normalize_std=normalize_std, eps=eps, across_steps=across_steps
    )
    returns = discounted_returns(step_rewards, traj_ids, gamma) - penalties
    anchor_index = _group_index(list(zip(group_ids.tolist(), anchors)))
    step = _normalize_in_groups(returns, anchor_index, normalize_std, eps)
    return episode + omega * step


def orsd_token_advantages(
    traj_adv: np.ndarray | jax.Array,
    logp_with: jax.Array,
    logp_without: jax.Array,
    mask: np.ndarray | jax.Array,
    coef: float,
    clip: float,
) -> jax.Array:
    """``float[B, T]``: ``A + coef * clip(logp_with - logp_without, -clip, clip)`` on masked tokens, 0 elsewhere.

    ``traj_adv [B]`` is the step sample's advantage; ``logp_with``/``logp_without [B, T]`` are the
    policy's log-probs of the response tokens with and without the rubric; ``mask [B, T]``. The
    gap is a fixed per-token reward: no gradient flows through it.
    """
    gap = jax.lax.stop_gradient(logp_with - logp_without)
    adv = traj_adv[:, None] + coef * jnp.clip(gap, -clip, clip)
    return jnp.where(mask > 0, adv, 0.0)


def penalised(step: Step, rule: str) -> bool:
    """Whether ``step``'s answer costs the invalid-answer penalty under ``rule`` (``INVALID_RULES``)."""
    return not (step.valid_format if rule == "format" else step.valid)


def returns(group: Group, config: AdvantageConfig) -> np.ndarray:
    """``float[G]``: each trajectory's outcome reward minus the penalties of its invalid answers."""
    return np.array(
        [
            t.reward - config.invalid_penalty * sum(penalised(s, config.invalid) for s in t.steps)
            for t in group.trajectories
        ]
    )


def rank_targets(group: Group, rank_by: str, config: AdvantageConfig) -> np.ndarray:
    """``float[G]``: what rubric selection rank-correlates satisfaction with (``RubricConfig.rank_by``):
    the outcome rewards (the paper) or the ``returns``."""
    return returns(group, config) if rank_by == "return" else np.asarray(group.rewards, np.float64)


def step_advantages(groups: Sequence[Group], method: str, config: AdvantageConfig) -> list[list[np.ndarray]]:
    """Per group, per trajectory, ``float[steps]``: the advantage of each step sample, GiGPO's for
    ``method == "gigpo"``, GRPO's otherwise (ORSD corrects GRPO's per token later)."""
    if config.normalize_std is None:
        raise ValueError("AdvantageConfig.normalize_std is unresolved: use TrainConfig.resolved()")
    rows = [
        (g, t, s) for g, group in enumerate(groups) for t, traj in enumerate(group.trajectories) for s in traj.steps
    ]
    group_ids = np.array([g for g, _, _ in rows])
    traj_ids = _group_index([(g, t) for g, t, _ in rows])
    penalties = np.array([config.invalid_penalty * penalised(s, config.invalid) for _, _, s in rows])
    options = dict(normalize_std=config.normalize_std, across_steps=config.across_steps)
    if method == "gigpo":
        flat = gigpo_advantages(
            np.array([s.reward for _, _, s in rows]),
            group_ids,
            traj_ids,
            [s.observation for _, _, s in rows],
            penalties=penalties,
            gamma=config.gamma,
            omega=config.omega,
            **options,
        )
    else:
        outcomes = np.array([groups[g].trajectories[t].reward for g, t, _ in rows])
        flat = episode_advantages(outcomes, penalties, group_ids, traj_ids, **options)
    out: list[list[np.ndarray]] = []
    i = 0
    for group in groups:
        out.append([])
        for traj in group.trajectories:
            out[-1].append(flat[i : i + len(traj.steps)])
            i += len(traj.steps)
    return out
