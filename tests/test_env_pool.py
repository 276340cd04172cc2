"""EnvPool with a tiny environment that reports its process: placement, routing, errors."""

import contextlib
import os
import time

import pytest

from orsd_jax.envs import EnvPool, EnvStep, EnvWorkerError, Task

TASK = Task("test", "0", "none", "nothing")


class PidEnv:
    """Answers with its process id and the command; "raise", "die", "slow" and "hang" misbehave on purpose."""

    def reset(self, task):
        return EnvStep(observation=str(os.getpid()), admissible_actions=())

    def step(self, action):
        if action == "raise":
            raise ValueError("boom")
        if action == "die":
            os._exit(3)
        if action == "slow":
            time.sleep(0.5)
        if action == "hang":
            time.sleep(3600)
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


def test_resets_and_steps_of_single_environments_from_many_threads_reach_their_own():
    """Asynchronous episodes: one thread per environment, each resetting and stepping its own,
    several of them on one worker at once ("slow" holds a worker while its neighbours wait on its pipe)."""
    import concurrent.futures

    def episode(i: int) -> tuple[str, list[str]]:
        return pool.reset_one(i, TASK).observation, [pool.step_one(i, a).observation for a in actions[i]]

    with EnvPool(PidEnv, 6, n_workers=2) as pool:
        actions = [["slow", f"a{i}", "slow"] if i % 3 == 0 else [f"a{i}", f"b{i}", f"c{i}"] for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as threads:
            seen = list(threads.map(episode, range(6)))
        pids = [pid for pid, _ in seen]
        assert len(set(pids)) == 2 and pids == [pids[i % 2] for i in range(6)]  # environment i on worker i % 2
        assert [steps for _, steps in seen] == [[f"{pids[i]}:{a}" for a in actions[i]] for i in range(6)]
        with pytest.raises(EnvWorkerError, match="boom"):
            pool.step_one(1, "raise")
        assert pool.step_one(1, "again").observation == f"{pids[1]}:again"  # no stale reply


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


def test_a_hung_worker_is_killed_at_the_timeout_and_reported():
    with EnvPool(PidEnv, 2, n_workers=2, timeout=3) as pool:
        pool.reset([TASK, TASK])
        start = time.monotonic()
        with pytest.raises(EnvWorkerError, match="worker 0 .* did not answer within 3 s"):
            pool.step(["hang", "a"])
        assert time.monotonic() - start < 10
        assert pool.step([None, "b"])[1].observation.endswith(":b")  # the other worker still serves
        with pytest.raises(EnvWorkerError, match="worker 0 .*(died|is gone)"):
            pool.step(["a", None])


def test_no_stale_reply_after_another_workers_failure():
    """Worker 1's reply to the failed call is read with it, so the next call gets its own answer."""
    with EnvPool(PidEnv, 2, n_workers=2) as pool:
        pool.reset([TASK, TASK])
        with pytest.raises(EnvWorkerError, match="boom"):
            pool.step(["raise", "slow"])
        assert pool.step([None, "fresh"])[1].observation.endswith(":fresh")


# A process that starts a pool of 2 workers and gets SIGTERM (its handler raises) the moment the
# second worker's process exists, before the worker has read its start data from the pipe.
_SIGNALLED_START = """
import multiprocessing.util, os, signal, sys
sys.path.insert(0, sys.argv[1])
from test_env_pool import PidEnv
from orsd_jax.envs import EnvPool

class Stopped(Exception):
    pass

def stop(signum, frame):
    raise Stopped

spawn, workers = multiprocessing.util.spawnv_passfds, []

def spawn_then_signal(path, args, fds):
    pid = spawn(path, args, fds)
    if "--multiprocessing-fork" in args:  # a worker, not multiprocessing's resource tracker
        workers.append(pid)
        if len(workers) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    return pid

signal.signal(signal.SIGTERM, stop)
multiprocessing.util.spawnv_passfds = spawn_then_signal
try:
    EnvPool(PidEnv, 2, n_workers=2)
except Stopped:
    print(*workers)
"""


def test_a_signal_while_the_workers_start_stops_them_without_a_traceback():
    """The signal's handler runs once every worker has its start data; the pool then ends them.
    Raised between a worker's spawn and the write of its data, it made the worker die on an
    EOFError traceback of its own on the run's stderr (seen in CI with SIGTERM to a starting run)."""
    import pathlib
    import subprocess
    import sys

    import psutil

    tests = pathlib.Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", _SIGNALLED_START, str(tests)],
        cwd=tests.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    workers = [int(pid) for pid in done.stdout.split()]
    assert len(workers) == 2
    for pid in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


_ENTRY = """
import pathlib, sys
sys.path.insert(0, {tests!r})
with open({marker!r}, "a") as f:  # one line per import of this module, by its name there
    print(__name__, file=f)
from orsd_jax.envs import EnvPool, Task
from test_env_pool import PidEnv

class MainEnv(PidEnv):
    pass

if __name__ == "__main__":
    with EnvPool({factory}, 2, n_workers=2) as pool:
        print(len(pool.reset([Task("test", "0", "none", "nothing")] * 2)))
"""


@pytest.mark.parametrize("how", ["-m", "path"])
@pytest.mark.parametrize("factory", ["PidEnv", "MainEnv"])
def test_workers_import_the_entry_module_only_for_a_factory_defined_there(tmp_path, how, factory):
    """A run's entry module (``python -m experiments.train_alfworld``) imports JAX; spawn would import it
    again in every worker. It does not, unless the environment's factory is defined there."""
    import pathlib
    import subprocess
    import sys

    tests, marker = pathlib.Path(__file__).parent, tmp_path / "imports.txt"
    (tmp_path / "entry.py").write_text(_ENTRY.format(tests=str(tests), marker=str(marker), factory=factory))
    argv = ["-m", "entry"] if how == "-m" else [str(tmp_path / "entry.py")]
    done = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["2"], done.stderr[-3000:]
    expected = ["__main__"] + (["__mp_main__"] * 2 if factory == "MainEnv" else [])
    assert marker.read_text().split() == expected
