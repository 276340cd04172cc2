"""The PyTorch baseline step (``benchmarks/torch_step.py``) against the JAX one on the tiny random
model of ``test_loss``: the same loss, the same gradients per Hugging Face tensor, the same update."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import CONFIG, LOSS, RUBRIC_ROWS, make_samples, tiny_model

from benchmarks.torch_step import make_torch_step
from orsd_jax.batch import build_batch
from orsd_jax.loss import OrsdLoss
from orsd_jax.models import CausalLM, hf_tensors
from orsd_jax.train_step import OptimizerConfig, loss_and_grads, make_optimizer

# A large learning rate, so the update is far above float32 noise; grad_clip 1 clips (the norm is 7).
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip=1.0)


def jax_step(graphdef, params, batch, frozen_layers):
    """``(loss, grads, grad_norm, params after)``: the body of ``make_train_step``'s step (loss and
    gradients of ``loss_and_grads``, ``make_optimizer``'s clipping and AdamW) on one device, jitted
    here: the jitted step does not hand back its gradients."""
    optimizer = make_optimizer(OPTIMIZER, frozen_layers)

    def step(params, batch):
        grads, loss, _, _ = loss_and_grads(OrsdLoss(LOSS), graphdef, params, batch)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return loss, grads, optax.tree.norm(grads), optax.apply_updates(params, updates)

    return jax.jit(step)(params, batch)


# Gradient checkpointing recomputes the same forward: the second case checks it changes nothing.
@pytest.mark.parametrize(("frozen_layers", "remat"), [(0, False), (1, True)])
def test_torch_step_equals_jax_step(frozen_layers, remat):
    samples = make_samples(RUBRIC_ROWS)
    _, params = tiny_model()
    config = dataclasses.replace(CONFIG, frozen_layers=frozen_layers)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    model = nnx.merge(graphdef, params)
    before = hf_tensors(model)
    step = make_torch_step(model, samples, LOSS, OPTIMIZER, frozen_layers=frozen_layers, remat=remat)

    # The oracle: the JAX train step on the packed batch, its gradients (before clipping) included.
    batch = build_batch(samples, seq_multiple=16, response_multiple=4)
    jax_loss, jax_grads, jax_grad_norm, jax_after = jax_step(graphdef, params, batch, frozen_layers)
    jax_grads = hf_tensors(nnx.merge(graphdef, jax_grads))

    metrics = step.backward()
    np.testing.assert_allclose(metrics["loss"], float(jax_loss), atol=1e-5, rtol=0)
    torch_params = dict(step.model.named_parameters())
    assert set(torch_params) == set(jax_grads)  # untied: one tensor per name, the LM head included
    frozen = {f"model.layers.{i}." for i in range(frozen_layers)} | (
        {"model.embed_tokens."} if frozen_layers else set()
    )
    for name, p in torch_params.items():
        if any(name.startswith(prefix) for prefix in frozen):
            assert p.grad is None and not p.requires_grad, name
            np.testing.assert_array_equal(jax_grads[name], 0, err_msg=name)  # JAX's stop-gradient: none either
        else:
            np.testing.assert_allclose(p.grad.numpy(), jax_grads[name], atol=1e-5, rtol=1e-4, err_msg=name)
    step.optimizer.zero_grad(set_to_none=True)

    # One whole step: loss and grad norm at the start, then the parameters after AdamW.
    metrics = step()
    np.testing.assert_allclose(metrics["loss"], float(jax_loss), atol=1e-5, rtol=0)
    np.testing.assert_allclose(metrics["grad_norm"], float(jax_grad_norm), rtol=1e-5)
    assert metrics["grad_norm"] > OPTIMIZER.grad_clip  # clipping is part of what is compared
    after = hf_tensors(nnx.merge(graphdef, jax_after))
    for name, p in step.model.named_parameters():
        torch_after = p.detach().numpy()
        if any(name.startswith(prefix) for prefix in frozen):
            np.testing.assert_array_equal(torch_after, before[name], err_msg=name)  # not even weight decay
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
            continue
        # Adam's first update is lr * u / (|u| + eps), u = c g the clipped gradient (c = 1 / 7 here):
        # about lr * sign(g), and its sensitivity to g is lr * eps / (c g^2). The two gradients agree
        # to ~1e-6 absolute, so where |g| < ~1e-5 the updates may differ by more than 1e-5 (up to
        # opposite signs near 0); the comparison skips those (0.3% of the weights). Exact zeros
        # (embedding rows of unseen tokens) move by weight decay alone, in both.
        g = np.abs(jax_grads[name])
        well_defined = (g > 3e-5) | (g == 0)
        assert well_defined.mean() > 0.95, name
        np.testing.assert_allclose(
            torch_after[well_defined], after[name][well_defined], atol=1e-5, rtol=0, err_msg=name
        )
        assert np.abs(torch_after - before[name]).max() > 1e-3  # the update itself is far above the tolerance
