"""The train step: exact micro-batching, the optimizer, FSDP specs, (in a 4-device subprocess) the
sharded step against the single-device one, and the epochs' minibatch orders."""

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import LOSS, UNOPTIMISED, assert_trees_close, make_samples, tiny_model
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from orsd_jax import seeds
from orsd_jax.batch import StepSample, build_batch
from orsd_jax.loss import OrsdLoss
from orsd_jax.minibatches import MinibatchSpec, epoch_orders, minibatch, update_steps
from orsd_jax.train_step import OptimizerConfig, fsdp_spec, loss_and_grads, make_mesh, make_optimizer

HERE = pathlib.Path(__file__).resolve().parent


@functools.partial(jax.jit, static_argnums=2)
def _loss_and_grads(params, batch, micro_batches):
    return loss_and_grads(OrsdLoss(LOSS), tiny_model()[0], params, batch, micro_batches)


@jax.jit
def _loss_sums(params, batch):
    loss_sum, count, sums, _ = OrsdLoss(LOSS)(nnx.merge(tiny_model()[0], params), batch)
    return loss_sum, count, sums


MIXED = (True, False, True, True, False, True, False, True)


@pytest.mark.parametrize(
    "layout, pack, rubrics, micro",
    [("packed", False, MIXED, 4), ("two-stream", True, MIXED, 4), ("two-stream", True, (True,) + (False,) * 7, 2)],
)
def test_micro_batches_equal_one_batch(layout, pack, rubrics, micro):
    # Eight samples of different response lengths: a mean of micro-batch means would differ. With
    # ``pack`` rows hold several samples, and a micro-batch takes its rows' sample slots along, and
    # the rows of the with-rubric stream (the first ones) when it has fewer.
    samples = make_samples(rubrics, seed=1)
    batch = build_batch(samples, seq_multiple=16, batch_multiple=micro, layout=layout, pack=pack)
    assert (batch.response.shape[0] > batch.tokens.shape[0]) == pack
    if rubrics.count(True) == 1:
        assert batch.rubric_tokens.shape[0] == micro < batch.tokens.shape[0]  # one stream row, padded
    params = tiny_model()[1]
    grads, loss, metrics, values = _loss_and_grads(params, batch, 1)
    grads4, loss4, metrics4, values4 = _loss_and_grads(params, batch, micro)
    np.testing.assert_allclose(float(loss4), float(loss), atol=1e-5, rtol=0)
    assert_trees_close(grads4, grads)
    assert_trees_close(values4, values)  # per-token values back in row order
    assert set(metrics4) == set(metrics)
    for key in metrics:
        np.testing.assert_allclose(float(metrics4[key]), float(metrics[key]), atol=1e-5, rtol=1e-5, err_msg=key)
    assert float(metrics["tokens"]) == sum(len(s.response) for s in samples)


def test_optimizer_clips_then_adamw():
    # One update on a toy tree against AdamW written out: gradient norm 5 clipped to 1, then
    # m = 0.1 g, v = 0.001 g^2, bias-corrected to g and g^2, update lr * (g / (|g| + eps) + wd * p).
    config = OptimizerConfig(learning_rate=0.1, weight_decay=0.5, grad_clip=1.0)
    params = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([[0.5]])}
    grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[-4.0]])}
    optimizer = make_optimizer(config)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    for key in params:
        p, g = np.asarray(params[key]), np.asarray(grads[key]) / 5.0
        expected = p - 0.1 * (g / (np.abs(g) + config.eps) + 0.5 * p)
        np.testing.assert_allclose(np.asarray(new[key]), expected, rtol=1e-5)


def test_warmup_raises_the_rate_linearly():
    # A constant gradient makes Adam's bias-corrected direction exactly sign(g) at every step, so
    # step k moves the parameter by lr (k+1)/N until k+1 = N, then by lr (no clipping, no decay).
    config = OptimizerConfig(learning_rate=0.1, weight_decay=0.0, grad_clip=1e9, eps=0.0, warmup_steps=4)
    optimizer = make_optimizer(config)
    params, grads = {"w": jnp.array([1.0])}, {"w": jnp.array([2.0])}
    state, moves = optimizer.init(params), []
    for _ in range(6):
        updates, state = optimizer.update(grads, state, params)
        moves.append(float(updates["w"][0]))
    np.testing.assert_allclose(moves, [-0.025, -0.05, -0.075, -0.1, -0.1, -0.1], rtol=1e-4)  # f32


