"""Per-token credit: the values the ORSD loss computes for every response token.

``token_values`` evaluates, for a packed batch at given parameters, exactly the intermediate
quantities of ``OrsdLoss`` (same function calls): log-probs with and without the rubric, their
gap, the step sample's advantage and the corrected token advantage. The trainer records them
for the minibatches of an update, computed at the parameters that minibatch's loss used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax.advantages import orsd_token_advantages
from orsd_jax.batch import Batch
from orsd_jax.loss import LossConfig, response_logprobs


@functools.partial(jax.jit, static_argnums=(0, 3))
def _values(graphdef, params, batch: Batch, config: LossConfig) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, params)
    logp_with, logp, _ = response_logprobs(model, batch, temperature=config.temperature, chunk_size=config.chunk_size)
    rubric = batch.response_mask * batch.has_rubric[:, None]
    logp_with = jnp.where(rubric > 0, logp_with, logp)  # as policy_loss: no rubric, no gap
    gap = logp_with - logp
    return {
        "logp_with": logp_with,
        "logp_without": logp,
        "gap": gap,
        "advantage": jnp.broadcast_to(batch.advantage[:, None], logp.shape),
        "corrected": orsd_token_advantages(batch.advantage, logp_with, logp, batch.response_mask, config.coef, config.clip),
        "gap_clipped": (jnp.abs(gap) > config.clip) & (rubric > 0),
    }


def token_values(graphdef, params, batch: Batch, config: LossConfig) -> dict[str, np.ndarray]:
    """``[B, Y]`` arrays: logp_with, logp_without, gap, advantage, corrected, gap_clipped."""
    return {k: np.asarray(v) for k, v in _values(graphdef, params, batch, config).items()}
