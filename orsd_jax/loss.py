"""The ORSD policy loss: one forward over the packed batch, token-corrected advantages, PPO-clip.

``OrsdLoss(config)(model, batch) -> (loss_sum, token_count, metric_sums)``. Sums, not means, so
micro-batches and devices combine exactly: the train step adds sums and divides by the total
token count once (token-mean aggregation over the whole batch).

Per response token ``j`` of step sample ``i`` (``l+``/``l-``: log-probs with/without the rubric,
``l_old``: the sampler's):

    Ahat   = A_i + coef * clip(sg(l+ - l-), -clip, clip)       (no correction for samples without a rubric)
    r      = exp(l- - l_old)
    pg     = max(-Ahat r, -Ahat clip(r, 1 - clip_low, 1 + clip_high)), and min(pg, -Ahat dual_clip) if Ahat < 0
    loss   = w pg + kl_coef * k3(l_ref, l-) - entropy_coef * H

with ``w = min(exp(l_old - l_sampler), tis_cap)`` under truncated importance sampling (``l_old``
then the trainer's log-probs at the rollout's parameters), else 1.

``l+`` comes from the same forward as ``l-`` (the packed layout of ``orsd_jax.batch``) or from
the two-stream replay that reuses its prefix's keys and values, and is under stop-gradient.
``l_ref`` is a frozen reference policy's (the initial policy, verl-agent's
``use_kl_loss``): ``batch.ref_logp`` when the batch carries it, else computed in the same step
from the reference model the train step hands the loss.

Shapes are named as in ``orsd_jax.batch`` (R rows of T tokens, U the with-rubric stream's, B
sample slots of Y response tokens, D hidden); the annotations are not checked at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Float, Float32, Int, Shaped

from orsd_jax.advantages import orsd_token_advantages
from orsd_jax.batch import Batch, attention_mask, rubric_attention_mask
from orsd_jax.models import CausalLM
from orsd_jax.models.decoder import KVCache


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Defaults: verl-agent's PPO settings (clip 0.2/0.2, dual clip 3, entropy 0.001) and ORSD's
    correction at ``coef = 0.5, clip = 1``: one token's correction moves a trajectory advantage by
    at most 0.5. With std-normalised groups of eight (ddof 1), that flips the sign of tokens the
    rubric reader strongly prefers in failed trajectories when one trajectory succeeds (A = -0.35)
    but not the success's (A = +2.47); when seven succeed the roles swap (each success +0.35, the
    failure -2.47), and the correction can flip a success's tokens (the probe's ``sign_flips``
    counts such tokens). A log-ratio of 1 (a factor e) is where the gap saturates, so single
    tokens with extreme gaps cannot dominate."""

    coef: float = 0.5  # lambda: weight of the rubric correction (0: plain GRPO/GiGPO)
    clip: float = 1.0  # c: the log-likelihood gap is clipped to [-c, c]
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0  # bounds the loss of negative-advantage tokens; None: off
    kl_coef: float = 0.0  # k3 KL to the reference policy (verl-agent: 0.01; the paper presets use it)
    entropy_coef: float = 0.001
    # Truncated importance sampling: with the trainer's own log-probs at the rollout's parameters as
    # ``old_logp``, each token's policy-gradient term is weighted by min(p_trainer / p_sampler, cap),
    # correcting for the sampler's different kernels (verl's ``tis_imp_ratio_cap``; None: off).
    tis_cap: float | None = None
    temperature: float = 1.0  # the sampler's: logits are divided by it
    chunk_size: int = 64  # response positions per LM-head chunk


