"""EnvPool with a tiny environment that reports its process: placement, routing, errors."""

import os

import pytest

from orsd_jax.envs import EnvPool, EnvStep, EnvWorkerError, Task

TASK = Task("test", "0", "none", "nothing")


class PidEnv:
    """Answers with its process id and the command; "raise" and "die" misbehave on purpose."""

    def reset(self, task):
        return EnvStep(observation=str(os.getpid()), admissible_actions=())

    def step(self, action):
        if action == "raise":
            raise ValueError("boom")
        if action == "die":
            os._exit(3)
        return EnvStep(observation=f"{os.getpid()}:{action}", admissible_actions=())

    def close(self):
        pass


@pytest.mark.parametrize("n_envs, n_workers", [(6, 2), (7, 3)])
def test_environments_are_spread_evenly_over_the_workers(n_envs, n_workers):
    with EnvPool(PidEnv, n_envs, n_workers=n_workers) as pool:
        pids = [s.observation for s in pool.reset([TASK] * n_envs)]
    sizes = [pids.count(pid) for pid in set(pids)]
    assert len(sizes) == n_workers and max(sizes) - min(sizes) <= 1 and os.getpid() not in map(int, pids)


def test_steps_reach_their_environment_and_none_skips():
    with EnvPool(PidEnv, 5, n_workers=2) as pool:
        pids = [s.observation for s in pool.reset([TASK] * 5)]
        out = pool.step(["a", None, "c", "d", None])
        with pytest.raises(ValueError, match="needs 5 entries"):
            pool.step(["a"])
    assert out[1] is None and out[4] is None
    assert [s.observation for s in out if s] == [f"{pids[0]}:a", f"{pids[2]}:c", f"{pids[3]}:d"]


def test_worker_failures_are_reported():
    pool = EnvPool(PidEnv, 2, n_workers=2)
    try:
        pool.reset([TASK, TASK])
        with pytest.raises(EnvWorkerError, match="boom"):
            pool.step(["raise", None])
        with pytest.raises(EnvWorkerError, match="worker 1 .* died"):
            pool.step([None, "die"])
    finally:
        pool.close()
    pool.close()  # closing twice is harmless
