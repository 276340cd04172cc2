"""The update: gradients of a summed loss over micro-batches, global-norm clipping, AdamW; jit-compiled
over a device mesh.

Data parallelism is ``jax.jit`` with ``NamedSharding``: the batch is split over the mesh axis
``"data"``, parameters and optimizer state are replicated (``P()``) or FSDP-sharded (each array's
largest non-layer axis that the device count divides), and XLA inserts the collectives
(all-reduce of gradients; all-gather of FSDP weights). No ``pmap`` (in maintenance mode since
JAX 0.8) and no ``shard_map``: the step is written for one device and runs on any mesh.

A loss is any object with ``__call__(model, batch) -> (loss_sum, token_count, metric_sums)`` and
``metrics(metric_sums, token_count) -> dict``; ``orsd_jax.loss.OrsdLoss`` is one. A step built
``with_reference`` also hands the loss a frozen reference model (``__call__(model, batch,
reference)``): its parameters stay on the devices, sharded like the policy's. Sums make the
token mean exact under micro-batching: gradients of the sums are added over micro-batches and
divided once by the total token count.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from orsd_jax import distributed
from orsd_jax.batch import Batch

if TYPE_CHECKING:
    from orsd_jax.models import CausalLM

DATA = "data"


class Loss(Protocol):
    """``(model, batch[, reference]) -> (loss_sum, token_count, metric_sums, per_row)``: ``per_row``
    holds ``[B, ...]`` arrays the step hands back as they are (e.g. per-token values), possibly
    none; ``reference`` is a frozen model, given only to steps built ``with_reference`` (so it is
    not in the signature below: other losses need not take it)."""

    def __call__(
        self, model: CausalLM, batch: Batch
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], dict[str, jax.Array]]: ...

    def metrics(self, sums: Mapping[str, ArrayLike], token_count: ArrayLike) -> dict[str, jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """verl-agent's actor: AdamW, lr 1e-6, weight decay 0.01, gradient norm clipped to 1, constant LR
    (no warmup)."""

    learning_rate: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    # The rate rises linearly over the first N optimizer steps (lr (k+1)/N at step k). Adam's first
    # step moves every parameter by the full rate whatever its gradient's noise: at lr 5e-4 the
    # cpu-demo's first update broke the answer format (docs/results/study.md, attempt 2).
    warmup_steps: int = 0


def make_optimizer(config: OptimizerConfig = OptimizerConfig(), frozen_layers: int = 0) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; with ``frozen_layers`` (see ``ModelConfig``) the updates of
    the embedding and of the first layers are zeroed last, so weight decay does not move them either."""
    chain = [
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(learning_rate(config), config.b1, config.b2, config.eps, weight_decay=config.weight_decay),
    ]
    if frozen_layers:
        chain.append(freeze_first_layers(frozen_layers))
    return optax.chain(*chain)


def learning_rate(config: OptimizerConfig) -> float | optax.Schedule:
    if not config.warmup_steps:
        return config.learning_rate  # a constant keeps the optimizer state of runs without warmup
    return lambda count: config.learning_rate * jnp.minimum(1.0, (count + 1) / config.warmup_steps)


