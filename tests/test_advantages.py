"""GRPO, GiGPO and the ORSD token correction against values worked out by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orsd_jax.advantages import discounted_returns, gigpo_advantages, grpo_advantages, orsd_token_advantages

EPS = 1e-6


def test_grpo_per_trajectory_statistics():
    # Group 7: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3).
    # Group 3: a single trajectory -> 0. Group 5: constant 0.1 (a mean that rounds away from 0.1) -> 0.
    rewards = [1.0, 0.0, 0.7, 0.0, 1.0, 0.1, 0.1, 0.1]
    groups = [7, 7, 3, 7, 7, 5, 5, 5]
    out = grpo_advantages(np.array(rewards), np.array(groups))
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    np.testing.assert_allclose(out, [a, -a, 0, -a, a, 0, 0, 0], rtol=1e-12, atol=0)


def test_grpo_mean_only_and_three_values():
    # Rewards 2, 4, 9: mean 5, deviations -3, -1, 4; sample variance (9 + 1 + 16) / 2 = 13.
    out = grpo_advantages(np.array([2.0, 4.0, 9.0]), np.array([0, 0, 0]))
    np.testing.assert_allclose(out, np.array([-3, -1, 4]) / (math.sqrt(13) + EPS), rtol=1e-12)
    out = grpo_advantages(np.array([2.0, 4.0, 9.0]), np.array([0, 0, 0]), normalize_std=False)
    np.testing.assert_allclose(out, [-3, -1, 4], rtol=1e-12)


def test_grpo_statistics_over_step_samples():
    # verl-agent's variant: trajectory rewards 1 (3 steps) and 0 (1 step) are the samples 1, 1, 1, 0:
    # mean 0.75, sample variance (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5.
    out = grpo_advantages(np.array([1.0, 0.0]), np.array([0, 0]), step_counts=np.array([3, 1]))
    np.testing.assert_allclose(out, [0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS)], rtol=1e-12)
    # One trajectory with several steps is still a constant group.
    assert grpo_advantages(np.array([1.0]), np.array([0]), step_counts=np.array([4]))[0] == 0


def test_discounted_returns_interleaved_trajectories():
    # Trajectory "a": rewards 0, 0, 10 -> 0.95^2 * 10, 0.95 * 10, 10; trajectory "b": 1, 2 -> 1 + 0.5 * 2, 2.
    out = discounted_returns(np.array([0.0, 1.0, 0.0, 2.0, 10.0]), np.array(["a", "b", "a", "b", "a"]), 0.95)
    np.testing.assert_allclose(out, [9.025, 1 + 0.95 * 2, 9.5, 2, 10], rtol=1e-12)


# A GiGPO example: task group 0 has three trajectories, group 1 one. Steps listed per trajectory in
# order; the anchor is the observation the step's action was conditioned on.
#   t0 (group 0): obs start, a, b;  rewards 0, 0, 10  -> returns 9.025, 9.5, 10
#   t1 (group 0): obs start, a;     rewards 0, 0      -> returns 0, 0
#   t3 (group 0): obs start, b;     rewards 0, 10     -> returns 9.5, 10
#   t2 (group 1): obs start;        reward 10         -> return 10
# Anchor groups (group, obs): (0, start) = {9.025, 0, 9.5} (three members), (0, a) = {9.5, 0} (two),
# (0, b) = {10, 10} (constant -> 0), (1, start) = {10} (a single member -> 0; same text, other group).
GIGPO = dict(
    step_rewards=np.array([0, 0, 10, 0, 0, 0, 10, 10], dtype=float),
    group_ids=np.array([0, 0, 0, 0, 0, 0, 0, 1]),
    traj_ids=np.array([0, 0, 0, 1, 1, 3, 3, 2]),
    anchors=["start", "a", "b", "start", "a", "start", "b", "start"],
)


def _by_hand(normalize_std: bool) -> np.ndarray:
    def norm(values):
        values = np.array(values, dtype=float)
        dev = values - values.sum() / len(values)
        if not normalize_std:
            return dev
        return dev / (math.sqrt((dev**2).sum() / (len(values) - 1)) + EPS)

    episode = dict(zip([0, 1, 3], norm([10, 0, 10])))  # episode rewards of t0, t1, t3; t2 alone -> 0
    episode[2] = 0.0
    start = norm([9.025, 0, 9.5])  # t0, t1, t3
    a = norm([9.5, 0])  # t0, t1
    step = [start[0], a[0], 0, start[1], a[1], start[2], 0, 0]
    return np.array([episode[t] for t in GIGPO["traj_ids"]]) + np.array(step)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_gigpo_anchor_groups_of_mixed_sizes(normalize_std):
    out = gigpo_advantages(**GIGPO, normalize_std=normalize_std)
    np.testing.assert_allclose(out, _by_hand(normalize_std), rtol=1e-12, atol=1e-12)


def test_gigpo_mean_std_values_spelled_out():
    out = gigpo_advantages(**GIGPO)
    # Episode: rewards 10, 0, 10 -> mean 20/3, sample std sqrt((2 * (10/3)^2 + (20/3)^2) / 2) = sqrt(100/3).
    e_win, e_lose = (10 / 3) / (math.sqrt(100 / 3) + EPS), -(20 / 3) / (math.sqrt(100 / 3) + EPS)
    # (0, start): mean 6.175, deviations 2.85, -6.175, 3.325; variance (8.1225 + 38.130625 + 11.055625) / 2.
    sd = math.sqrt((8.1225 + 38.130625 + 11.055625) / 2) + EPS
    # (0, a): 9.5 and 0 -> deviations +-4.75, std 4.75 * sqrt(2).
    sa = 4.75 * math.sqrt(2) + EPS
    expected = [
        e_win + 2.85 / sd,
        e_win + 4.75 / sa,
        e_win,
        e_lose - 6.175 / sd,
        e_lose - 4.75 / sa,
        e_win + 3.325 / sd,
        e_win,
        0.0,
    ]
    np.testing.assert_allclose(out, expected, rtol=1e-9)


def test_gigpo_omega_gamma_and_across_steps():
    base = gigpo_advantages(**GIGPO, omega=0.0)
    both = gigpo_advantages(**GIGPO)
    half = gigpo_advantages(**GIGPO, omega=0.5)
    np.testing.assert_allclose(half, base + 0.5 * (both - base), rtol=1e-12, atol=1e-12)
    # gamma 0: the returns are the step rewards; (0, start) is then {0, 0, 0} -> 0, (0, a) {0, 0} -> 0.
    no_discount = gigpo_advantages(**GIGPO, gamma=0.0)
    np.testing.assert_allclose(no_discount, base, rtol=1e-12, atol=1e-12)
    # Episode statistics over step samples: t0 counts 3 times, t1 and t3 twice.
    across = gigpo_advantages(**GIGPO, omega=0.0, across_steps=True)
    expected = grpo_advantages(np.array([10.0, 0.0, 10.0]), np.array([0, 0, 0]), step_counts=np.array([3, 2, 2]))
    np.testing.assert_allclose(across[[0, 3, 5]], expected, rtol=1e-12)
    assert across[7] == 0


def test_orsd_token_advantages_by_hand():
    traj_adv = jnp.array([1.0, -0.5, 2.0])
    logp_with = jnp.array([[-1.0, -0.2, -3.0], [-2.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    logp_without = jnp.array([[-1.5, -3.2, -0.5], [-1.0, -1.1, -4.0], [-1.0, -1.0, -1.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], jnp.float32)  # the last row is all padding
    out = orsd_token_advantages(traj_adv, logp_with, logp_without, mask, coef=0.5, clip=1.0)
    # Gaps: row 0: 0.5, 3.0 -> 1.0, -2.5 -> -1.0; row 1: -1.0, 0.1, (masked).
    expected = [[1 + 0.25, 1 + 0.5, 1 - 0.5], [-0.5 - 0.5, -0.5 + 0.05, 0], [0, 0, 0]]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)


def test_orsd_gap_carries_no_gradient():
    mask = jnp.ones((1, 2))

    def total(logp_with, logp_without):
        return orsd_token_advantages(jnp.array([0.3]), logp_with, logp_without, mask, 0.5, 1.0).sum()

    g_with, g_without = jax.grad(total, argnums=(0, 1))(jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.8]]))
    assert not np.any(np.asarray(g_with)) and not np.any(np.asarray(g_without))
