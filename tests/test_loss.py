"""The packed batch and the ORSD loss: hand-computed toys, and the one packed forward against two
separate forwards of a tiny random model with an independent loss written here."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    CONFIG,
    LOSS,
    RUBRIC_ROWS,
    SHARED_PROMPTS,
    assert_trees_close,
    make_samples,
    max_tree_diff,
    sequence_logprobs,
    tiny_model,
    trie_samples,
    trie_size,
)

from orsd_jax.batch import (
    LAYOUTS,
    PAD,
    SHARED,
    WITH,
    WITHOUT,
    StepSample,
    attention_mask,
    build_batch,
    rubric_attention_mask,
)
from orsd_jax.loss import LossConfig, OrsdLoss, policy_loss
from orsd_jax.models import CausalLM

# ---------------------------------------------------------------- the packed layout, by hand


def test_build_batch_layout_by_hand():
    with_rubric = StepSample(
        prefix=[11, 12], insert=[21, 22, 23], tail=[31], response=[41, 42], old_logprobs=[-1.0, -2.0], advantage=0.5
    )
    plain = StepSample(
        prefix=[13], tail=[32, 33], response=[43, 44, 45], old_logprobs=[-3.0, -4.0, -5.0], advantage=-1.0
    )
    b = build_batch([with_rubric, plain], seq_multiple=4, response_multiple=4, batch_multiple=4, pad_id=0)
    # Row 0: [prefix | insert tail response] [tail response] = 11 tokens, padded to 12.
    np.testing.assert_array_equal(b.tokens[0], [11, 12, 21, 22, 23, 31, 41, 42, 31, 41, 42, 0])
    np.testing.assert_array_equal(b.positions[0], [0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 0])
    np.testing.assert_array_equal(b.branch[0], [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, -1])
    # With the rubric, 41 (row 6) is predicted by row 5 (tail), 42 by row 6. Without it, the
    # sequence is rows 0, 1, 8, 9, 10: 41 (row 9) is predicted by row 8, 42 (row 10) by row 9.
    np.testing.assert_array_equal(b.with_index[0], [5, 6, 0, 0])
    np.testing.assert_array_equal(b.without_index[0], [8, 9, 0, 0])
    # Row 1 has no rubric: [prefix | tail response] only, and both indices are the same.
    np.testing.assert_array_equal(b.tokens[1], [13, 32, 33, 43, 44, 45] + [0] * 6)
    np.testing.assert_array_equal(b.positions[1], [0, 1, 2, 3, 4, 5] + [0] * 6)
    np.testing.assert_array_equal(b.branch[1], [0, 2, 2, 2, 2, 2] + [-1] * 6)
    np.testing.assert_array_equal(b.with_index[1], [2, 3, 4, 0])
    np.testing.assert_array_equal(b.without_index[1], [2, 3, 4, 0])
    np.testing.assert_array_equal(b.response, [[41, 42, 0, 0], [43, 44, 45, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(b.response_mask, [[1, 1, 0, 0], [1, 1, 1, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(b.old_logp[:2], [[-1, -2, 0, 0], [-3, -4, -5, 0]])
    np.testing.assert_array_equal(b.advantage, [0.5, -1.0, 0, 0])
    np.testing.assert_array_equal(b.has_rubric, [True, False, False, False])
    assert b.ref_logp is None
    # Rows 2 and 3 only pad the batch to a multiple of 4.
    assert (b.branch[2:] == PAD).all() and b.tokens.shape == (4, 12)


def test_attention_mask_by_hand():
    """A prefix of two tokens, a with-rubric branch and a without-rubric branch of two, padding."""
    reach = np.array([[5, 5, 3, 3, 5, 5, PAD]])
    mask = np.asarray(attention_mask(jnp.asarray(reach)))[0].astype(int)
    expected = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],  # the without branch sees the prefix and itself, not the with branch
        [1, 1, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0],  # padding sees nothing
    ]
    np.testing.assert_array_equal(mask, expected)


def test_build_batch_rejects_bad_samples():
    good = dict(prefix=[1], tail=[2], response=[3, 4], old_logprobs=[-1.0, -1.0], advantage=0.0)
    with pytest.raises(ValueError, match="2 response tokens"):
        build_batch([StepSample(**good | {"old_logprobs": [-1.0]})])
    with pytest.raises(ValueError, match="empty response"):
        build_batch([StepSample(**good | {"response": [], "old_logprobs": []})])
    with pytest.raises(ValueError, match="every sample or for none"):
        build_batch([StepSample(**good, ref_logprobs=[-1.0, -1.0]), StepSample(**good)])
    batch = build_batch([StepSample(**good)])
    with pytest.raises(ValueError, match="reference log-probs"):
        policy_loss(jnp.zeros((1, 16)), jnp.zeros((1, 16)), None, batch, LossConfig(kl_coef=0.1))


# ---------------------------------------------------------------- the loss on given log-probs, by hand


def _toy_batch(responses, advantages, has_rubric, old, ref=None):
    samples = [
        StepSample(
            prefix=[1],
            tail=[2],
            response=[5] * n,
            old_logprobs=o,
            advantage=a,
            insert=[3] if r else (),
            ref_logprobs=None if ref is None else ref[i],
        )
        for i, (n, a, r, o) in enumerate(zip(responses, advantages, has_rubric, old))
    ]
    return build_batch(samples, response_multiple=4)


def _pad(rows, width=4):
    return jnp.asarray([list(r) + [0.0] * (width - len(r)) for r in rows], jnp.float32)


def test_ppo_clip_dual_clip_entropy_and_kl_by_hand():
    # Old log-probs 0, so the ratios are exp(logp): 1.5, 0.9, 1.1 (advantage +1) and 0.5, 5 (advantage -1).
    logp = _pad([np.log([1.5, 0.9, 1.1]), np.log([0.5, 5.0])])
    batch = _toy_batch([3, 2], [1.0, -1.0], [False, False], [[0.0] * 3, [0.0] * 2])
    base = LossConfig(coef=0.0, clip_low=0.2, clip_high=0.2, dual_clip=3.0, entropy_coef=0.0)
    loss_sum, count, sums, _ = policy_loss(logp, jnp.zeros_like(logp), None, batch, base)
    # A = +1: max(-1.5, -1.2) = -1.2 (clipped), -0.9, -1.1. A = -1: max(0.5, 0.8) = 0.8 (clipped),
    # max(5, 1.2) = 5, dual-clipped to 3.
    assert float(count) == 5 and float(sums["clipped"]) == 2
    np.testing.assert_allclose(float(loss_sum), -1.2 - 0.9 - 1.1 + 0.8 + 3.0, rtol=1e-6)
    # Clip-higher 0.28 moves the first token to -1.28; no dual clip leaves the last at 5.
    higher = dataclasses.replace(base, clip_high=0.28, dual_clip=None)
    loss_sum, _, _, _ = policy_loss(logp, jnp.zeros_like(logp), None, batch, higher)
    np.testing.assert_allclose(float(loss_sum), -1.28 - 0.9 - 1.1 + 0.8 + 5.0, rtol=1e-6)
    # Entropy bonus 0.1 on entropies 1..5 (sum 15) and k3 KL 0.1 against a reference log(2) above
    # the first token: e^log2 - log2 - 1.
    ref = [list(np.log([3.0, 0.9, 1.1])), list(np.log([0.5, 5.0]))]
    batch = _toy_batch([3, 2], [1.0, -1.0], [False, False], [[0.0] * 3, [0.0] * 2], ref=ref)
    config = LossConfig(coef=0.0, dual_clip=3.0, entropy_coef=0.1, kl_coef=0.1)
    loss_sum, _, sums, _ = policy_loss(logp, _pad([[1, 2, 3], [4, 5]]), None, batch, config)
    kl = 2 - np.log(2) - 1
    np.testing.assert_allclose(float(loss_sum), 0.6 - 0.1 * 15 + 0.1 * kl, rtol=1e-5)
    np.testing.assert_allclose(float(sums["ref_kl"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(sums["entropy"]), 15, rtol=1e-6)


def test_truncated_importance_sampling_by_hand():
    # The trainer's old log-probs 0; the sampler's log(2), log(0.25), 0: weights 0.5, 4 -> capped at
    # 2, and 1. Ratios exp(logp) = 1, 1.1, 0.9 with A = +1: terms -1, -1.1, -0.9.
    logp = _pad([np.log([1.0, 1.1, 0.9])])
    samples = [
        StepSample(
            prefix=[1],
            tail=[2],
            response=[5, 5, 5],
            old_logprobs=[0.0] * 3,
            advantage=1.0,
            sampler_logprobs=np.log([2.0, 0.25, 1.0]).tolist(),
        )
    ]
    batch = build_batch(samples, response_multiple=4)
    config = LossConfig(coef=0.0, entropy_coef=0.0, tis_cap=2.0)
    loss_sum, _, sums, _ = policy_loss(logp, jnp.zeros_like(logp), None, batch, config)
    np.testing.assert_allclose(float(loss_sum), 0.5 * -1 + 2 * -1.1 + 1 * -0.9, rtol=1e-6)
    np.testing.assert_allclose([float(sums["tis_weight"]), float(sums["tis_capped"])], [3.5, 1], rtol=1e-6)
    off, _, _, _ = policy_loss(logp, jnp.zeros_like(logp), None, batch, dataclasses.replace(config, tis_cap=None))
    np.testing.assert_allclose(float(off), -3.0, rtol=1e-6)
    with pytest.raises(ValueError, match="sampler's log-probs"):
        policy_loss(logp, jnp.zeros_like(logp), None, _toy_batch([3], [1.0], [False], [[0.0] * 3]), config)


def test_correction_and_gap_metrics_by_hand():
    # Ratios 1 everywhere, so each token's loss is -Ahat. Sample 0 (A = +1) and sample 2 (A = -1)
    # have a rubric; sample 1 (A = 0.5) has none, so its (different) with-rubric log-probs are ignored.
    old = [[-1.0] * 3, [-1.0], [-1.0] * 2]
    logp = _pad(old)
    gaps = [[0.4, 2.0, -0.2], [5.0], [-3.0, 0.5]]
    logp_with = logp + _pad(gaps)
    batch = _toy_batch([3, 1, 2], [1.0, 0.5, -1.0], [True, False, True], old)
    config = LossConfig(coef=0.5, clip=1.0, entropy_coef=0.0)
    loss_sum, count, sums, _ = policy_loss(logp, jnp.zeros_like(logp), logp_with, batch, config)
    # Ahat: 1 + 0.5 * (0.4, 1, -0.2) = 1.2, 1.5, 0.9; 0.5; -1 + 0.5 * (-1, 0.5) = -1.5, -0.75.
    np.testing.assert_allclose(float(loss_sum), -(1.2 + 1.5 + 0.9 + 0.5 - 1.5 - 0.75), rtol=1e-6)
    metrics = OrsdLoss.metrics(sums, count)
    g = np.array([0.4, 2.0, -0.2, -3.0, 0.5])
    a = np.array([1.0, 1.0, 1.0, -1.0, -1.0])
    np.testing.assert_allclose(float(metrics["gap_mean"]), g.mean(), atol=1e-6)
    np.testing.assert_allclose(float(metrics["gap_std"]), g.std(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["gap_clip_frac"]), 2 / 5, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["gap_adv_corr"]), np.corrcoef(g, a)[0, 1], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rubric_token_frac"]), 5 / 6, rtol=1e-6)
    assert float(metrics["clip_frac"]) == 0 and float(metrics["approx_kl"]) == 0


# ---------------------------------------------------------------- one packed forward vs two forwards


@functools.cache
def reference_case(shared: bool = False, trie: bool = False):
    """Samples (``shared``: several of one prompt; ``trie``: ``trie_samples``), and the value and
    gradient of the ORSD objective written independently: two plain forwards per sample, the
    with-rubric log-probs computed once as constants, a token mean."""
    samples = trie_samples() if trie else make_samples(RUBRIC_ROWS, prompt_of=SHARED_PROMPTS if shared else None)
    graphdef, params = tiny_model()
    width = max(len(s.response) for s in samples)
    pad = lambda rows: jnp.asarray([list(r) + [0.0] * (width - len(r)) for r in rows], jnp.float32)  # noqa: E731
    old, ref = pad([s.old_logprobs for s in samples]), pad([s.ref_logprobs for s in samples])
    mask = pad([[1.0] * len(s.response) for s in samples])
    adv = jnp.asarray([s.advantage for s in samples])[:, None]
    has = jnp.asarray([bool(s.insert) for s in samples])[:, None]
    with_rubric = [[*s.prefix, *s.insert, *s.tail, *s.response] for s in samples]
    with_prompt = [len(q) - len(s.response) for q, s in zip(with_rubric, samples)]
    lw, _ = sequence_logprobs(graphdef, params, with_rubric, with_prompt, width)

    def loss(p, coef, ref=ref):
        without = [[*s.prefix, *s.tail, *s.response] for s in samples]
        lp, ent = sequence_logprobs(graphdef, p, without, [len(s.prefix) + len(s.tail) for s in samples], width)
        gap = jnp.where(has, jax.lax.stop_gradient(lw - lp), 0.0)
        a_hat = adv + coef * jnp.clip(gap, -LOSS.clip, LOSS.clip)
        ratio = jnp.exp(lp - old)
        term = jnp.maximum(-a_hat * ratio, -a_hat * jnp.clip(ratio, 1 - LOSS.clip_low, 1 + LOSS.clip_high))
        term = jnp.where(a_hat < 0, jnp.minimum(term, -a_hat * LOSS.dual_clip), term)
        d = ref - lp
        # k3, clamped to [-10, 10] as verl's low_var_kl (a far reference only moves it there).
        term = term + LOSS.kl_coef * jnp.clip(jnp.exp(d) - d - 1, -10, 10) - LOSS.entropy_coef * ent
        return jnp.sum(term * mask) / jnp.sum(mask)

    return samples, jax.jit(jax.value_and_grad(loss))


def packed_value_and_grad(batch, config):
    graphdef, params = tiny_model()

    def f(p):
        loss_sum, count, _, _ = OrsdLoss(config)(nnx.merge(graphdef, p), batch)
        return loss_sum / count

    return jax.jit(jax.value_and_grad(f))(params)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_packed_forward_equals_two_forwards(layout):
    samples, reference = reference_case()
    batch = build_batch(
        samples, seq_multiple=16, response_multiple=4, batch_multiple=8, layout=layout
    )  # 3 padding rows
    assert batch.has_rubric.sum() == 3 and batch.tokens.shape[0] == 8
    loss, grads = packed_value_and_grad(batch, LOSS)
    expected_loss, expected_grads = reference(tiny_model()[1], LOSS.coef)
    np.testing.assert_allclose(float(loss), float(expected_loss), atol=1e-5, rtol=0)
    # The reference holds the with-rubric log-probs constant: equal gradients mean none flows through them.
    assert_trees_close(grads, expected_grads)
    # The correction matters here: without it the loss and gradients are different.
    plain_loss, plain_grads = reference(tiny_model()[1], 0.0)
    assert abs(float(plain_loss) - float(loss)) > 1e-3
    assert max_tree_diff(grads, plain_grads) > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_of_several_samples_equal_two_forwards(layout):
    """``pack=True`` puts several samples in a row, each attending only to itself: the loss and
    gradients are still the independent objective's."""
    samples, reference = reference_case()
    batch = build_batch(samples, seq_multiple=16, response_multiple=4, layout=layout, pack=True)
    rows, slots = batch.tokens.shape[0], batch.response.shape[0]
    assert rows < len(samples) and slots % rows == 0 and slots // rows > 1  # it did pack
    assert sorted(batch.sample[batch.sample >= 0]) == list(range(len(samples)))
    loss, grads = packed_value_and_grad(batch, LOSS)
    expected_loss, expected_grads = reference(tiny_model()[1], LOSS.coef)
    np.testing.assert_allclose(float(loss), float(expected_loss), atol=1e-5, rtol=0)
    assert_trees_close(grads, expected_grads)


