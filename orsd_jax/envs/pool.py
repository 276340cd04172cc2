"""Many environments stepped concurrently in worker processes.

ALFWorld resets cost 0.3-0.5 s of PDDL grounding and steps are pure Python, so a group of
``n_tasks x G`` environments runs in a few processes, each holding a slice of them. Workers are
started with ``spawn`` (the trainer process runs JAX threads, which ``fork`` would copy badly).
A worker that dies, raises or does not answer within ``timeout`` seconds (it is then killed)
surfaces as ``EnvWorkerError`` naming the worker and the cause, after every other worker's
reply to the same call has been read, so no later call receives a stale one
(``tests/test_env_pool.py``). ``close()`` (also run at interpreter exit) ends every worker.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from orsd_jax.envs.base import EnvStep, Task, TextEnv


class EnvWorkerError(RuntimeError):
    pass


def _worker(conn, make_env: Callable[[], TextEnv], n_local: int) -> None:
    # Ctrl-C reaches the whole terminal group: the owner decides what stops, then closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(conn, make_env, n_local)
    except (BrokenPipeError, ConnectionResetError):  # the owner is gone (killed): nothing to answer
        pass


def _serve(conn, make_env: Callable[[], TextEnv], n_local: int) -> None:
    try:
        envs = [make_env() for _ in range(n_local)]
    except BaseException:  # report the failure to build instead of dying silently
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            break
        if cmd == "close":
            break
        try:
            if cmd == "reset":
                out = [envs[i].reset(task) for i, task in payload]
            else:  # step
                out = [envs[i].step(action) for i, action in payload]
            conn.send(("ok", out))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    for env in envs:
        env.close()
    conn.close()


@contextlib.contextmanager
def _stop_signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT received inside run their handlers on leaving. A handler that raises
    between a worker's spawn and the write of its start data to the pipe leaves the worker to die
    on an EOFError traceback on the run's stderr (``tests/test_env_pool.py``). Only the main thread
    owns signal handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    previous = {s: h for s, h in handlers.items() if h is not None}  # None: a handler set outside Python stays
    for s in previous:
        signal.signal(s, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in pending:
            signal.raise_signal(signum)


@contextlib.contextmanager
def main_module_not_reimported() -> Iterator[None]:
    """Processes spawned inside do not import the parent's ``__main__`` module again. ``spawn``
    re-imports it (as ``__mp_main__``) so that functions defined there unpickle in the child; our
    workers run orsd_jax's functions only, while an entry module such as
    ``experiments.train_alfworld`` imports JAX and Flax: 4.8 s of an ALFWorld worker's 10 s start
    (py-spy of a ``tiny`` run at ``e0c019a``, the 2-core Intel Xeon), paid by every worker of every run
    (``tests/test_env_pool.py`` checks the child does not import it). Only the start reads these
    attributes; they are restored on leaving."""
    main = sys.modules["__main__"]
    saved: dict[str, object] = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None  # with no spec and no file, spawn's preparation names no main module
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class EnvPool:
    """``n_envs`` copies of one environment spread over ``n_workers`` processes.

    ``reset(tasks)`` takes one task per environment; ``step(actions)`` one action per
    environment, where None skips that environment (finished episodes) and returns None for it.
    ``reset_one(i, task)`` and ``step_one(i, action)`` reset or step environment ``i`` alone and may
    be called from several threads at once (asynchronous episodes): calls reaching one worker take
    turns on its pipe, so each reads its own reply.
    """

    def __init__(
        self, make_env: Callable[[], TextEnv], n_envs: int, n_workers: int | None = None, timeout: float = 300.0
    ):
        # ``timeout``: seconds a worker may take for one call (its build included). ALFWorld
        # resets take 0.5 s and WebShop searches under 1 s; a hung game engine would otherwise
        # block training forever.
        if n_envs < 1:
            raise ValueError(f"n_envs must be at least 1, got {n_envs}")
        n_workers = max(1, min(n_envs, n_workers or os.cpu_count() or 1))
        ctx = mp.get_context("spawn")
        # Environment i lives in worker i % n_workers at local index i // n_workers.
        self._owner = [(i % n_workers, i // n_workers) for i in range(n_envs)]
        self.n_envs = n_envs
        self.timeout = timeout
        self._conns, self._procs = [], []
        self._locks = [threading.Lock() for _ in range(n_workers)]  # one call at a time on a pipe
        atexit.register(self.close)
        try:
            # A factory defined in the script run as __main__ unpickles only where that script is imported.
            from_main = getattr(getattr(make_env, "func", make_env), "__module__", None) == "__main__"
            hidden = contextlib.nullcontext() if from_main else main_module_not_reimported()
            with _stop_signals_deferred(), hidden:
                for w in range(n_workers):
                    parent, child = ctx.Pipe()
                    n_local = sum(1 for owner, _ in self._owner if owner == w)
                    proc = ctx.Process(target=_worker, args=(child, make_env, n_local), daemon=True)
                    proc.start()
                    child.close()
                    self._conns.append(parent)
                    self._procs.append(proc)
            self._gather(range(n_workers))
        except BaseException:  # a failed worker, or a stop signal's exception
            self.close()
            raise

    def _receive(self, w: int) -> Any:
        """Worker ``w``'s reply, or the ``EnvWorkerError`` that replaces it (returned, not raised)."""
        conn, proc = self._conns[w], self._procs[w]
        try:
            if not conn.poll(self.timeout):
                proc.kill()
                proc.join(timeout=5)
                return EnvWorkerError(
                    f"environment worker {w} (pid {proc.pid}) did not answer within {self.timeout:g} s and was killed"
                )
            status, payload = conn.recv()
        except (EOFError, OSError, ConnectionError) as err:
            proc.join(timeout=1)
            error = EnvWorkerError(f"environment worker {w} (pid {proc.pid}) died, exit code {proc.exitcode}")
            error.__cause__ = err
            return error
        if status == "error":
            return EnvWorkerError(f"environment worker {w} (pid {proc.pid}) failed:\n{payload}")
        return payload

    def _gather(self, workers, failures: Sequence[EnvWorkerError] = ()) -> dict[int, Any]:
        """Every listed worker's reply; the first failure is raised once all replies are read."""
        replies = {w: self._receive(w) for w in workers}
        failures = [*failures, *(r for r in replies.values() if isinstance(r, EnvWorkerError))]
        if failures:
            raise failures[0]
        return replies

    def _scatter(self, cmd: str, items: Sequence[Any]) -> list[Any]:
        if len(items) != self.n_envs:
            raise ValueError(f"{cmd} needs {self.n_envs} entries, got {len(items)}")
        per_worker: dict[int, list[tuple[int, int, Any]]] = {}
        for i, item in enumerate(items):
            if item is not None:
                w, local = self._owner[i]
                per_worker.setdefault(w, []).append((i, local, item))
        sent, failures = [], []
        for w, jobs in per_worker.items():
            try:
                self._conns[w].send((cmd, [(local, item) for _, local, item in jobs]))
                sent.append(w)
            except (BrokenPipeError, OSError) as err:
                failures.append(EnvWorkerError(f"environment worker {w} is gone: {err}"))
        replies = self._gather(sent, failures)
        out: list[Any] = [None] * self.n_envs
        for w, jobs in per_worker.items():
            for (i, _, _), result in zip(jobs, replies[w]):
                out[i] = result
        return out

    def reset(self, tasks: Sequence[Task]) -> list[EnvStep]:
        with contextlib.ExitStack() as every_pipe:
            for lock in self._locks:
                every_pipe.enter_context(lock)
            return self._scatter("reset", list(tasks))

    def step(self, actions: Sequence[str | None]) -> list[EnvStep | None]:
        with contextlib.ExitStack() as every_pipe:
            for lock in self._locks:
                every_pipe.enter_context(lock)
            return self._scatter("step", list(actions))

    def reset_one(self, i: int, task: Task) -> EnvStep:
        return self._one("reset", i, task)

    def step_one(self, i: int, action: str) -> EnvStep:
        return self._one("step", i, action)

    def _one(self, cmd: str, i: int, item: Any) -> EnvStep:
        w, local = self._owner[i]
        with self._locks[w]:
            try:
                self._conns[w].send((cmd, [(local, item)]))
            except (BrokenPipeError, OSError) as err:
                raise EnvWorkerError(f"environment worker {w} is gone: {err}") from err
            reply = self._receive(w)
        if isinstance(reply, EnvWorkerError):
            raise reply
        return reply[0]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        atexit.unregister(self.close)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
