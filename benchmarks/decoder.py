"""The decoder's two CPU choices against the plain alternatives, side by side in one run.

Usage: python -m benchmarks.decoder [--rows 16] [--seq 512] [--reps 5]

- MLP: ``[B * T, D]`` rows (``decoder.MLP``) against the same three matmuls on ``[B, T, D]``
  arrays, whose weight gradients XLA:CPU runs as a contraction over two axes.
- Attention: ``attend`` with ``causal=True`` (``QUERY_BLOCKS`` blocks of queries, each against
  the keys up to its end) against dense ``[T, T]`` attention, under the packed tree mask of a
  step sample (a shared prefix, two branches).

Both at the embedded model's shapes (SmolLM2-135M: D 576, F 1536, 9 heads of 64, 3 KV heads),
float32, forward and forward-plus-gradient, interleaved, medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax.batch import attention_mask
from orsd_jax.models.decoder import MLP, ModelConfig, attend

D, F, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def mlp_3d(mlp: MLP, x: jax.Array) -> jax.Array:
    """The alternative: the MLP's matmuls on ``[B, T, D]`` arrays."""
    return (jax.nn.silu(x @ mlp.gate[...]) * (x @ mlp.up[...])) @ mlp.down[...]


def time_once(fn, args, times: list[float]) -> None:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    b, t = args.rows, args.seq
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.05)  # noqa: E731

    config = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=D,
        intermediate_size=F,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )
    graphdef, params = nnx.split(MLP(config, nnx.Rngs(0)))
    x = normal(b, t, D)
    mlps = {
        "[B * T, D] rows (this build)": lambda p, x: nnx.merge(graphdef, p)(x),
        "[B, T, D] arrays": lambda p, x: mlp_3d(nnx.merge(graphdef, p), x),
    }

    # A prefix of 3/4 of the row and two branches of 1/8 each (the subtree of a prefix token: the row).
    reach = np.full((b, t), t - 1)
    reach[:, t * 3 // 4 : t * 7 // 8] = t * 7 // 8 - 1
    mask = attention_mask(jnp.asarray(reach))
    qkv = (normal(b, t, HEADS, HEAD_DIM), normal(b, t, KV_HEADS, HEAD_DIM), normal(b, t, KV_HEADS, HEAD_DIM))
    attentions = {
        "query blocks (this build)": lambda a: attend(*a, mask, causal=True),
        "dense [T, T]": lambda a: attend(*a, mask),
    }

    cases = {}
    for name, f in mlps.items():
        cases["MLP", name, "forward"] = (jax.jit(lambda p, x, f=f: f(p, x).sum()), (params, x))
        cases["MLP", name, "forward + gradient"] = (
            jax.jit(jax.grad(lambda p, x, f=f: f(p, x).sum(), argnums=(0, 1))),
            (params, x),
        )
    for name, f in attentions.items():
        cases["attention", name, "forward"] = (jax.jit(lambda a, f=f: f(a).sum()), (qkv,))
        cases["attention", name, "forward + gradient"] = (jax.jit(jax.grad(lambda a, f=f: f(a).sum())), (qkv,))
    times = {key: [] for key in cases}
    for fn, fn_args in cases.values():
        jax.block_until_ready(fn(*fn_args))  # compile
    for _ in range(args.reps):  # interleaved, so load changes hit every variant alike
        for key, (fn, fn_args) in cases.items():
            time_once(fn, fn_args, times[key])

    print(f"{b} rows x {t} tokens, float32, {jax.devices()[0].platform}; medians of {args.reps}")
    print("| part | variant | pass | seconds | vs the other variant |\n|---|---|---|---:|---:|")
    for part, variants in (("MLP", list(mlps)), ("attention", list(attentions))):
        for name in variants:
            other = next(v for v in variants if v != name)
            for kind in ("forward", "forward + gradient"):
                s = statistics.median(times[part, name, kind])
                ratio = statistics.median(times[part, other, kind]) / s
                print(f"| {part} | {name} | {kind} | {s:.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