@pytest.mark.parametrize("layout, pack", [("packed", False), ("two-stream", False), ("two-stream", True)])
def test_shared_prefixes_equal_two_forwards(layout, pack):
    """``share_prefix``: the samples of one prompt (with and without a rubric) are branches of one
    segment; the loss and gradients are the independent objective's."""
    samples, reference = reference_case(shared=True)
    batch = build_batch(samples, seq_multiple=16, response_multiple=4, layout=layout, pack=pack, share_prefix=True)
    roots = (np.asarray(batch.positions) == 0) & (np.asarray(batch.branch) != PAD)
    assert roots.sum() == 2  # two trees: samples 0, 2, 3 in one; 1, 4 in another
    assert (np.asarray(batch.branch) == SHARED).sum() == len(samples[0].prefix) + len(samples[1].prefix)
    loss, grads = packed_value_and_grad(batch, LOSS)
    expected_loss, expected_grads = reference(tiny_model()[1], LOSS.coef)
    np.testing.assert_allclose(float(loss), float(expected_loss), atol=1e-5, rtol=0)
    assert_trees_close(grads, expected_grads)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ["planned", "packed", "one row"])
def test_prompt_trees_equal_two_forwards(layout, rows):
    """``share_prefix`` with prompts that begin alike: a row's prompts are one trie, each prefix token
    once; the loss and gradients are the independent objective's."""
    samples, reference = reference_case(trie=True)
    options = dict(seq_multiple=16, response_multiple=4, layout=layout, share_prefix=True)
    if rows == "one row":
        batch = build_batch(samples, pack=True, rows=[list(range(len(samples)))], **options)
    else:
        batch = build_batch(samples, pack=rows == "packed", row_tokens=64, **options)
    k = len(batch.sample) // len(batch.tokens)
    in_rows = [[samples[i] for i in batch.sample[r * k : (r + 1) * k] if i >= 0] for r in range(len(batch.tokens))]
    for r, members in enumerate(in_rows):
        assert (np.asarray(batch.branch[r]) == SHARED).sum() == trie_size(members)
    assert max(len({tuple(s.prefix) for s in m}) for m in in_rows) > 1  # some row shares a beginning
    loss, grads = packed_value_and_grad(batch, LOSS)
    expected_loss, expected_grads = reference(tiny_model()[1], LOSS.coef)
    np.testing.assert_allclose(float(loss), float(expected_loss), atol=1e-5, rtol=0)
    assert_trees_close(grads, expected_grads)


