"""The training batch: step samples packed so one forward scores a response with and without the rubric.

A step sample's prompt is ``prefix + insert + tail`` (``orsd_jax.chat``: ``prefix`` is the chat
head and the user text, ``insert`` the rubric, ``tail`` the end of the user turn and the
assistant header). One packed row holds::

    tokens     prefix   | insert  tail  response | tail  response | padding
    branch     0 ...    | 1 ...                  | 2 ...          | -1 ...
    positions  0 .. P-1 | P .. P+R+S+Y-1         | P .. P+S+Y-1   | 0 ...

The first part is the with-rubric sequence; the second part is the without-rubric branch, which
restarts at position ``len(prefix)`` and attends to the shared prefix (branch 0) and to itself
only. A sample without a rubric is ``[prefix | tail | response]`` alone: its with-rubric
log-probs are its without-rubric ones, so its correction is 0. One row costs
``P + R + 2 (S + Y)`` tokens instead of ``2 P + R + 2 (S + Y)`` for two separate sequences.

The ``two-stream`` layout keeps the two sequences apart and shares the prefix's keys and values
instead of its row::

    tokens          prefix   | tail  response   | padding      (the without-rubric stream)
    rubric_tokens   insert  tail  response      | padding      (the with-rubric stream)
    rubric_positions P .. P+R+S+Y-1             | P+R+S+Y ...

``orsd_jax.loss`` runs the without-rubric stream with gradients, keeping every layer's keys and
values, and the with-rubric stream afterwards under stop-gradient, attending to the prefix's keys
through a cache whose slots are positions: the backward pass never touches the rubric's tokens
and the prefix is computed once (``benchmarks/loss.py`` measures both layouts against two plain
forwards). Its padding tokens sit at the slot after the row's last token, which no real token sees.

Shapes: B rows (step samples, padded to ``batch_multiple``), T packed length (padded to
``seq_multiple``), U the with-rubric stream's length (two-stream only, padded the same), Y
response length (padded to ``response_multiple``). Padding in B, T, U and Y lets the jitted step
compile once per bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

SHARED, WITH, WITHOUT, PAD = 0, 1, 2, -1
LAYOUTS = ("packed", "two-stream")


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One (trajectory, step) pair, as token ids. An empty ``insert`` means the group has no rubric."""

    prefix: Sequence[int]
    tail: Sequence[int]
    response: Sequence[int]
    old_logprobs: Sequence[float]  # the sampler's log-probs of ``response``
    advantage: float  # GRPO trajectory advantage or GiGPO step advantage
    insert: Sequence[int] = ()
    ref_logprobs: Sequence[float] | None = None  # a reference policy's log-probs of ``response``
    # The sampler's log-probs when ``old_logprobs`` are the trainer's own at the rollout's
    # parameters (truncated importance sampling, ``LossConfig.tis_cap``).
    sampler_logprobs: Sequence[float] | None = None