def test_fsdp_spec_rule():
    layers = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey("attn"), jax.tree_util.DictKey("q"))
    embed = (jax.tree_util.DictKey("embed"),)
    # Stacked [L, D, N, H]: never the layer axis (8), the largest dividing axis (D = 32) instead.
    assert fsdp_spec(layers, (8, 32, 4, 8), 4) == P(None, "data", None, None)
    assert fsdp_spec(embed, (96, 32), 4) == P("data", None)
    assert fsdp_spec(embed, (90, 32), 4) == P(None, "data")
    assert fsdp_spec(embed, (90, 30), 4) == P()  # nothing divides: replicated
    assert fsdp_spec(embed, (96, 32), 1) == P()


def test_mesh_is_auto_data_axis():
    mesh = make_mesh()
    assert mesh.axis_names == ("data",) and mesh.axis_types == (AxisType.Auto,)
    assert mesh.shape["data"] == jax.device_count()


def test_sharded_step_equals_single_device():
    env = {**os.environ, **UNOPTIMISED, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "sharded_step_check.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(np.isfinite(out["single_loss"]))
    for name in ("replicated", "fsdp", "two-stream", "prompt trees"):
        assert out[name]["steps"] == 2
        assert out[name]["param_diff"] < 1e-5, (name, out[name]["param_diff"])
        assert out[name]["metric_diff"] < 1e-5, (name, out[name]["metric_diff"])
    assert set(out["replicated"]["specs"].values()) == {"P()"}
    fsdp = out["fsdp"]["specs"]
    # Each parameter and its momentum split along the same axis; the layer axis never.
    for where in (".params", ".opt_state[1][0].trace"):
        assert fsdp[where + "['embed'].value"] == "P('data', None)"
        assert fsdp[where + "['layers']['mlp']['gate'].value"] == "P(None, None, 'data')"  # [L, 32, 64]
        assert fsdp[where + "['layers']['attn']['o'].value"] == "P(None, None, None, 'data')"  # [L, 4, 8, 32]
    assert fsdp[".step"] == "P()"


def test_frozen_layers_stay_put():
    """The embedding and the first layers do not move, weight decay included; the rest does."""
    graphdef, params = tiny_model()
    grads = jax.tree.map(jnp.ones_like, params)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.5), frozen_layers=1)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    for (path, old), (_, moved) in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(new)
    ):
        name = jax.tree_util.keystr(path)
        old, moved = np.asarray(old), np.asarray(moved)
        if "layers" in name:
            np.testing.assert_array_equal(moved[:1], old[:1], err_msg=name)
            assert np.all(moved[1:] != old[1:]), name
        elif "embed" in name:
            np.testing.assert_array_equal(moved, old)
        else:
            assert np.all(moved != old), name


