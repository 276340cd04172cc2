"""An update's training stage: its step samples in minibatches, in the replay's batch layout,
one optimizer step each; and the trainer-side log-probs that truncated importance sampling needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.typing import ArrayLike

from orsd_jax import distributed
from orsd_jax.batch import Batch, StepSample, build_batch, prompt_groups
from orsd_jax.credit import RecordedMinibatch
from orsd_jax.loss import OrsdLoss
from orsd_jax.metrics_log import progress
from orsd_jax.train_step import TrainState


@dataclasses.dataclass(frozen=True)
class MinibatchSpec:
    """How step samples become optimizer steps (``TrainConfig.minibatch_spec``)."""

    rows: int  # step samples per optimizer step
    layout: str = "two-stream"  # the replay's batch layout (batch.LAYOUTS)
    pack: bool = True  # rows of several samples, as many as they fill
    row_tokens: int = 0  # packed rows at least this long (0: the longest sample)
    row_multiple: int = 1  # packed rows come in multiples of devices x micro-batches
    micro_batches: int = 1
    # Samples of one prompt in a minibatch share its forward (batch.build_batch): the same loss.
    share_prefix: bool = True


@dataclasses.dataclass(frozen=True)
class TrainingPass:
    """What ``train_minibatches`` returns.

    ``metrics``: the loss metrics of the whole update, computed once from the loss sums of every
    minibatch (so the gap statistics are exact over the update, not means of means), with the
    log-prob mismatch of the first step. ``counts``: ``tokens`` (response tokens), ``row_tokens``
    (the tokens the forward passes read, packed rows without their padding), ``row_slots`` (with
    it). ``recorded``: per minibatch of the first pass when asked, the token values its loss used.
    """

    state: TrainState
    metrics: dict[str, float]
    counts: dict[str, float]
    recorded: tuple[RecordedMinibatch, ...]


def minibatch(samples: Sequence[StepSample], spec: MinibatchSpec) -> Batch:
    """The step samples of one optimizer step as a batch: rows of several samples (``spec.pack``;
    as many rows as they fill, a multiple of ``row_multiple``), or one per row (``spec.rows`` rows)."""
    return build_batch(
        samples,
        seq_multiple=128,
        response_multiple=32,
        batch_multiple=spec.row_multiple if spec.pack else spec.rows,
        layout=spec.layout,
        pack=spec.pack,
        row_tokens=spec.row_tokens,
        share_prefix=spec.share_prefix,
    )


def epoch_orders(samples: Sequence[StepSample], epochs: int, rng: np.random.Generator, order: str) -> list[np.ndarray]:
    """The order of the samples in each PPO epoch (``TrainConfig.minibatch_order``): a permutation,
    or (``by-prompt``) the distinct prompts in a random order, each followed by all its samples, so
    that the samples of one prompt share a minibatch and its forward."""
    if order == "shuffled":
        return [rng.permutation(len(samples)) for _ in range(epochs)]
    if order != "by-prompt":
        raise ValueError(f"unknown minibatch order {order!r}; 'shuffled' or 'by-prompt'")
    groups = prompt_groups(samples)
    return [np.asarray([i for g in rng.permutation(len(groups)) for i in groups[g]]) for _ in range(epochs)]


def train_minibatches(
    train_step,
    state: TrainState,
    samples: Sequence[StepSample],
    orders: Sequence[np.ndarray],
    spec: MinibatchSpec,
    record: bool,
    reference=None,
) -> TrainingPass:
    """Optimizer steps over ``samples``, one pass (PPO epoch) per permutation in ``orders``,
    ``spec.rows`` at a time; ``reference``: the KL's frozen parameters."""
    totals: dict[str, float] = {}
    weighted = {"loss": 0.0, "grad_norm": 0.0}  # per-step values, token-weighted
    counts = {"tokens": 0.0, "row_tokens": 0.0, "row_slots": 0.0}
    recorded: list[RecordedMinibatch] = []
    passes = [(epoch, start) for epoch in range(len(orders)) for start in range(0, len(samples), spec.rows)]
    mismatch: dict[str, float] = {}
    for epoch, start in progress(passes, "train"):
        rows = orders[epoch][start : start + spec.rows].tolist()
        batch = minibatch([samples[r] for r in rows], spec)
        read, slots = batch.token_counts()
        counts["row_tokens"] += read
        counts["row_slots"] += slots
        state, step_metrics, values = train_step(state, batch, spec.micro_batches, reference)
        if not mismatch or (record and epoch == 0):
            values = distributed.local(values)  # several processes: a collective, at the same steps in each
        if not mismatch:  # the first step's log-probs are at the rollout's parameters
            sampler = batch.old_logp if batch.sampler_logp is None else batch.sampler_logp
            mismatch = logprob_mismatch(np.asarray(values["logp_without"]), sampler, batch.response_mask)
        if record and epoch == 0:
            at = batch.sample_slots()
            values = {k: np.asarray(v)[at] for k, v in values.items()}
            recorded.append(RecordedMinibatch(tuple(rows), values, np.asarray(batch.response_mask)[at]))
        step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        for k, v in step_metrics.items():
            if k.startswith("sum/"):
                totals[k[4:]] = totals.get(k[4:], 0.0) + v
        for k in weighted:
            weighted[k] += step_metrics[k] * step_metrics["tokens"]
        counts["tokens"] += step_metrics["tokens"]
    tokens = counts["tokens"]
    metrics = {k: float(v) for k, v in OrsdLoss.metrics(totals, tokens).items()} | mismatch
    metrics |= {k: v / max(tokens, 1.0) for k, v in weighted.items()}
    return TrainingPass(state, metrics, counts, tuple(recorded))


def logprob_mismatch(trainer: ArrayLike, sampler: ArrayLike, mask: ArrayLike) -> dict[str, float]:
    """How far the trainer's log-probs ``[B, Y]`` of the response tokens are from the sampler's at
    the same parameters: the mean and max absolute difference, and the mean ratio p_trainer /
    p_sampler (1 when they agree; the PPO ratio's value before any update)."""
    real = np.asarray(mask) > 0
    diff = (np.asarray(trainer) - np.asarray(sampler))[real]
    return {
        "logprob_mismatch_mean": float(np.mean(np.abs(diff))),
        "logprob_mismatch_max": float(np.max(np.abs(diff))),
        "sampler_ratio_mean": float(np.mean(np.exp(diff))),
    }


def with_trainer_logprobs(
    forward: Callable, params, samples: Sequence[StepSample], spec: MinibatchSpec
) -> list[StepSample]:
    """Truncated importance sampling's two sides: the samples with the trainer's own log-probs at
    ``params`` (the rollout's) as ``old_logprobs`` and the sampler's as ``sampler_logprobs``.
    ``forward(params, batch) -> [B, Y]``: the without-rubric log-probs (one forward, no gradient)."""
    out = []
    for start in range(0, len(samples), spec.rows):
        chunk = samples[start : start + spec.rows]
        batch = minibatch([dataclasses.replace(s, insert=()) for s in chunk], spec)
        logp = np.asarray(distributed.local(forward(params, batch)))[batch.sample_slots()]
        out += [
            dataclasses.replace(s, old_logprobs=logp[i, : len(s.response)].tolist(), sampler_logprobs=s.old_logprobs)
            for i, s in enumerate(chunk)
        ]
    return out
