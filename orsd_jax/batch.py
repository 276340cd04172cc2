"""The training batch: step samples packed so one forward scores a response with and without the rubric.

A step sample's prompt is ``prefix + insert + tail`` (``orsd_jax.chat``: ``prefix`` is the chat
head and the user text, ``insert`` the rubric, ``tail`` the end of the user turn and the
assistant header). One packed row holds::

    tokens     prefix   | insert  tail  response | tail  response | padding
    branch     0 ...    | 1 ...                  | 2 ...          | -1 ...
    positions  0 .. p-1 | p .. p+r+s+y-1         | p .. p+s+y-1   | 0 ...

The first part is the with-rubric sequence; the second part is the without-rubric branch, which
restarts at position ``len(prefix)`` and attends to the shared prefix (branch 0) and to itself
only. A sample without a rubric is ``[prefix | tail | response]`` alone: its with-rubric
log-probs are its without-rubric ones, so its correction is 0. One row costs
``p + r + 2 (s + y)`` tokens instead of ``2 p + r + 2 (s + y)`` for two separate sequences.

The ``two-stream`` layout keeps the two sequences apart and shares the prefix's keys and values
instead of its row::

    tokens          prefix   | tail  response   | padding      (the without-rubric stream)
    rubric_tokens   insert  tail  response      | padding      (the with-rubric stream)
    rubric_positions p .. p+r+s+y-1             | 0 ...

``orsd_jax.loss`` runs the without-rubric stream with gradients, keeping every layer's keys and
values, and the with-rubric stream afterwards under stop-gradient, attending through a cache
that holds the row's keys and then the stream's own (``rubric_attention_mask``): the backward
pass never touches the rubric's tokens and the prefix is computed once (``benchmarks/loss.py``
measures both layouts against two plain forwards).

With ``build_batch(pack=True)`` a row holds several samples one after another, each a segment
that attends only to itself (``reach`` ends at the segment's end), so rows of
short and long prompts waste fewer padding slots. Per-sample arrays then have ``B = R x k``
slots, row-major (slot ``b`` is in row ``b // k``), and ``sample`` names the input sample in
each; ``head`` names the slot tokens of each row that the LM head scores (its real response
tokens). The with-rubric stream has rows only for the first ``S`` rows, those holding a sample
with a rubric.

With ``share_prefix`` a row's samples are one tree: the trie of their prefixes, depth first (a
prefix token once, however many of the row's prompts begin with it: the samples of one prompt, a
group's episodes at a state they reached by the same steps, and the steps of one task, whose
prompts repeat its instructions and first observation; docs/benchmarks.md, "Prompt trees"), and
after each prefix its samples' branches, member ``q``'s numbered ``WITH + 2 q`` and ``WITHOUT + 2
q``. ``reach`` (the last index of a token's subtree) says what each token sees, whatever the tree::

    tokens      1  2  3 | 7  8  9 | 5 | 7  9 |  4 |  7  8
    index       0  1  2 | 3  4  5 | 6 | 7  8 |  9 | 10 11
    positions   0  1  2 | 3  4  5 | 3 | 4  5 |  2 |  3  4
    reach      11 11  8 | 5  5  5 | 8 | 8  8 | 11 | 11 11

(prompts ``[1 2 3]``, ``[1 2 3 5]`` and ``[1 2 4]``, each with the tail ``[7]`` and a response):
query ``i`` sees key ``j`` iff ``j <= i <= reach[j]``. In the two-stream layout each prompt's
``[insert tail]`` is in the with-rubric stream once, then its samples' responses as branches,
reading the row through its prefix's last token (``rubric_anchor``).

Shapes, as the ``jaxtyping`` annotations here, in ``orsd_jax.loss`` and ``orsd_jax.models.decoder``
name them (annotations only: nothing checks them at run time)::

    R   rows (padded to ``batch_multiple``)
    T   row length (padded to ``seq_multiple``)
    U   the with-rubric stream's length (two-stream only, padded the same)
    S   the with-rubric stream's rows: the batch's first rows, those holding a segment with a rubric
        (padded to ``batch_multiple``); rows without one have no stream, so cost it nothing
    B   sample slots, ``R x k`` row-major (k: the most samples in a row; 1 without packing)
    Y   response length (padded to ``response_multiple``)
    N   input samples (``build_batch``'s ``samples``)
    D   hidden size, V vocabulary, L layers, K key/value heads, H head dim (the model's)

Padding lets the jitted step compile once per bucket. The decoder names its own inputs ``[B, T]``
and the keys they attend ``S``: the loss runs it on rows, so there its ``B`` is ``R`` (its ``T``
is ``U`` and ``S`` is ``T + U`` for the with-rubric stream). Lower-case letters are lengths no
array has as an axis: ``k`` above, and one sample's prefix ``p``, rubric ``r``, tail ``s`` and
response ``y`` in the diagrams.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, Float, Float32, Int, Int32

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


def samples_to_json(samples: Sequence[StepSample]) -> list[dict]:
    """Step samples as JSON values (``distributed.from_main``); ``samples_from_json`` reads them back
    exactly (floats round-trip through their repr)."""
    floats = lambda xs: None if xs is None else [float(x) for x in xs]  # noqa: E731
    return [
        {
            "prefix": [int(t) for t in s.prefix],
            "tail": [int(t) for t in s.tail],
            "response": [int(t) for t in s.response],
            "old_logprobs": floats(s.old_logprobs),
            "advantage": float(s.advantage),
            "insert": [int(t) for t in s.insert],
            "ref_logprobs": floats(s.ref_logprobs),
            "sampler_logprobs": floats(s.sampler_logprobs),
        }
        for s in samples
    ]


def samples_from_json(rows: Sequence[dict]) -> list[StepSample]:
    return [StepSample(**row) for row in rows]


@flax.struct.dataclass
class Batch:
    """Packed step samples (numpy on the host; the jitted step takes it as a pytree of arrays)."""

    tokens: Int32[np.ndarray | jax.Array, "R T"]
    positions: Int32[np.ndarray | jax.Array, "R T"]
    branch: Int32[np.ndarray | jax.Array, "R T"]  # SHARED, WITH, WITHOUT or PAD
    # The last index of the token's subtree in its row (PAD for padding): query i attends key j iff
    # j <= i <= reach[j] (``attention_mask``), whatever tree the row holds.
    reach: Int32[np.ndarray | jax.Array, "R T"]
    sample: Int32[np.ndarray | jax.Array, " B"]  # the input sample in each slot, -1 for an empty one
    response: Int32[np.ndarray | jax.Array, "B Y"]  # the response tokens
    # Index in the slot's row whose output predicts response[:, j] with the rubric (two-stream: in rubric_tokens).
    with_index: Int32[np.ndarray | jax.Array, "B Y"]
    without_index: Int32[np.ndarray | jax.Array, "B Y"]  # the same without the rubric
    response_mask: Float32[np.ndarray | jax.Array, "B Y"]  # 1 on real response tokens
    old_logp: Float32[np.ndarray | jax.Array, "B Y"]
    advantage: Float32[np.ndarray | jax.Array, " B"]
    has_rubric: Bool[np.ndarray | jax.Array, " B"]
    # Per row, which of its k x Y slot tokens (row-major) the LM head scores: the real response
    # tokens, then the index k x Y (no slot: scored and dropped), so that empty slots cost no LM head.
    head: Int32[np.ndarray | jax.Array, "R M"]
    ref_logp: Float32[np.ndarray | jax.Array, "B Y"] | None = None
    sampler_logp: Float32[np.ndarray | jax.Array, "B Y"] | None = None
    # The model's ``frozen_states`` of ``tokens`` (its compute dtype), computed once (the warm start's epochs).
    frozen: Float[np.ndarray | jax.Array, "R T D"] | None = None
    # The two-stream layout's with-rubric stream (None: the packed layout, or no sample has a rubric).
    rubric_tokens: Int32[np.ndarray | jax.Array, "S U"] | None = None
    rubric_positions: Int32[np.ndarray | jax.Array, "S U"] | None = None
    # SHARED for a segment's [insert tail], its sample's WITH branch for its response, or PAD.
    rubric_branch: Int32[np.ndarray | jax.Array, "S U"] | None = None
    rubric_reach: Int32[np.ndarray | jax.Array, "S U"] | None = None  # as ``reach``, in the stream
    # The last token of the prefix the stream token reads, in the row: it sees that token's ancestors.
    rubric_anchor: Int32[np.ndarray | jax.Array, "S U"] | None = None

    @property
    def two_stream(self) -> bool:
        return self.rubric_tokens is not None

    def sample_slots(self) -> Int[np.ndarray, " N"]:
        """The slot holding each input sample, in input order."""
        sample = np.asarray(self.sample)
        filled = np.flatnonzero(sample >= 0)
        return filled[np.argsort(sample[filled])]

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


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Samples laid out as one tree in a row (one sample unless ``share_prefix``), and in the
    two-stream layout in the with-rubric stream's row. Indices are relative to the segment's start
    in the row (``with_index`` of the two-stream layout and ``rubric_reach``: in its stream). Member
    ``q`` of the segment has the branch ids ``WITH + 2 q`` and ``WITHOUT + 2 q``."""

    tokens: list[int]
    positions: list[int]
    branch: list[int]
    reach: list[int]  # the last index of each token's subtree (``Batch.reach``)
    without_index: list[list[int]]  # per member, the predicting index of each response token, without the rubric
    with_index: list[list[int]]  # the same with the rubric: in ``rubric`` (two-stream) or in ``tokens``
    rubric: list[int] = dataclasses.field(default_factory=list)  # two-stream: per prompt [insert tail], its responses
    rubric_positions: list[int] = dataclasses.field(default_factory=list)
    rubric_branch: list[int] = dataclasses.field(default_factory=list)
    rubric_reach: list[int] = dataclasses.field(default_factory=list)
    rubric_anchor: list[int] = dataclasses.field(default_factory=list)  # the last token of its prefix, in the row