def response_logprobs(
    model: CausalLM, batch: Batch, *, temperature: float = 1.0, chunk_size: int = 64, with_rubric: bool = True
) -> tuple[Float32[jax.Array, "B Y"] | None, Float32[jax.Array, "B Y"], Float32[jax.Array, "B Y"]]:
    """``(logp_with, logp_without, entropy_without)`` from the batch in either layout of
    ``orsd_jax.batch``: one forward over packed rows, or the two-stream replay.

    ``logp_with`` is under stop-gradient (for samples without a rubric it is meaningless: the loss
    uses ``logp_without`` there), and ``None`` when ``with_rubric`` is off (the with-rubric LM head,
    and in the two-stream layout the whole with-rubric stream, are then skipped).
    """
    mask = attention_mask(batch.reach)
    keys_values = batch.two_stream and with_rubric
    hidden, prefix = model.hidden_states(
        batch.tokens, batch.positions, mask=mask, frozen=batch.frozen, keys_values=keys_values
    )
    options = dict(temperature=temperature, chunk_size=chunk_size)
    logp_without, entropy = slot_logprobs(
        model, hidden, batch.without_index, batch.response, batch.head, with_entropy=True, **options
    )
    assert entropy is not None  # with_entropy
    if not with_rubric:
        return None, logp_without, entropy
    if keys_values:
        # The with-rubric stream reads its prefix's keys and values from a cache holding the row's
        # in slots [0, T) and its own in [T, T + U), with the policy's parameters under
        # stop-gradient: no backward pass over it.
        model = without_gradient(model)
        assert batch.rubric_tokens is not None and prefix is not None  # two_stream, and keys_values was asked
        (rows, u), t = batch.rubric_tokens.shape, batch.tokens.shape[1]
        # The stream's S rows are the batch's first: their keys and values, [L, S, T + U, K, H].
        cache = KVCache(*(jnp.pad(x[:, :rows], ((0, 0), (0, 0), (0, u), (0, 0), (0, 0))) for x in prefix))
        slots = jnp.broadcast_to(t + jnp.arange(u, dtype=jnp.int32), batch.rubric_tokens.shape)
        hidden, _ = model.hidden_states(
            batch.rubric_tokens, batch.rubric_positions, mask=rubric_attention_mask(batch), cache=cache, slots=slots
        )
        # The slots of the other rows have no rubric: the loss reads their log-probs without it.
        b, n = batch.response.shape[0], batch.response.shape[0] // batch.tokens.shape[0] * rows
        first = lambda x: x[:n]  # noqa: E731
        logp_with, _ = slot_logprobs(
            model, hidden, first(batch.with_index), first(batch.response), batch.head[:rows], **options
        )
        return jax.lax.stop_gradient(jnp.pad(logp_with, ((0, b - n), (0, 0)))), logp_without, entropy
    logp_with, _ = slot_logprobs(model, hidden, batch.with_index, batch.response, batch.head, **options)
    return jax.lax.stop_gradient(logp_with), logp_without, entropy


