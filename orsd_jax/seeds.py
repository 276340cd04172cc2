"""The random streams of a run, each named by a path of integers below the run's seed.

numpy's ``SeedSequence`` hashes the whole path, so streams whose paths differ anywhere are
independent; sums and products of integers are not (``seed * 1000 + turn`` gives seed 1's turn 0
the value of seed 0's turn 1000). Stream names are fixed integers: runs replay them on resume.
"""

from __future__ import annotations

import numpy as np

ROLLOUT, RUBRICS, SELECTION, MINIBATCHES, EVALUATION = range(5)


def derive(*path: int) -> int:
    """A seed in ``[0, 2**31)`` for the stream ``path``, e.g. ``derive(seed, ROLLOUT, update)``
    (31 bits: every sampler and JAX key takes it)."""
    return int(np.random.SeedSequence(list(path)).generate_state(1)[0] >> 1)


def rng(*path: int) -> np.random.Generator:
    """A numpy generator for the stream ``path``."""
    return np.random.default_rng(np.random.SeedSequence(list(path)))