_Parts = tuple[list[int], list[int], list[int], list[int]]  # a sequence's tokens, positions, branch, reach


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def _segment(members: Sequence[StepSample], two_stream: bool) -> _Segment:
    """The members as one tree: the trie of their prefixes in depth-first order (a prefix token
    once, however many members' prompts begin with it), and after each prefix the branches of its
    prompt's members (``prompt_key``): the without-rubric branch ``[tail response]`` of each, and
    with a rubric the with-rubric one: in the row ``[insert tail response]`` (packed), or in the
    with-rubric stream ``[insert tail]`` once a prompt and then each member's ``[response]``
    (``two_stream``), which see the row's prefix through its last token (``rubric_anchor``).
    Members without a rubric read their with-rubric log-probs from their without-rubric branch
    (the loss ignores them)."""
    row: _Parts = ([], [], [], [])  # tokens, positions, branch, reach
    stream: _Parts = ([], [], [], [])
    anchor: list[int] = []
    without_index: list[list[int]] = [[] for _ in members]
    with_index: list[list[int]] = [[] for _ in members]

    def chain(into: _Parts, part: Sequence[int], start: int, branch_id: int) -> list[int]:
        """Appends ``part`` at positions from ``start``, each token's subtree the rest of the part:
        its indices in ``into``."""
        at = len(into[0])
        into[0].extend(part)
        into[1].extend(range(start, start + len(part)))
        into[2].extend([branch_id] * len(part))
        into[3].extend([at + len(part) - 1] * len(part))
        return list(range(at, at + len(part)))

    path: list[int] = []  # the row indices of the current prefix's tokens
    previous: Sequence[int] = ()
    by_prompt = itertools.groupby(
        sorted(range(len(members)), key=lambda q: prompt_key(members[q])), key=lambda q: prompt_key(members[q])
    )
    for (prefix, insert, tail), qs in by_prompt:
        p, r, st = len(prefix), len(insert), len(tail)
        shared = _common(previous, prefix)
        for i in path[shared:]:  # the nodes this prefix leaves: their subtrees end here
            row[3][i] = len(row[0]) - 1
        path = path[:shared] + chain(row, prefix[shared:], shared, SHARED)
        previous = prefix
        if r and two_stream:  # the stream starts with the prompt's [insert tail], seen by each response
            head = chain(stream, [*insert, *tail], p, SHARED)
        for q in qs:
            s, y = members[q], len(members[q].response)
            # Response token j sits at sequence index (prompt length + j) and is predicted by the one before.
            with_seq = None
            if r and two_stream:  # the prefix is in the row
                with_seq = [-1] * p + head + chain(stream, s.response, p + r + st, WITH + 2 * q)
            elif r:
                with_seq = path + chain(row, [*insert, *tail, *s.response], p, WITH + 2 * q)
            without_seq = path + chain(row, [*tail, *s.response], p, WITHOUT + 2 * q)
            without_index[q] = [without_seq[p + st + j - 1] for j in range(y)]
            with_index[q] = [with_seq[p + r + st + j - 1] for j in range(y)] if with_seq else without_index[q]
        if r and two_stream:
            for i in head:
                stream[3][i] = len(stream[0]) - 1
            anchor += [path[-1]] * (len(stream[0]) - len(anchor))
    for i in path:
        row[3][i] = len(row[0]) - 1
    return _Segment(*row, without_index, with_index, *stream, anchor)


