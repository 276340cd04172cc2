"""Advantages: GRPO and GiGPO per step sample (host side, numpy) and ORSD's token correction (jnp).

A *step sample* is one (trajectory, step) pair: one prompt and one sampled response. GRPO and
GiGPO give each step sample a scalar advantage, shared by all of its response tokens; ORSD adds a
per-token correction from the log-likelihood gap with and without the rubric.

Group statistics follow verl-agent: the sample standard deviation (ddof 1), ``eps`` added to the
standard deviation, and a group whose values are all equal (a group of one included) gets 0.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


def gigpo_advantages(
    step_rewards: np.ndarray,
    group_ids: np.ndarray,
    traj_ids: np.ndarray,
    anchors: Sequence[Hashable],
    *,
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
    (the anchor state; exact equality within a task group defines an anchor group).

    - Episode advantage: GRPO over the trajectories' summed rewards (``across_steps``: statistics
      over step samples, as verl-agent).
    - Step advantage: the discounted return ``G_t`` normalised within its anchor group.

    ``normalize_std`` selects mean-std (verl-agent's ALFWorld) or mean-only (WebShop)
    normalisation for both parts.
    """
    step_rewards = np.asarray(step_rewards, dtype=np.float64)
    traj_ids = np.asarray(traj_ids)
    group_ids = np.asarray(group_ids)
    traj_index = _group_index(traj_ids.tolist())
    n_traj = traj_index.max() + 1
    episode_reward = np.bincount(traj_index, step_rewards, minlength=n_traj)
    steps = np.bincount(traj_index, minlength=n_traj)
    traj_group = np.empty(n_traj, dtype=group_ids.dtype)
    traj_group[traj_index] = group_ids
    episode = grpo_advantages(
        episode_reward, traj_group, normalize_std, eps, step_counts=steps if across_steps else None
    )
    returns = discounted_returns(step_rewards, traj_ids, gamma)
    anchor_index = _group_index(list(zip(group_ids.tolist(), anchors)))
    step = _normalize_in_groups(returns, anchor_index, normalize_std, eps)
    return episode[traj_index] + omega * step


def orsd_token_advantages(
    traj_adv: jax.Array,
    logp_with: jax.Array,
    logp_without: jax.Array,
    mask: jax.Array,
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
