"""Several JAX processes (JAX's multi-controller runtime, ``jax.distributed``).

Every process holds its own devices' share of one mesh and runs the same train step on it: each
builds the whole minibatch from the same step samples and hands in the rows of its devices
(``to_global``); XLA's collectives (gloo between CPU processes, NCCL between GPUs) sum the
gradients. Process 0 (``is_main``) alone plays the episodes, runs the rubric stage, pushes weights
to the sampler and writes the run's files; Orbax saves and restores with every process.

What process 0 alone computes reaches the others through the coordinator's key-value store
(``from_main``), not a collective: the others wait there while process 0 plays an update's
episodes or evaluates, which can take longer than a collective's timeout. Values travel as JSON
(no pickle: whoever can reach the coordinator's port could write a key). One process: every
function here is the identity or a no-op.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")

# How long the other processes wait for process 0 between collective stages: an update's
# rollouts and rubric stage, or an evaluation (the paper presets: tens of minutes on GPUs).
WAIT_S = 24 * 3600


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process sits among the run's processes. Unset fields come from
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, and from SLURM or
    Open MPI through JAX's cluster detection (``detect``)."""

    coordinator: str | None = None  # host:port of process 0's coordinator
    processes: int | None = None
    process_id: int | None = None
    detect: bool = False  # let JAX read the cluster's environment (SLURM, Open MPI) for what is unset

    @classmethod
    def from_environment(cls, **given: Any) -> Launch:
        env = os.environ
        number = lambda name: int(env[name]) if name in env else None  # noqa: E731
        defaults = dict(
            coordinator=env.get("JAX_COORDINATOR_ADDRESS"),
            processes=number("JAX_NUM_PROCESSES"),
            process_id=number("JAX_PROCESS_ID"),
        )
        return cls(**(defaults | {k: v for k, v in given.items() if v is not None}))

    @property
    def wanted(self) -> bool:
        return self.detect or self.coordinator is not None or (self.processes or 1) > 1


def initialize(launch: Launch) -> None:
    """Joins the run's processes (before anything else touches JAX); nothing for a single process."""
    if not launch.wanted:
        return
    jax.distributed.initialize(
        launch.coordinator,
        launch.processes,
        launch.process_id,
        cluster_detection_method=None if launch.detect else "deactivate",
    )


def multi() -> bool:
    return jax.process_count() > 1


def is_main() -> bool:
    return jax.process_index() == 0


def _client():
    # The coordinator's key-value store has no public API; Orbax reads the same global state.
    from jax._src import distributed

    return distributed.global_state.client


def from_main(name: str, value: T | None, encode: Callable[[T], Any], decode: Callable[[Any], T]) -> T:
    """``value`` on process 0, published under ``name``; the other processes wait for it (up to
    ``WAIT_S``) and get ``decode(encode(value))``. ``encode`` makes it JSON; ``name`` is used once."""
    if not multi():
        assert value is not None
        return value
    if is_main():
        assert value is not None
        _client().key_value_set_bytes(f"orsd/{name}", json.dumps(encode(value)).encode())
        return value
    return decode(json.loads(_client().blocking_key_value_get_bytes(f"orsd/{name}", WAIT_S * 1000)))


def main_first(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` in process 0, then in the others once it has returned: for work that fills a shared
    cache (generated games, the warm start), which the others then read."""
    if not multi():
        return fn()
    if is_main():
        result = fn()
        from_main(name, True, bool, bool)
        return result
    from_main(name, None, bool, bool)
    return fn()


def wait_for_main(name: str) -> None:
    """Holds the other processes until process 0 reaches this point (before a collective stage
    that follows its own long work, so that they wait here rather than in a collective)."""
    if multi():
        from_main(name, True if is_main() else None, bool, bool)


def to_global(tree: T, sharding: jax.sharding.Sharding) -> T:
    """Host arrays (the same on every process) as global arrays of ``sharding``: each process
    places the parts its own devices hold. One process: unchanged (``jit`` places numpy itself)."""
    if not multi():
        return tree
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda at: np.asarray(x)[at]), tree
    )


def local(tree: T) -> T:
    """Global arrays as arrays of this process: a replicated one as its copy on a local device,
    a sharded one gathered (a collective: every process calls this at the same point)."""
    if not multi():
        return tree
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return jax.device_put(multihost_utils.process_allgather(x, tiled=True), jax.local_devices()[0])

    return jax.tree.map(one, tree)