def prompt_key(s: StepSample) -> tuple[tuple[int, ...], ...]:
    """What samples sharing a segment (``share_prefix``) have in common: prefix, insert and tail."""
    return tuple(s.prefix), tuple(s.insert), tuple(s.tail)


def prompt_groups(samples: Sequence[StepSample]) -> list[list[int]]:
    """The indices of the samples of each prompt (``prompt_key``), in order of first appearance."""
    groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(prompt_key(s), []).append(i)
    return list(groups.values())


def _rows(segments: Sequence[_Segment], t: int, u: int, pack: bool) -> list[list[int]]:
    """The segments of each row: one per row in order, or (``pack``) first-fit by decreasing
    length into rows of ``t`` tokens and ``u`` with-rubric stream tokens, the segments with a
    stream first: they fill the first rows, and the stream has as few rows as they allow."""
    if not pack:
        return [[i] for i in range(len(segments))]
    rows: list[list[int]] = []
    used: list[tuple[int, int]] = []
    for i in sorted(range(len(segments)), key=lambda i: (not segments[i].rubric, -len(segments[i].tokens))):
        n, m = len(segments[i].tokens), len(segments[i].rubric)
        row = next((k for k, (a, c) in enumerate(used) if a + n <= t and c + m <= u), None)
        if row is None:
            rows.append([])
            used.append((0, 0))
            row = len(rows) - 1
        rows[row].append(i)
        used[row] = (used[row][0] + n, used[row][1] + m)
    return rows