def slot_logprobs(
    model: CausalLM,
    hidden: Float[jax.Array, "R T D"],
    index: Int[np.ndarray | jax.Array, "B Y"],
    targets: Int[np.ndarray | jax.Array, "B Y"],
    head: Int[np.ndarray | jax.Array, "R M"] | None = None,
    **options,
) -> tuple[Float32[jax.Array, "B Y"], Float32[jax.Array, "B Y"] | None]:
    """``logprobs_at`` for sample slots over rows, ``B = R x k`` row-major (``orsd_jax.batch``);
    ``T`` is the length of the stream read (``U`` for the with-rubric stream's rows). ``head``
    (``Batch.head``): the LM head scores only these of each row's ``k x Y`` slot tokens, and the
    others are 0; None: all of them."""
    (r, b), y = (hidden.shape[0], index.shape[0]), index.shape[1]
    index, targets = index.reshape(r, b // r * y), targets.reshape(r, b // r * y)
    if head is None:
        logp, entropy = logprobs_at(model, hidden, index, targets, **options)
        return logp.reshape(b, y), None if entropy is None else entropy.reshape(b, y)
    # Index k x Y is no slot: a zero column scored and dropped (benchmarks/pack_rows.py: empty slots
    # of rows of several samples cost the LM head otherwise).
    pick = lambda x: jnp.take_along_axis(jnp.pad(x, ((0, 0), (0, 1))), head, axis=1)  # noqa: E731
    logp, entropy = logprobs_at(model, hidden, pick(index), pick(targets), **options)
    rows = jnp.arange(r)[:, None]
    place = lambda x: jnp.zeros((r, b // r * y + 1), x.dtype).at[rows, head].set(x)[:, :-1].reshape(b, y)  # noqa: E731
    return place(logp), None if entropy is None else place(entropy)


def without_gradient(model: CausalLM) -> CausalLM:
    """``model`` on stop-gradient parameters: a forward through it keeps nothing for a backward."""
    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, jax.lax.stop_gradient(params))


def logprobs_at(
    model: CausalLM,
    hidden: Float[jax.Array, "R T D"],
    index: Int[np.ndarray | jax.Array, "R M"],
    targets: Int[np.ndarray | jax.Array, "R M"],
    *,
    temperature: float = 1.0,
    chunk_size: int = 64,
    with_entropy: bool = False,
) -> tuple[Float32[jax.Array, "R M"], Float32[jax.Array, "R M"] | None]:
    """Log-probs (and entropies) of ``targets`` predicted by the packed rows' positions ``index``
    (``M`` of them per row) of ``hidden``: the LM head runs at those positions only."""
    h = jnp.take_along_axis(hidden, index[..., None], axis=1)
    return model.logprobs_from_hidden(
        h, targets, chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy
    )


# ``(loss_sum, token_count, metric_sums, token_values)``: scalar sums, and per-token values (float, or
# bool for ``gap_clipped``).
LossOutput = tuple[
    Float32[jax.Array, ""],
    Float32[jax.Array, ""],
    dict[str, Float32[jax.Array, ""]],
    dict[str, Shaped[jax.Array, "B Y"]],
]


def _k3(log_ratio: jax.Array) -> jax.Array:
    """``e^x - x - 1`` for ``x = log q/p`` on samples of p: the non-negative, low-variance KL(p || q) estimate."""
    return jnp.exp(log_ratio) - log_ratio - 1


def policy_loss(
    logp: Float32[jax.Array, "B Y"],
    entropy: Float32[jax.Array, "B Y"],
    logp_with: Float32[jax.Array, "B Y"] | None,
    batch: Batch,
    config: LossConfig,
) -> LossOutput:
    """``(loss_sum, token_count, metric_sums, token_values)`` from the without-rubric
    ``logp``/``entropy`` and the with-rubric ``logp_with`` (``None``: no correction). Only samples
    with ``batch.has_rubric`` are corrected. ``token_values`` are per-token arrays
    (``orsd_jax.credit.VALUES``): log-probs with and without the rubric, their gap, the sample's
    advantage, the corrected token advantage and where the gap was clipped."""
    mask = batch.response_mask
    # The corrected tokens: those of samples with a rubric, when with-rubric log-probs are given.
    rubric = mask * batch.has_rubric[:, None] * (logp_with is not None)
    logp_with = logp if logp_with is None else jnp.where(rubric > 0, logp_with, logp)
    adv = orsd_token_advantages(batch.advantage, logp_with, logp, mask, config.coef, config.clip)
    log_ratio = jnp.clip(logp - batch.old_logp, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1 - config.clip_low, 1 + config.clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    if config.dual_clip is not None:
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, -adv * config.dual_clip), per_token)
    sums: dict[str, jax.Array] = {}
    if config.tis_cap is not None:
        if batch.sampler_logp is None:
            raise ValueError("tis_cap needs the sampler's log-probs beside the trainer's (StepSample.sampler_logprobs)")
        weight = jnp.exp(jnp.clip(batch.old_logp - batch.sampler_logp, -20.0, 20.0))
        sums |= {
            "tis_weight": jnp.sum(jnp.minimum(weight, config.tis_cap) * mask),
            "tis_capped": jnp.sum((weight > config.tis_cap) * mask),
        }
        per_token = per_token * jnp.minimum(weight, config.tis_cap)
    sums |= {
        "clipped": jnp.sum((clipped > unclipped) * mask),
        "approx_kl": jnp.sum(jax.lax.stop_gradient(_k3(log_ratio)) * mask),
        "entropy": jnp.sum(jax.lax.stop_gradient(entropy) * mask),
    }
    if config.kl_coef:
        if batch.ref_logp is None:
            raise ValueError(
                "kl_coef > 0 needs reference log-probs: a reference model (make_train_step("
                "with_reference=True)) or StepSample.ref_logprobs"
            )
        ref_kl = jnp.clip(_k3(jnp.clip(batch.ref_logp - logp, -20.0, 20.0)), -10.0, 10.0)
        per_token = per_token + config.kl_coef * ref_kl
        sums["ref_kl"] = jnp.sum(jax.lax.stop_gradient(ref_kl) * mask)
    if config.entropy_coef:
        per_token = per_token - config.entropy_coef * entropy
    # Gap statistics over the corrected tokens.
    gap = jax.lax.stop_gradient(logp_with - logp) * rubric
    traj_adv = batch.advantage[:, None] * rubric
    sums |= {
        "rubric_tokens": jnp.sum(rubric),
        "gap": jnp.sum(gap),
        "gap_sq": jnp.sum(gap**2),
        "gap_clipped": jnp.sum((jnp.abs(gap) > config.clip) * rubric),
        "adv": jnp.sum(traj_adv),
        "adv_sq": jnp.sum(traj_adv**2),
        "gap_adv": jnp.sum(gap * traj_adv),
    }
    values = {  # per token, for credit maps (``orsd_jax.credit``)
        "logp_with": jax.lax.stop_gradient(logp_with),
        "logp_without": jax.lax.stop_gradient(logp),
        "gap": gap,
        "advantage": jnp.broadcast_to(batch.advantage[:, None], logp.shape),
        "corrected": jax.lax.stop_gradient(adv),
        "gap_clipped": (jnp.abs(gap) > config.clip) & (rubric > 0),
    }
    return jnp.sum(per_token * mask), jnp.sum(mask), sums, values


@dataclasses.dataclass(frozen=True)
class OrsdLoss:
    """The loss the train step differentiates: ``(model, batch) -> (loss_sum, token_count,
    metric_sums, token_values)``."""

    config: LossConfig = LossConfig()

    def __call__(self, model: CausalLM, batch: Batch, reference: CausalLM | None = None) -> LossOutput:
        c = self.config
        logp_with, logp, entropy = response_logprobs(
            model, batch, temperature=c.temperature, chunk_size=c.chunk_size, with_rubric=c.coef != 0
        )
        if c.kl_coef and reference is not None and batch.ref_logp is None:
            # The reference's forward reads the packed rows as the policy's does (its with-rubric
            # branch is computed and ignored); no gradient and no LM head for the other branch.
            _, ref_logp, _ = response_logprobs(
                reference, batch, temperature=c.temperature, chunk_size=c.chunk_size, with_rubric=False
            )
            batch = dataclasses.replace(batch, ref_logp=jax.lax.stop_gradient(ref_logp))
        return policy_loss(logp, entropy, logp_with, batch, c)

    @staticmethod
    def metrics(sums: Mapping[str, ArrayLike], token_count: ArrayLike) -> dict[str, jax.Array]:
        """Means from summed metrics (over every micro-batch and device; host floats or arrays)."""
        arrays = {k: jnp.asarray(v) for k, v in sums.items()}
        n = jnp.maximum(token_count, 1)
        out = {
            "clip_frac": arrays["clipped"] / n,
            "approx_kl": arrays["approx_kl"] / n,
            "entropy": arrays["entropy"] / n,
        }
        for name in ("ref_kl", "tis_weight", "tis_capped"):
            if name in arrays:
                out[name] = arrays[name] / n
        nr = jnp.maximum(arrays["rubric_tokens"], 1)
        gap_mean, adv_mean = arrays["gap"] / nr, arrays["adv"] / nr
        gap_var = jnp.maximum(arrays["gap_sq"] / nr - gap_mean**2, 0.0)
        adv_var = jnp.maximum(arrays["adv_sq"] / nr - adv_mean**2, 0.0)
        cov = arrays["gap_adv"] / nr - gap_mean * adv_mean
        denom = jnp.sqrt(gap_var * adv_var)
        return out | {
            "rubric_token_frac": arrays["rubric_tokens"] / n,
            "gap_mean": gap_mean,
            "gap_std": jnp.sqrt(gap_var),
            "gap_clip_frac": arrays["gap_clipped"] / nr,
            "gap_adv_corr": jnp.where(denom > 0, cov / jnp.where(denom > 0, denom, 1.0), 0.0),
        }