def test_prompt_tree_by_hand():
    """Three prompts [1 2 3], [1 2 3 5] and [1 2 4] in one row: the trie depth first, each prompt's
    branch after its last token; a token's ``reach`` is the end of its subtree, so the third
    prompt's tokens see [1 2] and not [3 ...], and the second sees [1 2 3] but not the first's branch."""
    a, b, c = (
        StepSample(prefix=p, tail=[7], response=y, old_logprobs=[-1.0] * len(y), advantage=1.0)
        for p, y in (([1, 2, 3], [8, 9]), ([1, 2, 4], [8]), ([1, 2, 3, 5], [9]))
    )
    batch = build_batch([a, b, c], seq_multiple=16, response_multiple=2, pack=True, rows=[[0, 1, 2]], share_prefix=True)
    real = slice(0, 12)
    np.testing.assert_array_equal(batch.tokens[0, real], [1, 2, 3, 7, 8, 9, 5, 7, 9, 4, 7, 8])
    np.testing.assert_array_equal(batch.positions[0, real], [0, 1, 2, 3, 4, 5, 3, 4, 5, 2, 3, 4])
    np.testing.assert_array_equal(batch.reach[0, real], [11, 11, 8, 5, 5, 5, 8, 8, 8, 11, 11, 11])
    assert (batch.reach[0, 12:] == PAD).all()
    np.testing.assert_array_equal(batch.without_index[:, :2], [[3, 4], [10, 0], [7, 0]])  # a, b, c (0: padding)
    mask = np.asarray(attention_mask(jnp.asarray(batch.reach)))[0].astype(int)
    assert mask[11, :12].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]  # b's response: [1 2 4 7 8]
    assert mask[7, :12].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]  # c's tail: [1 2 3 5 7]
    assert mask[12:].sum() == 0  # padding sees nothing