@flax.struct.dataclass
class Batch:
    """Packed step samples (numpy on the host; the jitted step takes it as a pytree of arrays)."""

    tokens: jax.Array  # int32[B, T]
    positions: jax.Array  # int32[B, T]
    branch: jax.Array  # int32[B, T]: SHARED, WITH, WITHOUT or PAD
    response: jax.Array  # int32[B, Y]: the response tokens
    # Row index whose output predicts response[:, j] with the rubric (two-stream: in rubric_tokens).
    with_index: jax.Array  # int32[B, Y]
    without_index: jax.Array  # int32[B, Y]: the same without the rubric
    response_mask: jax.Array  # float32[B, Y]: 1 on real response tokens
    old_logp: jax.Array  # float32[B, Y]
    advantage: jax.Array  # float32[B]
    has_rubric: jax.Array  # bool[B]
    ref_logp: jax.Array | None = None  # float32[B, Y]
    sampler_logp: jax.Array | None = None  # float32[B, Y]
    # [B, T, D]: the model's ``frozen_states`` of ``tokens``, computed once (the warm start's epochs).
    frozen: jax.Array | None = None
    # The two-stream layout's with-rubric stream (None: the packed layout).
    rubric_tokens: jax.Array | None = None  # int32[B, U]
    rubric_positions: jax.Array | None = None  # int32[B, U]
    rubric_branch: jax.Array | None = None  # int32[B, U]: WITH or PAD

    @property
    def two_stream(self) -> bool:
        return self.rubric_tokens is not None

    def token_counts(self) -> tuple[int, int]:
        """``(tokens, slots)``: the tokens the forward passes read, without and with their padding."""
        branches = [np.asarray(self.branch)] + ([np.asarray(self.rubric_branch)] if self.two_stream else [])
        return sum(int(np.sum(b != PAD)) for b in branches), sum(b.size for b in branches)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check(i: int, s: StepSample) -> None:
    if not s.prefix:
        raise ValueError(f"sample {i}: empty prefix (the first response token needs a context)")
    if not s.response:
        raise ValueError(f"sample {i}: empty response")
    if len(s.old_logprobs) != len(s.response):
        raise ValueError(f"sample {i}: {len(s.old_logprobs)} old log-probs for {len(s.response)} response tokens")
    for name in ("ref_logprobs", "sampler_logprobs"):
        values = getattr(s, name)
        if values is not None and len(values) != len(s.response):
            raise ValueError(f"sample {i}: {len(values)} {name} for {len(s.response)} response tokens")


def _two_streams(s: StepSample) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
    """The two-stream layout of one sample: the without-rubric stream's tokens and branch ids, the
    with-rubric stream's tokens and positions, and the predicting index of each response token in
    each stream (the with-rubric stream empty without a rubric, and its index 0)."""
    p, r, st, y = len(s.prefix), len(s.insert), len(s.tail), len(s.response)
    tokens = [*s.prefix, *s.tail, *s.response]
    branch = [SHARED] * p + [WITHOUT] * (st + y)
    without_index = [p + st + j - 1 for j in range(y)]
    if not r:
        return tokens, branch, [], [], [0] * y, without_index
    rubric = [*s.insert, *s.tail, *s.response]
    return tokens, branch, rubric, list(range(p, p + len(rubric))), [r + st + j - 1 for j in range(y)], without_index


def _pack(s: StepSample) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """One row: tokens, positions, branch ids, and the predicting row index of each response token per branch."""
    p, r, st, y = len(s.prefix), len(s.insert), len(s.tail), len(s.response)
    tokens = [*s.prefix]
    positions = list(range(p))
    branch = [SHARED] * p
    with_rows: list[int] = []
    if r:
        tokens += [*s.insert, *s.tail, *s.response]
        positions += range(p, p + r + st + y)
        branch += [WITH] * (r + st + y)
        with_rows = list(range(p + r + st + y))  # the with-rubric sequence, row by row
    start = len(tokens)
    tokens += [*s.tail, *s.response]
    positions += range(p, p + st + y)
    branch += [WITHOUT] * (st + y)
    without_rows = [*range(p), *range(start, start + st + y)]
    # Response token j sits at sequence index (prompt length + j) and is predicted by the one before.
    without_index = [without_rows[p + st + j - 1] for j in range(y)]
    with_index = [with_rows[p + r + st + j - 1] for j in range(y)] if r else without_index
    return tokens, positions, branch, with_index, without_index