def _tree_rows(
    samples: Sequence[StepSample], groups: Sequence[Sequence[int]], segments: Sequence[_Segment], t: int, u: int
) -> list[list[int]]:
    """The prompts' ``groups`` (``segments``: theirs alone) first fit into rows of ``t`` tokens and
    ``u`` with-rubric stream tokens, each row one tree (``_segment``), those with a stream first,
    then in order of their prompts, so that the prompts that begin alike (one task's steps) meet:
    a group costs a row its segment's tokens less the longest beginning its prefix shares with the
    row's (what a trie of the row's prefixes gains by it)."""
    order = sorted(range(len(groups)), key=lambda g: (not segments[g].rubric, prompt_key(samples[groups[g][0]])))
    rows: list[list[int]] = []
    used: list[tuple[int, int]] = []
    for g in order:
        prefix, n, m = samples[groups[g][0]].prefix, len(segments[g].tokens), len(segments[g].rubric)
        for k, (a, c) in enumerate(used):
            cost = n - max(_common(prefix, samples[groups[h][0]].prefix) for h in rows[k])
            if a + cost <= t and c + m <= u:
                rows[k].append(g)
                used[k] = (a + cost, c + m)
                break
        else:
            rows.append([g])
            used.append((n, m))
    return [[i for g in row for i in groups[g]] for row in rows]