def test_shared_prefix_by_hand():
    """Two samples of one prompt, two-stream: the prefix once, each sample's without-rubric branch
    numbered ``WITHOUT + 2 q``; in the with-rubric stream their ``[insert tail]`` once, each
    response a branch ``WITH + 2 q``; each token sees the shared parts and its own branch."""
    a, b = (
        StepSample(
            prefix=[1, 2],
            insert=[9, 8],
            tail=[3],
            response=[4 + 2 * q, 5 + 2 * q],
            old_logprobs=[-1.0] * 2,
            advantage=q,
        )
        for q in range(2)
    )
    batch = build_batch([a, b], seq_multiple=8, response_multiple=2, layout="two-stream", share_prefix=True)
    np.testing.assert_array_equal(batch.tokens, [[1, 2, 3, 4, 5, 3, 6, 7]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 4, 2, 3, 4]])
    np.testing.assert_array_equal(batch.branch, [[SHARED] * 2 + [WITHOUT] * 3 + [WITHOUT + 2] * 3])
    np.testing.assert_array_equal(batch.reach, [[7, 7, 4, 4, 4, 7, 7, 7]])  # one tree: the prefix reaches both
    np.testing.assert_array_equal(batch.sample, [0, 1])
    np.testing.assert_array_equal(batch.without_index, [[2, 3], [5, 6]])  # 6 follows the second tail
    np.testing.assert_array_equal(batch.rubric_tokens, [[9, 8, 3, 4, 5, 6, 7, 0]])
    np.testing.assert_array_equal(batch.rubric_positions, [[2, 3, 4, 5, 6, 5, 6, 0]])
    np.testing.assert_array_equal(batch.rubric_branch, [[SHARED] * 3 + [WITH] * 2 + [WITH + 2] * 2 + [PAD]])
    np.testing.assert_array_equal(batch.with_index, [[2, 3], [2, 5]])  # 4 and 6 both follow the tail
    mask = np.asarray(attention_mask(jnp.asarray(batch.reach)))[0].astype(int)
    assert mask[6].tolist() == [1, 1, 0, 0, 0, 1, 1, 0]  # the second response: the prefix and its own branch
    seen = np.asarray(rubric_attention_mask(batch))[0].astype(int)
    assert seen[6].tolist() == [1, 1] + [0] * 6 + [1, 1, 1, 0, 0, 1, 1, 0]  # prefix, [insert tail], itself
    assert batch.token_counts() == (8 + 7, 8 + 8)
    # Without sharing, the same samples: two segments in two rows.
    alone = build_batch([a, b], seq_multiple=8, response_multiple=2, layout="two-stream")
    assert alone.tokens.shape[0] == 2 and alone.token_counts()[0] == 10 + 10