def freeze_first_layers(n: int) -> optax.GradientTransformation:
    """Zeroes the updates of the embedding and of rows ``[:n]`` of the stacked ``[L]`` layer parameters."""

    def freeze(path, update):
        names = [getattr(key, "key", None) for key in path]
        if "layers" in names:
            return update.at[:n].set(0)
        return jnp.zeros_like(update) if "embed" in names else update

    def update_fn(updates, state, params=None):
        return jax.tree_util.tree_map_with_path(freeze, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


@flax.struct.dataclass
class TrainState:
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # int32[]: updates applied


def _initial_state(optimizer: optax.GradientTransformation, params: nnx.State) -> TrainState:
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def init_train_state(
    model: nnx.Module, optimizer: optax.GradientTransformation, mesh: Mesh, fsdp: bool = False
) -> tuple[nnx.GraphDef, TrainState, Any]:
    """``(graphdef, state, state_sharding)``: the model's static graph, and its train state placed on
    ``mesh`` (replicated, or FSDP-sharded) with the optimizer state created in place."""
    graphdef, params = nnx.split(model)
    if distributed.multi():  # each process's own copy of the weights, as one replicated input
        params = jax.tree.map(np.asarray, params)
    init = functools.partial(_initial_state, optimizer)
    sharding = state_shardings(jax.eval_shape(init, params), mesh, fsdp)
    return graphdef, jax.jit(init, out_shardings=sharding)(params), sharding


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D ``"data"`` mesh over the first ``num_devices`` devices (all by default), auto axis type.

    Auto, not JAX 0.10's default explicit axis type: under explicit types the weight-gradient
    contraction of a data-parallel step has an ambiguous output sharding and fails to trace.
    """
    devices = jax.devices()[: num_devices or None]
    return jax.make_mesh((len(devices),), (DATA,), axis_types=(AxisType.Auto,), devices=devices)


def fsdp_spec(path, shape: tuple[int, ...], shards: int) -> P:
    """Shards the largest axis that ``shards`` divides, never the stacked ``[L]`` axis of layers."""
    stacked = any(getattr(key, "key", None) == "layers" for key in path)
    axes = [a for a in range(int(stacked), len(shape)) if shape[a] % shards == 0]
    if not axes or shards == 1:
        return P()
    axis = max(axes, key=lambda a: shape[a])
    return P(*[DATA if a == axis else None for a in range(len(shape))])


def state_shardings(state: Any, mesh: Mesh, fsdp: bool = False) -> Any:
    """``NamedSharding`` per leaf of a train state (or params): replicated, or FSDP over ``"data"``.

    Adam moments get the sharding of their parameter (same path below the optimizer's keys, same
    shape); scalars stay replicated.
    """
    shards = mesh.shape[DATA]

    def sharding(path, leaf):
        spec = fsdp_spec(path, leaf.shape, shards) if fsdp else P()
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, state)


def loss_and_grads(
    loss: Loss,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    batch: Any,
    micro_batches: int = 1,
    reference: nnx.State | None = None,
) -> tuple[nnx.State, jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """``(grads, loss, metrics, per_row)`` of the token-mean loss over the whole batch (``per_row``:
    the loss's ``[B, ...]`` arrays, rows in batch order). ``reference``: frozen parameters of the
    same graph, handed to the loss as a model (no gradient flows into them).

    ``batch`` is a ``Batch`` or any pytree of arrays with rows on their leading axis; an array
    whose leading axis is ``K`` times the row count holds ``K`` row-major sample slots per row
    (a ``Batch`` of several samples per row, ``orsd_jax.batch``), and one of fewer rows than
    ``batch.tokens`` holds the first rows' (a ``Batch``'s with-rubric stream).

    The batch is cut into ``micro_batches`` interleaved slices (rows ``m, m + M, ...`` with their
    slots), so each slice keeps rows from every device's shard; gradients of the loss *sums* are
    accumulated in float32 by a ``lax.scan`` and divided by the total token count once.
    """
    b = batch.tokens.shape[0] if isinstance(batch, Batch) else min(x.shape[0] for x in jax.tree.leaves(batch))
    if b % micro_batches:
        raise ValueError(f"{b} rows do not split into {micro_batches} micro-batches")

    def sums_and_grads(micro):
        frozen = () if reference is None else (nnx.merge(graphdef, reference),)

        def f(p):
            loss_sum, count, sums, rows = loss(nnx.merge(graphdef, p), micro, *frozen)
            return loss_sum, (count, sums, rows)

        (loss_sum, (count, sums, rows)), grads = jax.value_and_grad(f, has_aux=True)(params)
        return (grads, {"loss": loss_sum, "tokens": count, **sums}), rows

    def split(x):  # [B K, ...] -> [M, B / M K, ...], micro-batch m = rows m, m + M, ... and their K slots
        # An array of fewer rows (a Batch's with-rubric stream: its first S rows) splits the same
        # way, so that row i of it stays with row i of the others.
        rows = b if x.shape[0] % b == 0 else x.shape[0]
        if rows % micro_batches:
            raise ValueError(f"{rows} rows of an array do not split into {micro_batches} micro-batches")
        k = x.shape[0] // rows
        x = x.reshape(rows // micro_batches, micro_batches, k, *x.shape[1:]).swapaxes(0, 1)
        return x.reshape(micro_batches, rows // micro_batches * k, *x.shape[3:])

    def unsplit(x):  # the inverse of split
        k = x.shape[1] // (b // micro_batches)
        x = x.reshape(micro_batches, b // micro_batches, k, *x.shape[2:]).swapaxes(0, 1)
        return x.reshape(b * k, *x.shape[3:])

    def body(carry, micro):
        summed, rows = sums_and_grads(micro)
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry, summed), rows

    if micro_batches == 1:
        (grads, sums), rows = sums_and_grads(batch)
    else:
        micros = jax.tree.map(split, batch)
        shapes = jax.eval_shape(sums_and_grads, jax.tree.map(lambda x: x[0], micros))[0]
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
        (grads, sums), rows = jax.lax.scan(body, zeros, micros)
        rows = jax.tree.map(unsplit, rows)
    tokens = sums.pop("tokens")
    count = jnp.maximum(tokens, 1)
    grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, params)
    # The raw sums too ("sum/<name>"): a caller combining several steps recomputes exact means.
    raw = {f"sum/{k}": v for k, v in sums.items() if k != "loss"}
    return grads, sums.pop("loss") / count, loss.metrics(sums, tokens) | raw | {"tokens": tokens}, rows


def make_train_step(
    loss: Loss,
    optimizer: optax.GradientTransformation,
    graphdef: nnx.GraphDef,
    state_sharding: Any,
    with_reference: bool = False,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]]:
    """``step(state, batch, micro_batches=1, reference=None) -> (state, metrics, per_row)``,
    jit-compiled over the mesh of ``state_sharding`` (from ``init_train_state``); ``per_row`` is
    the loss's ``[B, ...]`` arrays at the parameters the step started from. ``with_reference``:
    every call passes ``reference``, frozen parameters sharded like ``state.params`` (placed once,
    never donated), which the loss reads as a model.

    The input state is donated. The batch may be numpy (the same on every process of a
    multi-process run, ``distributed.to_global``): it is split over ``"data"`` on the way in, so
    its row count must divide evenly (``build_batch(..., batch_multiple=devices *
    micro_batches)``). Metrics are replicated scalars: ``loss`` (token mean), ``grad_norm``
    (before clipping), ``tokens``, the loss's own metrics and the sums they come from (``sum/*``).
    """
    mesh = jax.tree.leaves(state_sharding)[0].mesh

    def step(state: TrainState, batch: Batch, reference: nnx.State | None, micro_batches: int):
        grads, loss_value, metrics, rows = loss_and_grads(loss, graphdef, state.params, batch, micro_batches, reference)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = metrics | {"loss": loss_value, "grad_norm": optax.tree.norm(grads)}
        return TrainState(params, opt_state, state.step + 1), metrics, rows

    by_rows = NamedSharding(mesh, P(DATA))
    jitted = jax.jit(
        step,
        in_shardings=(state_sharding, by_rows, state_sharding.params if with_reference else None),
        out_shardings=(state_sharding, NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA))),
        static_argnums=3,
        donate_argnums=0,
    )

    def call(state: TrainState, batch: Batch, micro_batches: int = 1, reference: nnx.State | None = None):
        if (reference is not None) != with_reference:
            raise ValueError(
                f"this step was built with_reference={with_reference}; reference parameters "
                f"{'missing' if with_reference else 'given'}"
            )
        return jitted(state, distributed.to_global(batch, by_rows), reference, micro_batches)

    return call