def build_batch(
    samples: Sequence[StepSample],
    *,
    seq_multiple: int = 64,
    response_multiple: int = 16,
    batch_multiple: int = 1,
    pad_id: int = 0,
    layout: str = "packed",
) -> Batch:
    """Packs step samples into a ``Batch`` of numpy arrays in ``layout`` (``LAYOUTS``, see the
    module docstring).

    Padding rows (to make B a multiple of ``batch_multiple``, e.g. devices x micro-batches) have
    no tokens and no response mask, so they add nothing to any loss or count. Reference and
    sampler log-probs are kept when every sample has them and dropped (``None``) when none has.
    """
    if not samples:
        raise ValueError("no step samples")
    for i, s in enumerate(samples):
        _check(i, s)
    optional = ("ref_logprobs", "sampler_logprobs")  # per-token log-probs every sample has, or none
    for name in optional:
        given = [getattr(s, name) is not None for s in samples]
        if any(given) and not all(given):
            raise ValueError(f"{name} must be given for every sample or for none")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    if layout == "two-stream":
        streams = [_two_streams(s) for s in samples]
        rows = [(tok, list(range(len(tok))), br, w_idx, wo_idx) for tok, br, _, _, w_idx, wo_idx in streams]
    else:
        rows = [_pack(s) for s in samples]
    b = _round_up(len(samples), batch_multiple)
    t = _round_up(max(len(row[0]) for row in rows), seq_multiple)
    y = _round_up(max(len(s.response) for s in samples), response_multiple)

    tokens = np.full((b, t), pad_id, np.int32)
    positions = np.zeros((b, t), np.int32)
    branch = np.full((b, t), PAD, np.int32)
    response = np.full((b, y), pad_id, np.int32)
    with_index = np.zeros((b, y), np.int32)
    without_index = np.zeros((b, y), np.int32)
    mask = np.zeros((b, y), np.float32)
    logps = {name: np.zeros((b, y), np.float32) for name in ("old_logprobs", *optional)}
    advantage = np.zeros((b,), np.float32)
    has_rubric = np.zeros((b,), bool)
    for i, (s, (tok, pos, br, w_idx, wo_idx)) in enumerate(zip(samples, rows)):
        n, m = len(tok), len(s.response)
        tokens[i, :n], positions[i, :n], branch[i, :n] = tok, pos, br
        response[i, :m] = s.response
        with_index[i, :m], without_index[i, :m] = w_idx, wo_idx
        mask[i, :m] = 1.0
        for name, values in logps.items():
            if getattr(s, name) is not None:
                values[i, :m] = getattr(s, name)
        advantage[i] = s.advantage
        has_rubric[i] = bool(s.insert)
    two_stream = {}
    if layout == "two-stream":
        u = _round_up(max(1, *(len(stream[2]) for stream in streams)), seq_multiple)
        rubric_tokens = np.full((b, u), pad_id, np.int32)
        rubric_positions = np.zeros((b, u), np.int32)
        rubric_branch = np.full((b, u), PAD, np.int32)
        for i, (_, _, rubric, pos, _, _) in enumerate(streams):
            if rubric:
                n = len(rubric)
                rubric_tokens[i, :n], rubric_branch[i, :n] = rubric, WITH
                rubric_positions[i] = [*pos, *[pos[-1] + 1] * (u - n)]  # padding: the slot no real token sees
        two_stream = {"rubric_tokens": rubric_tokens, "rubric_positions": rubric_positions, "rubric_branch": rubric_branch}
    return Batch(
        **two_stream,
        tokens=tokens,
        positions=positions,
        branch=branch,
        response=response,
        with_index=with_index,
        without_index=without_index,
        response_mask=mask,
        old_logp=logps["old_logprobs"],
        advantage=advantage,
        has_rubric=has_rubric,
        ref_logp=logps["ref_logprobs"] if samples[0].ref_logprobs is not None else None,
        sampler_logp=logps["sampler_logprobs"] if samples[0].sampler_logprobs is not None else None,
    )


def tree_attention_mask(branch: jax.Array) -> jax.Array:
    """``bool[B, T, T]`` from branch ids ``[B, T]``: causal, and a token of one branch never sees the other.

    Query ``i`` attends key ``j`` iff ``j <= i``, both are real tokens, and ``j`` is in the shared
    prefix or in ``i``'s branch. Padding queries attend nothing.
    """
    t = branch.shape[1]
    query, key = branch[:, :, None], branch[:, None, :]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return causal[None] & (query != PAD) & (key != PAD) & ((key == SHARED) | (key == query))