def test_row_tokens_let_long_samples_share_a_row():
    samples = [
        StepSample(prefix=[1, 2, 3], insert=[7] * k, tail=[4], response=[5], old_logprobs=[-1.0], advantage=1.0)
        for k in (2, 3)
    ]
    for layout in LAYOUTS:
        alone = build_batch(samples, seq_multiple=4, layout=layout, pack=True)
        shared = build_batch(samples, seq_multiple=4, layout=layout, pack=True, row_tokens=20)
        assert alone.tokens.shape[0] == 2 and shared.tokens.shape == (1, 20)
        assert (
            build_batch(samples, seq_multiple=4, layout=layout, row_tokens=20).tokens.shape == alone.tokens.shape
        )  # packing only


def test_packed_rows_by_hand():
    """First fit by decreasing length, samples with a with-rubric stream first: the two short
    samples share a row, the one with a rubric in slot 0; both rows hold a stream."""
    long = StepSample(
        prefix=[1, 2, 3, 4], insert=[9], tail=[5], response=[6, 7], old_logprobs=[-1.0, -1.0], advantage=1.0
    )
    short = [
        StepSample(
            prefix=[10 + i],
            tail=[20 + i],
            response=[30 + i],
            old_logprobs=[-2.0],
            advantage=-1.0,
            insert=[40 + i] if i else (),
        )
        for i in range(2)
    ]
    b = build_batch([short[0], long, short[1]], seq_multiple=8, response_multiple=2, layout="two-stream", pack=True)
    np.testing.assert_array_equal(b.tokens, [[1, 2, 3, 4, 5, 6, 7, 0], [11, 21, 31, 10, 20, 30, 0, 0]])
    np.testing.assert_array_equal(b.positions[1], [0, 1, 2, 0, 1, 2, 0, 0])
    np.testing.assert_array_equal(b.reach, [[6] * 7 + [-1], [2, 2, 2, 5, 5, 5, -1, -1]])  # row 1: two segments
    np.testing.assert_array_equal(b.sample, [1, -1, 2, 0])  # slots: row-major, 2 per row
    np.testing.assert_array_equal(b.sample_slots(), [3, 0, 2])
    np.testing.assert_array_equal(b.without_index[[2, 3], 0], [1, 4])  # 31 follows 21; 30 follows 20
    assert b.rubric_tokens.shape == (2, 8)  # both rows hold a stream
    np.testing.assert_array_equal(b.rubric_tokens[1], [41, 21, 31, 0, 0, 0, 0, 0])
    # The stream's tokens are one segment's: they see each other and, in the row, its prefix [11].
    np.testing.assert_array_equal(b.rubric_reach[1], [2, 2, 2, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(b.rubric_anchor[1], [0, 0, 0, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(b.with_index[2, 0], 1)  # 31 follows 21 in the rubric stream
    np.testing.assert_array_equal(b.head, [[0, 1], [0, 2]])  # the LM head: real slot tokens (not row 0 slot 1)
    mask = np.asarray(attention_mask(jnp.asarray(b.reach)))[1].astype(int)
    assert mask[4].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]  # sample 0 sees only its own tokens
    seen = np.asarray(rubric_attention_mask(b))[1].astype(int)
    assert seen[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0] + [1, 1, 0, 0, 0, 0, 0, 0]  # its prefix (slot 0) and itself


@pytest.mark.parametrize(
    "layout, shared", [("packed", False), ("two-stream", False), ("two-stream", True), ("two-stream", "trie")]
)
def test_frozen_bottom_layers_equal_two_forwards(layout, shared):
    """With the embedding and the first layer frozen (``ModelConfig.frozen_layers``, as cpu-demo),
    the loss is the independent objective's and the trained parameters' gradients are its
    gradients; the frozen ones get none (``trie``: prompts that begin alike share a tree)."""
    samples, reference = reference_case(shared is True, trie=shared == "trie")
    graphdef, params = tiny_model()
    frozen_graphdef, _ = nnx.split(
        nnx.eval_shape(lambda: CausalLM(dataclasses.replace(CONFIG, frozen_layers=1), nnx.Rngs(0)))
    )
    batch = build_batch(samples, seq_multiple=16, response_multiple=4, layout=layout, share_prefix=bool(shared))

    def f(p):
        loss_sum, count, _, _ = OrsdLoss(LOSS)(nnx.merge(frozen_graphdef, p), batch)
        return loss_sum / count

    loss, grads = jax.jit(jax.value_and_grad(f))(params)
    expected_loss, expected_grads = reference(params, LOSS.coef)
    np.testing.assert_allclose(float(loss), float(expected_loss), atol=1e-5, rtol=0)
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected_grads)):
        name, g, e = jax.tree_util.keystr(path), np.asarray(g), np.asarray(e)
        if "layers" in name:
            np.testing.assert_array_equal(g[:1], 0, err_msg=name)
            np.testing.assert_allclose(g[1:], e[1:], atol=1e-5, rtol=1e-5, err_msg=name)
        elif "embed" in name:
            np.testing.assert_array_equal(g, 0)
        else:
            np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5, err_msg=name)