def _holds_stream(samples: Sequence[StepSample], row: Sequence[int], layout: str) -> bool:
    """Whether a row of these samples has a with-rubric stream: two-stream, some sample with a rubric."""
    return layout == "two-stream" and any(samples[i].insert for i in row)


def _extent(segments: Sequence[_Segment], floor: int, seq_multiple: int) -> tuple[int, int]:
    """``(T, U)`` for rows of ``segments``: the longest padded, at least ``floor`` (and its half);
    ``U`` is 0 when no segment has a with-rubric stream (the two layouts are then one)."""
    t = _round_up(max(floor, *(len(g.tokens) for g in segments)), seq_multiple)
    if not any(g.rubric for g in segments):
        return t, 0
    return t, _round_up(max(floor // 2, *(len(g.rubric) for g in segments)), seq_multiple)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Which samples ``build_batch`` puts in each row, and the rows' lengths."""

    rows: list[list[int]]  # sample indices, a row's segments one after another
    tokens: int  # T
    stream: int  # U, 0 without a with-rubric stream
    stream_rows: int  # rows holding a with-rubric stream: the first ones


def plan_rows(
    samples: Sequence[StepSample],
    *,
    layout: str = "packed",
    pack: bool = False,
    share_prefix: bool = False,
    seq_multiple: int = 64,
    row_tokens: int = 0,
) -> RowPlan:
    """The rows ``build_batch`` makes of ``samples`` (its parameters of the same names): a segment
    per row, or (``pack``) first fit by decreasing length into rows of the longest segment's
    padded length (at least ``row_tokens``); with ``share_prefix`` the prompts first fit into rows
    of that length as trees (``_tree_rows``)."""
    groups = prompt_groups(samples) if share_prefix else [[i] for i in range(len(samples))]
    segments = [_segment([samples[i] for i in g], layout == "two-stream") for g in groups]
    t, u = _extent(segments, row_tokens if pack else 0, seq_multiple)
    if share_prefix:
        rows = _tree_rows(samples, groups, segments, t, u)
    else:
        rows = [[i for g in m for i in groups[g]] for m in _rows(segments, t, u, pack)]
    return RowPlan(rows, t, u, sum(_holds_stream(samples, row, layout) for row in rows))


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """A packed batch's array shape (``build_batch(shape=...)``): batches of one shape run one
    compiled train step. ``stream`` applies to batches with a with-rubric stream (two-stream
    layout, some sample with a rubric); batches without one have none."""

    rows: int  # R
    tokens: int  # T
    stream: int  # U
    stream_rows: int  # S
    slots: int  # k, sample slots a row
    response: int  # Y
    head: int  # M, the LM head's positions a row


def build_batch(
    samples: Sequence[StepSample],
    *,
    seq_multiple: int = 64,
    response_multiple: int = 16,
    batch_multiple: int = 1,
    pad_id: int = 0,
    layout: str = "packed",
    pack: bool = False,
    row_tokens: int = 0,
    rows: Sequence[Sequence[int]] | None = None,
    slots: int = 1,
    share_prefix: bool = False,
    shape: BatchShape | None = None,
) -> Batch:
    """Packs step samples into a ``Batch`` of numpy arrays in ``layout`` (``LAYOUTS``, see the
    module docstring).

    Without ``pack`` each row holds one segment, in order (rows with a with-rubric stream first).
    With ``pack``, rows hold as many samples as fit in the longest sample's padded length (first
    fit by decreasing length, the samples with a with-rubric stream first: ``plan_rows``), each a
    segment of its own, so fewer padding slots are computed; the sample slots (``B = rows x
    K``, K the most samples in a row) are row-major and ``Batch.sample`` says which input sample
    each holds; ``row_tokens`` makes packed rows at least that long, so that samples longer than
    half the longest one can share rows too; ``rows`` (with ``pack``) gives the samples of each row
    instead, and ``slots`` a least K, or ``shape`` the whole array shape (a ``ValueError`` when the
    samples do not fit it), so that batches of one fixed shape can be built. Padding rows (to make
    the row count a multiple of ``batch_multiple``, e.g. devices x micro-batches) and empty slots
    have no tokens and no response mask, so they add nothing to any loss or count. Reference and
    sampler log-probs are kept when every sample has them and dropped (``None``) when none has.

    ``share_prefix``: samples of the same prompt (``prompt_key``: a group's episodes that took the
    same steps so far; with ``rows``, in the same row) are one segment, the prefix computed once
    and each sample a branch of its own after it, as the with- and without-rubric branches of one
    sample are; the loss is unchanged (tested).
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
    if (rows is not None or shape is not None) and not pack:
        raise ValueError("rows and shape go with pack=True")
    if rows is None:
        rows = plan_rows(
            samples,
            layout=layout,
            pack=pack,
            share_prefix=share_prefix,
            seq_multiple=seq_multiple,
            row_tokens=row_tokens,
        ).rows
    elif sorted(i for row in rows for i in row) != list(range(len(samples))):
        raise ValueError("rows must hold every sample exactly once")
    # Rows holding a with-rubric stream first: the stream's arrays have only those rows.
    rows = sorted(rows, key=lambda row: not _holds_stream(samples, row, layout))
    # The segments of each row: with ``share_prefix`` one tree of all its samples (no longer than
    # the trees planned into it: a trie of their union holds each token once).
    in_rows = [[list(row)] if share_prefix else [[i] for i in row] for row in rows]
    groups = [g for row in in_rows for g in row]
    segments = [_segment([samples[i] for i in g], layout == "two-stream") for g in groups]
    t, u = _extent(segments, row_tokens if pack else 0, seq_multiple)
    two_stream = u > 0
    if shape is not None:
        t, u = shape.tokens, shape.stream if two_stream else 0
    starts = np.cumsum([0, *(len(row) for row in in_rows)])
    members = [list(range(a, e)) for a, e in zip(starts[:-1], starts[1:])]
    if any(sum(len(segments[g].tokens) for g in m) > t or sum(len(segments[g].rubric) for g in m) > u for m in members):
        raise ValueError(f"a row holds more than its {t} tokens (with-rubric stream: {u})")
    k = max(slots, *(sum(len(groups[g]) for g in m) for m in members))
    # Rows, stream rows, response length and LM-head positions a row the samples need, unpadded.
    need = (
        len(members),
        sum(_holds_stream(samples, row, layout) for row in rows),
        max(len(s.response) for s in samples),
        max(sum(len(samples[i].response) for i in row) for row in rows),
    )
    if shape is None:
        r, stream_rows = (_round_up(n, batch_multiple) for n in need[:2])
        y = _round_up(need[2], response_multiple)
        m = min(k * y, _round_up(need[3], response_multiple))
    else:
        r, stream_rows, y, m = shape.rows, shape.stream_rows, shape.response, shape.head
        if any(a > b for a, b in zip((*need, k), (r, stream_rows, y, m, shape.slots))):
            raise ValueError(
                f"the samples need {need} (rows, stream rows, response tokens, LM-head positions a "
                f"row) and {k} slots a row; the shape has {(r, stream_rows, y, m)} and {shape.slots}"
            )
        k = shape.slots
    b = r * k
    head = np.full((r, m), k * y, np.int32)

    tokens = np.full((r, t), pad_id, np.int32)
    positions = np.zeros((r, t), np.int32)
    branch = np.full((r, t), PAD, np.int32)
    reach = np.full((r, t), PAD, np.int32)
    rubric = {
        "rubric_tokens": np.full((stream_rows, u), pad_id, np.int32),
        "rubric_positions": np.zeros((stream_rows, u), np.int32),
        "rubric_branch": np.full((stream_rows, u), PAD, np.int32),
        "rubric_reach": np.full((stream_rows, u), PAD, np.int32),
        "rubric_anchor": np.full((stream_rows, u), PAD, np.int32),
    }
    sample = np.full((b,), -1, np.int32)
    response = np.full((b, y), pad_id, np.int32)
    with_index = np.zeros((b, y), np.int32)
    without_index = np.zeros((b, y), np.int32)
    mask = np.zeros((b, y), np.float32)
    logps = {name: np.zeros((b, y), np.float32) for name in ("old_logprobs", *optional)}
    advantage = np.zeros((b,), np.float32)
    has_rubric = np.zeros((b,), bool)
    for row, in_row in enumerate(members):
        # Where the next segment starts in the row and in its stream; the next slot; the next LM-head position.
        at, at_rubric, j, scored = 0, 0, row * k, 0
        for gi in in_row:
            g, n = segments[gi], len(segments[gi].tokens)
            span = slice(at, at + n)
            tokens[row, span], positions[row, span], branch[row, span] = g.tokens, g.positions, g.branch
            reach[row, span] = np.asarray(g.reach) + at
            if g.rubric:
                span = slice(at_rubric, at_rubric + len(g.rubric))
                rubric["rubric_tokens"][row, span], rubric["rubric_positions"][row, span] = g.rubric, g.rubric_positions
                rubric["rubric_branch"][row, span] = g.rubric_branch
                rubric["rubric_reach"][row, span] = np.asarray(g.rubric_reach) + at_rubric
                rubric["rubric_anchor"][row, span] = np.asarray(g.rubric_anchor) + at
            for q, i in enumerate(groups[gi]):
                s, ny = samples[i], len(samples[i].response)
                sample[j], response[j, :ny], mask[j, :ny] = i, s.response, 1.0
                without_index[j, :ny] = np.asarray(g.without_index[q]) + at
                with_index[j, :ny] = np.asarray(g.with_index[q]) + (at_rubric if two_stream else at)
                for name, values in logps.items():
                    if getattr(s, name) is not None:
                        values[j, :ny] = getattr(s, name)
                advantage[j], has_rubric[j] = s.advantage, bool(s.insert)
                head[row, scored : scored + ny] = (j - row * k) * y + np.arange(ny)
                j, scored = j + 1, scored + ny
            at, at_rubric = at + n, at_rubric + len(g.rubric)
    return Batch(
        **(rubric if two_stream else {}),
        tokens=tokens,
        positions=positions,
        branch=branch,
        reach=reach,
        sample=sample,
        response=response,
        with_index=with_index,
        without_index=without_index,
        response_mask=mask,
        old_logp=logps["old_logprobs"],
        advantage=advantage,
        has_rubric=has_rubric,
        head=head,
        ref_logp=logps["ref_logprobs"] if samples[0].ref_logprobs is not None else None,
        sampler_logp=logps["sampler_logprobs"] if samples[0].sampler_logprobs is not None else None,
    )


def attention_mask(reach: Int[np.ndarray | jax.Array, "R T"]) -> Bool[jax.Array, "R T T"]:
    """The rows' attention mask from ``Batch.reach``: query ``i`` attends key ``j`` iff ``j <= i <=
    reach[j]``, i.e. ``j`` is ``i`` or an ancestor of it in the row's depth-first tree. Padding
    attends nothing and is attended by nothing."""
    index = jnp.arange(reach.shape[1])
    return (index[None, None, :] <= index[None, :, None]) & (index[None, :, None] <= reach[:, None, :])


def rubric_attention_mask(batch: Batch) -> Bool[jax.Array, "S U T+U"]:
    """What the with-rubric stream's tokens see of a cache holding the row's keys in slots ``[0, T)``
    and the stream's own in ``[T, T + U)``: their prefix (the row's ancestors of their
    ``rubric_anchor``, itself included), and their own earlier stream tokens: their prompt's
    ``[insert tail]`` and their own response (``rubric_reach``). Padding tokens see nothing."""
    if batch.rubric_reach is None or batch.rubric_anchor is None:
        raise ValueError("rubric_attention_mask needs a batch with a with-rubric stream (the two-stream layout)")
    rows, t = batch.rubric_anchor.shape[0], batch.reach.shape[1]
    anchor = batch.rubric_anchor[:, :, None]
    prefix = (jnp.arange(t)[None, None, :] <= anchor) & (anchor <= batch.reach[:rows, None, :])
    return jnp.concatenate([prefix, attention_mask(batch.rubric_reach)], axis=2)