def test_by_prompt_order_keeps_a_prompts_samples_together():
    """``minibatch_order``: ``shuffled`` is the plain permutation; ``by-prompt`` holds every sample
    once per epoch, each prompt's samples next to each other, the prompts in a seeded random order."""
    samples = make_samples((True,) * 9, prompt_of=(0, 1, 0, 3, 1, 0, 6, 7, 3))
    generator = seeds.rng(0, 1)
    expected = [generator.permutation(9) for _ in range(2)]
    for got, want in zip(epoch_orders(samples, 2, seeds.rng(0, 1), "shuffled"), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    orders = [epoch_orders(samples, 3, seeds.rng(seed), "by-prompt") for seed in range(4)]
    for order in (o for epochs in orders for o in epochs):
        assert sorted(order) == list(range(9))
        prompts = [tuple(samples[i].prefix) for i in order]
        runs = [p for k, p in enumerate(prompts) if k == 0 or p != prompts[k - 1]]
        assert len(runs) == len(set(prompts)) == 5  # one run of each prompt
    assert len({tuple(o) for epochs in orders for o in epochs}) > 1  # the prompts' order is shuffled
    with pytest.raises(ValueError, match="minibatch order"):
        epoch_orders(samples, 1, seeds.rng(0), "sorted")


def test_packed_order_deals_the_updates_rows_in_one_shape():
    """``minibatch_order="packed"``: each epoch holds every sample once, a prompt's samples in one
    row, ``ceil(N / rows)`` steps of one batch shape; each step's loss equals that of the same
    samples packed on their own (``build_batch``'s own rows: the padding and the other rows add
    nothing), and samples that do not fit a shape are refused."""
    prompt_of = (0, 1, 0, 3, 1, 0, 6, 7, 3, 9, 10)
    samples = make_samples((True, False, True, True, False, True, False, False, True, True, False), prompt_of=prompt_of)
    spec = MinibatchSpec(rows=4, layout="two-stream", row_multiple=2, seq_multiple=16)
    steps = update_steps(samples, 2, seeds.rng(0, 1), "packed", spec)
    assert [s.epoch for s in steps] == [0, 0, 0, 1, 1, 1]  # ceil(11 / 4) a epoch
    params = tiny_model()[1]
    for epoch in (0, 1):
        dealt = [i for s in steps if s.epoch == epoch for i in s.samples]
        assert sorted(dealt) == list(range(11))
    assert len({s.shape for s in steps}) == 1 and steps[0].shape.rows % 2 == 0
    for step in steps:
        chosen = [samples[i] for i in step.samples]
        rows = [[step.samples[j] for j in row] for row in step.rows]
        for prompt in {prompt_of[i] for i in step.samples}:  # a prompt's samples share a row
            assert sum(any(prompt_of[i] == prompt for i in row) for row in rows) == 1
        batch = minibatch(chosen, spec, step)
        shape = step.shape
        if step.epoch:  # the loss below: the first epoch's steps (their compilations are the test's time)
            continue
        assert batch.tokens.shape == (shape.rows, shape.tokens)
        assert batch.response.shape == (shape.rows * shape.slots, shape.response)
        assert batch.rubric_tokens is None or batch.rubric_tokens.shape == (shape.rows, shape.stream)
        own = build_batch(chosen, seq_multiple=16, layout="two-stream", pack=True, share_prefix=True)
        # The forward's sums (their gradients: the micro-batch test's), for less compilation.
        (got, got_count, got_sums), (want, want_count, want_sums) = (_loss_sums(params, b) for b in (batch, own))
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-6)
        assert float(got_count) == float(want_count) == sum(len(s.response) for s in chosen)
        for name in ("gap", "rubric_tokens"):
            np.testing.assert_allclose(float(got_sums[name]), float(want_sums[name]), rtol=1e-5, atol=1e-5)
    assert len({s.samples for s in steps}) == 6  # the epochs deal different rows
    first = next(s for s in steps if 0 in s.samples)  # prompt 0's three samples: a row of 3 slots at least
    chosen = [samples[i] for i in first.samples]
    with pytest.raises(ValueError, match="slots"):
        minibatch(chosen, spec, dataclasses.replace(first, shape=dataclasses.replace(first.shape, slots=2)))
    with pytest.raises(ValueError, match="more than its"):
        minibatch(chosen, spec, dataclasses.replace(first, shape=dataclasses.replace(first.shape, tokens=8)))


def test_packed_order_weighs_the_keys_a_row_reads():
    """Eight 20-token samples: rows of 40 tokens pair them (fewer padded slots than rows of 24), and
    the packed order takes them; when attention weighs in (``attention_tokens``: a row of t tokens
    costs t (1 + t / 16)) pairs read too many keys, and rows of one sample win."""
    samples = [
        StepSample(prefix=[i] * 16, tail=[1], response=[2, 3, 4], old_logprobs=[-1.0] * 3, advantage=1.0)
        for i in range(8)
    ]
    spec = MinibatchSpec(rows=4, layout="packed", seq_multiple=8)
    plain = update_steps(samples, 1, seeds.rng(0), "packed", spec)
    weighed = update_steps(samples, 1, seeds.rng(0), "packed", dataclasses.replace(spec, attention_tokens=16.0))
    assert [s.shape.tokens for s in plain] == [40, 40] and plain[0].shape.rows == 2
    assert [s.shape.tokens for s in weighed] == [24, 24] and weighed[0].shape.rows == 4