def test_two_stream_layout_by_hand():
    with_rubric = StepSample(
        prefix=[11, 12], insert=[21, 22, 23], tail=[31], response=[41, 42], old_logprobs=[-1.0, -2.0], advantage=0.5
    )
    plain = StepSample(
        prefix=[13], tail=[32, 33], response=[43, 44, 45], old_logprobs=[-3.0, -4.0, -5.0], advantage=-1.0
    )
    b = build_batch([with_rubric, plain], seq_multiple=4, response_multiple=4, batch_multiple=4, layout="two-stream")
    # The without-rubric stream: [prefix | tail response], plain positions.
    np.testing.assert_array_equal(b.tokens[:2], [[11, 12, 31, 41, 42, 0, 0, 0], [13, 32, 33, 43, 44, 45, 0, 0]])
    np.testing.assert_array_equal(b.positions[0], [0, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(b.branch[:2], [[0, 0, 2, 2, 2, -1, -1, -1], [0, 2, 2, 2, 2, 2, -1, -1]])
    np.testing.assert_array_equal(b.without_index[:2], [[2, 3, 0, 0], [2, 3, 4, 0]])
    # The with-rubric stream continues the prefix at position 2.
    np.testing.assert_array_equal(b.rubric_tokens[0], [21, 22, 23, 31, 41, 42, 0, 0])
    np.testing.assert_array_equal(b.rubric_positions[0], [2, 3, 4, 5, 6, 7, 0, 0])
    np.testing.assert_array_equal(b.rubric_branch[0], [SHARED] * 4 + [WITH] * 2 + [PAD] * 2)  # [insert tail], response
    np.testing.assert_array_equal(b.rubric_reach[0], [5] * 6 + [-1] * 2)  # one prompt's stream
    np.testing.assert_array_equal(b.rubric_anchor[0], [1] * 6 + [-1] * 2)  # it reads the prefix [11 12]
    np.testing.assert_array_equal(b.sample, [0, 1, -1, -1])
    # It sees its prefix (cache slots 0-1) and itself (slots 8 + its index), causally.
    seen = np.asarray(rubric_attention_mask(b))[0].astype(int)
    np.testing.assert_array_equal(seen[2], [1, 1, 0, 0, 0, 0, 0, 0] + [1, 1, 1, 0, 0, 0, 0, 0])
    assert not seen[6:].any() and not np.asarray(rubric_attention_mask(b))[1].any()
    np.testing.assert_array_equal(b.with_index[0], [3, 4, 0, 0])  # 41 follows 31 (index 3), 42 follows 41
    assert (b.rubric_branch[1:] == PAD).all()  # no rubric, no stream
    # Without any rubric there is no with-rubric stream to build or run.
    alone = build_batch([plain], seq_multiple=4, layout="two-stream")
    assert not alone.two_stream and alone.token_counts() == (6, 8)
    # Read: prefix + tail + response twice, the rubric once; slots with their padding.
    assert b.token_counts() == (2 + 1 + 2 + 6 + 1 + 2 + 3, 4 * 8 + 4 * 8)


def test_coef_zero_is_plain_grpo():
    samples, reference = reference_case()
    config = dataclasses.replace(LOSS, coef=0.0)
    batch = build_batch(samples, seq_multiple=16)
    loss, grads = packed_value_and_grad(batch, config)
    expected_loss, expected_grads = reference(tiny_model()[1], 0.0)
    np.testing.assert_allclose(float(loss), float(expected_loss), atol=1e-5, rtol=0)
    assert_trees_close(grads, expected_grads)
    # GRPO's own batch carries no with-rubric branch at all, and gives the same loss.
    grpo_batch = build_batch([dataclasses.replace(s, insert=()) for s in samples], seq_multiple=16)
    assert not grpo_batch.has_rubric.any() and (grpo_batch.branch != WITH).all()
    # Tokens: P + S + Y per GRPO row; P + (R + S + Y) + (S + Y) per row with a rubric.
    sizes = [(len(s.prefix), len(s.insert), len(s.tail), len(s.response)) for s in samples]
    assert (grpo_batch.branch != PAD).sum() == sum(p + t + y for p, _, t, y in sizes)
    assert (batch.branch != PAD).sum() == sum(p + (r + t + y if r else 0) + t + y for p, r, t, y in sizes)
    graphdef, params = tiny_model()
    loss_sum, count, _, _ = jax.jit(lambda p, b: OrsdLoss(config)(nnx.merge(graphdef, p), b))(params, grpo_batch)
    np.testing.assert_allclose(float(loss_sum / count), float(expected_loss), atol=1e-5, rtol=0)


def test_kl_to_a_reference_model_in_the_same_step():
    """With no reference log-probs in the batch, the step's reference model gives them: the loss and
    gradients equal the independent objective whose reference log-probs come from plain forwards of
    the reference's own weights (another random model here), and none flows into the reference."""
    from orsd_jax.train_step import loss_and_grads

    samples, reference = reference_case()
    graphdef, params = tiny_model()
    _, ref_params = tiny_model(seed=1)
    width = max(len(s.response) for s in samples)
    ref_logp, _ = sequence_logprobs(
        graphdef,
        ref_params,
        [[*s.prefix, *s.tail, *s.response] for s in samples],
        [len(s.prefix) + len(s.tail) for s in samples],
        width,
    )
    batch = build_batch([dataclasses.replace(s, ref_logprobs=None) for s in samples], seq_multiple=16)
    assert batch.ref_logp is None
    step = jax.jit(lambda p, b, r: loss_and_grads(OrsdLoss(LOSS), graphdef, p, b, reference=r)[:2])
    grads, loss = step(params, batch, ref_params)
    expected_loss, expected_grads = reference(params, LOSS.coef, ref_logp)
    np.testing.assert_allclose(float(loss), float(expected_loss), atol=1e-5, rtol=0)
    assert_trees_close(grads, expected_grads)
    # The KL term matters: with the samples' own (other) reference log-probs the loss differs.
    assert abs(float(reference(params, LOSS.coef)[0]) - float(loss)) > 1e-4
