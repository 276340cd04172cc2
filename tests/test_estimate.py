"""The estimator against real models, XLA's own FLOP and memory accounting, and published sizes."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tiny_model

from benchmarks.warmstart import pass_flops, update_flops
from orsd_jax.batch import StepSample, attention_mask, build_batch
from orsd_jax.estimate import QWEN3_1_7B, QWEN3_4B, estimate, forward_flops, param_count, step_flops
from orsd_jax.loss import LossConfig, OrsdLoss
from orsd_jax.models import CausalLM, ModelConfig
from orsd_jax.train_step import loss_and_grads
from orsd_jax.warmstart import SupervisedLoss

LLAMA = ModelConfig(
    "llama",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
)
QWEN = ModelConfig(
    "qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12
)


def _abstract_params(config):
    return nnx.state(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))


@pytest.mark.parametrize("config", [LLAMA, QWEN], ids=["llama-tied", "qwen3-untied"])
def test_param_count_and_bytes_match_the_model(config):
    params = _abstract_params(config)
    assert param_count(config) == sum(x.size for x in jax.tree.leaves(params))
    e = estimate(config, rows=8, seq_len=64, response_len=16, devices=1)
    assert e.param_bytes == e.grad_bytes == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    adam = jax.eval_shape(optax.adamw(1e-3).init, params)
    assert e.optimizer_bytes == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adam) if x.ndim)


def test_published_qwen3_sizes():
    # Qwen's model cards: 1.7B (1.4B without embeddings) and 4.0B (3.6B without embeddings).
    for config, total, body in [(QWEN3_1_7B, 1.7, 1.4), (QWEN3_4B, 4.0, 3.6)]:
        n = param_count(config)
        assert round(n / 1e9, 1) == total
        assert round((n - config.vocab_size * config.hidden_size) / 1e9, 1) == body


def _packed_batch(rows=4):
    rng = np.random.RandomState(0)
    samples = [
        StepSample(
            prefix=rng.randint(0, 512, 200).tolist(),
            insert=rng.randint(0, 512, 50).tolist(),
            tail=[1, 2, 3],
            response=rng.randint(0, 512, 24).tolist(),
            old_logprobs=[-1.0] * 24,
            advantage=1.0,
        )
        for _ in range(rows)
    ]
    return build_batch(samples, seq_multiple=64, response_multiple=32)


def test_forward_flops_match_xla():
    # One layer: XLA counts a scan's body once. The LM head runs in one chunk for the same reason.
    config = dataclasses.replace(LLAMA, num_layers=1)
    graphdef, params = tiny_model(config)
    batch = _packed_batch()
    loss = OrsdLoss(LossConfig(chunk_size=64))
    compiled = jax.jit(lambda p, b: loss(nnx.merge(graphdef, p), b)).lower(params, batch).compile()
    xla = compiled.cost_analysis()["flops"]
    ours = forward_flops(config, 4, batch.tokens.shape[1], 2 * batch.response.shape[1])
    assert abs(ours / xla - 1) < 0.05, (ours, xla)


@pytest.mark.parametrize("frozen", [0, 2])
def test_activation_memory_near_xla(frozen):
    # XLA's scratch for the loss and gradients of a 3-layer model (no remat) on CPU, every layer
    # trained or the bottom two frozen (cpu-demo's fine-tune: their activations are not kept).
    config = dataclasses.replace(LLAMA, frozen_layers=frozen)
    graphdef, params = tiny_model(config)
    batch = _packed_batch()
    loss = OrsdLoss(LossConfig(chunk_size=64))
    compiled = jax.jit(lambda p, b: loss_and_grads(loss, graphdef, p, b)).lower(params, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    e = estimate(config, rows=4, seq_len=batch.tokens.shape[1], response_len=batch.response.shape[1], devices=1)
    assert 0.75 < temp / (e.activation_bytes + e.grad_bytes) < 1.33, (temp, e.activation_bytes)


def test_layouts_and_verdicts_for_the_paper():
    shape = dict(rows=64, seq_len=3344, response_len=512, devices=4, micro_batches=16)
    for config in (QWEN3_1_7B, QWEN3_4B):
        base = estimate(dataclasses.replace(config, compute_dtype="bfloat16"), **shape)
        fsdp = estimate(dataclasses.replace(config, compute_dtype="bfloat16"), fsdp=True, **shape)
        remat = estimate(dataclasses.replace(config, compute_dtype="bfloat16", remat=True), **shape)
        assert fsdp.optimizer_bytes == base.optimizer_bytes / 4 and fsdp.param_bytes == base.param_bytes / 4
        assert base.accumulator_bytes == param_count(config) * 4  # float32, only with micro-batches
        assert estimate(config, **(shape | {"micro_batches": 1})).accumulator_bytes == 0
        assert remat.activation_bytes < base.activation_bytes / 10 and remat.flops == base.flops * 4 / 3
    # Qwen3-4B with float32 AdamW does not fit replicated on an 80 GB device, even with remat; with
    # FSDP over 4 devices it does. Qwen3-1.7B fits replicated with remat.
    bf16 = lambda c, **kw: dataclasses.replace(c, compute_dtype="bfloat16", **kw)  # noqa: E731
    assert not estimate(bf16(QWEN3_4B, remat=True), **shape).fits
    assert estimate(bf16(QWEN3_4B, remat=True), fsdp=True, **shape).fits
    assert estimate(bf16(QWEN3_1_7B, remat=True), **shape).fits
    # The FLOPs of an update: about 6 x parameters x tokens, plus attention.
    e = estimate(QWEN3_4B, **shape)
    body = param_count(QWEN3_4B) - QWEN3_4B.vocab_size * QWEN3_4B.hidden_size
    assert 1.0 < e.flops / (6 * body * 64 * 3344) < 1.5


def test_warm_start_flops_match_xla():
    """``benchmarks.warmstart``'s counts of a packed warm-start batch against XLA's: the frozen
    layer's forward, and an update of the trained layer on given frozen states (forward and
    backward). Ours are matmuls only, so they sit a little below XLA's, which also counts the
    element-wise work: a lower bound on the time, as the benchmark uses them."""
    config = dataclasses.replace(LLAMA, num_layers=2, frozen_layers=1)  # one layer per scan: XLA counts a body once
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    rng = np.random.RandomState(0)
    samples = [
        StepSample(
            prefix=rng.randint(0, 512, n).tolist(),
            tail=[1, 2],
            response=rng.randint(0, 512, y).tolist(),
            old_logprobs=[0.0] * y,
            advantage=0.0,
        )
        for n, y in [(200, 20), (150, 30), (90, 10), (240, 16)]
    ]
    batch = build_batch(
        samples, seq_multiple=64, response_multiple=32, pack=True, row_tokens=512, rows=[[0, 1], [2, 3]], slots=2
    )

    def frozen_pass(p, b):
        return nnx.merge(graphdef, p).frozen_states(b.tokens, b.positions, mask=attention_mask(b.reach))

    xla_pass = jax.jit(frozen_pass).lower(params, batch).compile().cost_analysis()["flops"]
    with_states = dataclasses.replace(batch, frozen=np.zeros((*batch.tokens.shape, config.hidden_size), np.float32))
    update = jax.jit(lambda p, b: loss_and_grads(SupervisedLoss(), graphdef, p, b)[0])
    xla_update = update.lower(params, with_states).compile().cost_analysis()["flops"]
    for ours, xla in [(pass_flops(config, batch), xla_pass), (update_flops(config, batch), xla_update)]:
        assert 0.85 < ours / xla <= 1.0, (ours, xla)


@pytest.mark.parametrize("layout", ["packed", "two-stream"])
def test_step_flops_of_rows_of_two_samples_match_xla(layout):
    """Rows of two sample slots run the LM head at their responses' positions only (``Batch.head``:
    32 a row here, not the slots' 2 x 32): with a large vocabulary (the head is most of the work)
    ``step_flops`` stays within 10% of XLA's count of the train step."""
    config = dataclasses.replace(LLAMA, vocab_size=8192, num_layers=1)  # one layer: XLA counts a scan body once
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    rng = np.random.RandomState(0)
    samples = [
        StepSample(
            prefix=rng.randint(0, 512, n).tolist(),
            insert=rng.randint(0, 512, 40).tolist(),
            tail=[1, 2],
            response=rng.randint(0, 512, y).tolist(),
            old_logprobs=[-1.0] * y,
            advantage=1.0,
        )
        for n, y in [(200, 20), (150, 8), (90, 12), (240, 4)]
    ]
    batch = build_batch(
        samples,
        seq_multiple=64,
        response_multiple=32,
        pack=True,
        row_tokens=1024,
        rows=[[0, 3], [1, 2]],
        slots=2,
        layout=layout,
    )
    assert batch.response.shape == (4, 32) and batch.head.shape == (2, 32)
    loss = OrsdLoss(LossConfig(chunk_size=64))
    xla = jax.jit(lambda p, b: loss_and_grads(loss, graphdef, p, b)[0]).lower(params, batch).compile().cost_analysis()
    assert 0.9 < step_flops(config, batch) / xla["flops"] < 1.1
