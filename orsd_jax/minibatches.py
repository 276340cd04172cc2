"""An update's training stage: its step samples in minibatches, in the replay's batch layout,
one optimizer step each; and the trainer-side log-probs that truncated importance sampling needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.typing import ArrayLike

from orsd_jax import distributed
from orsd_jax.batch import Batch, BatchShape, RowPlan, StepSample, build_batch, plan_rows, prompt_groups
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
    seq_multiple: int = 128  # rows are padded to this many tokens (fewer compiled shapes)
    # The packed order weighs a row of t tokens reading s keys as t (1 + s / attention_tokens)
    # (estimate.attention_tokens, from the model; 0: as t, its slots alone).
    attention_tokens: float = 0.0
    # A row's prompts are one tree, a common beginning computed once (batch.build_batch): the same loss.
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


RESPONSE_MULTIPLE = 32  # responses are padded to this many tokens (fewer compiled shapes)
ORDERS = ("shuffled", "by-prompt", "packed")  # TrainConfig.minibatch_order


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step of an update: its samples (indices into the update's), and for the
    ``packed`` order the samples of each row (positions in ``samples``) and the batch shape that
    every step of the epoch shares."""

    epoch: int
    samples: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...] | None = None
    shape: BatchShape | None = None


def minibatch(samples: Sequence[StepSample], spec: MinibatchSpec, step: Step | None = None) -> Batch:
    """The step samples of one optimizer step as a batch: rows of several samples (``spec.pack``;
    as many rows as they fill, a multiple of ``row_multiple``), or one per row (``spec.rows`` rows);
    with a ``packed`` order's ``step``, its rows in its shape (``samples``: the step's)."""
    return build_batch(
        samples,
        seq_multiple=spec.seq_multiple,
        response_multiple=RESPONSE_MULTIPLE,
        batch_multiple=spec.row_multiple if spec.pack else spec.rows,
        layout=spec.layout,
        pack=spec.pack,
        row_tokens=spec.row_tokens,
        share_prefix=spec.share_prefix,
        rows=None if step is None else step.rows,
        shape=None if step is None else step.shape,
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


def update_steps(
    samples: Sequence[StepSample], epochs: int, rng: np.random.Generator, order: str, spec: MinibatchSpec
) -> list[Step]:
    """The update's optimizer steps, epoch after epoch, ``ceil(N / spec.rows)`` an epoch: the
    samples in ``epoch_orders``' order, ``spec.rows`` a step; or (``packed``, ``packed_steps``) the
    update's rows packed once and dealt out, so that every step of an epoch has one shape."""
    if order not in ORDERS:
        raise ValueError(f"unknown minibatch order {order!r}; one of {ORDERS}")
    if order == "packed":
        return [step for epoch in range(epochs) for step in packed_steps(samples, epoch, rng, spec)]
    return [
        Step(epoch, tuple(int(i) for i in perm[start : start + spec.rows]))
        for epoch, perm in enumerate(epoch_orders(samples, epochs, rng, order))
        for start in range(0, len(samples), spec.rows)
    ]


def packed_steps(
    samples: Sequence[StepSample], epoch: int, rng: np.random.Generator, spec: MinibatchSpec
) -> list[Step]:
    """One epoch of the ``packed`` order: all its samples packed into rows at once (``plan_rows``:
    with ``share_prefix`` a row's prompts one tree, one task's prompts together; first fit over the
    whole update fills rows better, and shares more, than over a minibatch), the rows shuffled and
    dealt into ``ceil(N / spec.rows)`` steps, the rows with a with-rubric stream and those without
    each as evenly as they go, so that every step has about as many of each. Every step is padded
    to the one ``BatchShape``: the epoch's train steps compile once. The row length is the one of
    ``row_lengths`` whose plan costs least: the fewest padded slots, weighed by the keys each reads
    (``MinibatchSpec.attention_tokens``; a row of twice the longest segment can hold two of the
    common shorter ones, but its attention reads twice the keys)."""
    if not spec.pack:
        raise ValueError("the packed order packs rows: it needs MinibatchSpec.pack")
    perm = rng.permutation(len(samples))  # first fit breaks ties between equal lengths in this order
    shuffled = [samples[i] for i in perm]
    steps = -(-len(samples) // spec.rows)

    def deal(plan: RowPlan) -> list[tuple[list[int], list[int]]]:
        """Per step, its rows with a stream and its rows without (indices into ``plan.rows``)."""
        n = min(steps, len(plan.rows))
        streams = np.array_split(np.arange(plan.stream_rows), n)
        others = np.array_split(np.arange(plan.stream_rows, len(plan.rows)), n)[::-1]  # evens the row counts
        return [(a.tolist(), b.tolist()) for a, b in zip(streams, others)]

    def row(tokens: int, keys: int) -> float:
        return tokens * (1 + keys / spec.attention_tokens) if spec.attention_tokens else tokens

    def cost(plan: RowPlan) -> tuple[float, int]:
        dealt = deal(plan)
        rows = _round_up(max(len(a) + len(b) for a, b in dealt), spec.row_multiple)
        stream_rows = _round_up(max(len(a) for a, _ in dealt), spec.row_multiple)
        t, u = plan.tokens, plan.stream
        return len(dealt) * (rows * row(t, t) + stream_rows * row(u, t + u)), t

    def plan(row_tokens: int) -> RowPlan:
        return plan_rows(
            shuffled,
            layout=spec.layout,
            pack=True,
            share_prefix=spec.share_prefix,
            seq_multiple=spec.seq_multiple,
            row_tokens=row_tokens,
        )

    # From the shortest rows that hold every segment (planned again at that floor: its stream is
    # at least half a row, as every candidate's).
    chosen = min((plan(t) for t in row_lengths(plan(spec.row_tokens).tokens, spec.seq_multiple)), key=cost)
    rows = [[int(perm[i]) for i in row] for row in chosen.rows]
    # Shuffled within each kind (the dealing keeps the kinds' rows apart): which rows share a step.
    order = np.concatenate(
        [rng.permutation(chosen.stream_rows), chosen.stream_rows + rng.permutation(len(rows) - chosen.stream_rows)]
    )
    rows = [rows[r] for r in order]
    kinds = deal(chosen)
    dealt = [a + b for a, b in kinds]
    slots, response = max(len(row) for row in rows), _round_up(max(len(s.response) for s in samples), RESPONSE_MULTIPLE)
    head = max(sum(len(samples[i].response) for i in row) for row in rows)
    shape = BatchShape(
        rows=_round_up(max(len(d) for d in dealt), spec.row_multiple),
        tokens=chosen.tokens,
        stream=chosen.stream,
        stream_rows=_round_up(max(len(a) for a, _ in kinds), spec.row_multiple),
        slots=slots,
        response=response,
        head=min(slots * response, _round_up(head, RESPONSE_MULTIPLE)),
    )
    out = []
    for d in dealt:
        members = [rows[r] for r in d]
        starts = np.cumsum([0, *(len(m) for m in members)])
        at = tuple(tuple(range(a, e)) for a, e in zip(starts[:-1].tolist(), starts[1:].tolist()))
        out.append(Step(epoch, tuple(i for m in members for i in m), at, shape))
    return out


def row_lengths(shortest: int, multiple: int) -> range:
    """The row lengths ``packed_steps`` weighs: from the shortest that holds every segment up to
    twice it, in steps of ``multiple``."""
    return range(shortest, 2 * shortest + 1, multiple)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def train_minibatches(
    train_step,
    state: TrainState,
    samples: Sequence[StepSample],
    steps: Sequence[Step],
    spec: MinibatchSpec,
    record: bool,
    reference=None,
) -> TrainingPass:
    """The optimizer ``steps`` (``update_steps``) over ``samples``; ``record``: keep the per-token
    values of the first epoch's; ``reference``: the KL's frozen parameters."""
    totals: dict[str, float] = {}
    weighted = {"loss": 0.0, "grad_norm": 0.0}  # per-step values, token-weighted
    counts = {"tokens": 0.0, "row_tokens": 0.0, "row_slots": 0.0}
    recorded: list[RecordedMinibatch] = []
    mismatch: dict[str, float] = {}
    for step in progress(steps, "train"):
        rows, epoch = list(step.samples), step.epoch
        batch = minibatch([samples[r] for r in rows], spec, step)
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
