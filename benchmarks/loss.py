"""ORSD train step on the embedded model at agent-like shapes: the layouts of the with-/without-rubric replay.

Usage: python -m benchmarks.loss [--rows 4] [--prompt 600] [--rubric 150] [--response 60] [--reps 3]
                                 [--layers N] [--frozen-layers N] [--no-remat] [--query-blocks 4]
                                 [--layouts two-stream packed "two forwards" pytorch]

Ways to get the with- and without-rubric log-probs of a batch, each timed as a whole train step
(loss, gradients, clipping, AdamW), interleaved in one run (medians of ``--reps``):

- ``two-stream``: the without-rubric rows ``[prefix | tail response]`` with gradients, keeping
  every layer's keys and values, then the with-rubric rows ``[rubric tail response]`` under
  stop-gradient attending to the prefix's keys through a cache (``orsd_jax.batch``);
- ``packed``: one forward over ``[prefix | rubric tail response] [tail response]`` rows
  (``P + R + 2 (S + Y)`` tokens a row), the with-rubric half under stop-gradient;
- ``two forwards``: a with-rubric forward outside the gradient (``P + R + S + Y``) and a
  without-rubric forward with gradients (``P + S + Y``);
- ``unshared``: both sequences as ``2 B`` rows of one batched forward, stop-gradient on half: the
  backward still runs over both halves;
- PyTorch: the same step in transformers (``benchmarks.torch_step``: sdpa attention, two forwards,
  the same loss and AdamW, the same weights), what a verl-agent user runs.

Cost model, in token passes through the trained layers per row (forward 1, backward 2, remat 1
more, so ``k = 3`` or ``4``): two-stream ``k (P + S + Y) + (R + S + Y)``, packed
``k (P + R + 2 (S + Y))``, two forwards ``k (P + S + Y) + (P + R + S + Y)``, unshared
``k 2 (P + R + S + Y)``. The two-stream layout saves the prefix's second forward (``P`` passes)
over two forwards and ``(k - 1) (R + S + Y)`` backward passes over the packed layout. Frozen
bottom layers (``--frozen-layers``, cpu-demo's fine-tune) run forward only, so there every
layout's cost is mostly forwards and sharing the prefix saves most.

Also measured here: the f32 matmul rate (2048^3) as the machine's peak. FLOPs per step are the
dense work each layout executes (``orsd_jax.estimate.step_flops``); their ratio to two forwards'
is printed beside the measured ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax import chat
from orsd_jax.batch import StepSample, build_batch
from orsd_jax.estimate import forward_flops, step_flops, train_flops
from orsd_jax.loss import LossConfig, OrsdLoss, policy_loss, response_logprobs, without_gradient
from orsd_jax.models import EMBEDDED, CausalLM, decoder, load_model
from orsd_jax.train_step import OptimizerConfig, init_train_state, make_mesh, make_optimizer, make_train_step


@dataclasses.dataclass(frozen=True)
class TwoForwardLoss(OrsdLoss):
    """Batch ``(with_rows, without_rows)``: two plain batches, the rubric folded into the first's prompt."""

    def __call__(self, model, batch):
        with_rows, without_rows = batch
        c = self.config
        # The with-rubric forward on stop-gradient parameters, as the two-stream replay's.
        _, logp_with, _ = response_logprobs(
            without_gradient(model), with_rows, temperature=c.temperature, with_rubric=False
        )
        _, logp, entropy = response_logprobs(model, without_rows, temperature=c.temperature, with_rubric=False)
        return policy_loss(logp, entropy, jax.lax.stop_gradient(logp_with), without_rows, c)


@dataclasses.dataclass(frozen=True)
class UnsharedLoss(OrsdLoss):
    """Batch: ``2 B`` plain rows, the with-rubric sequences first; one forward over all of them."""

    def __call__(self, model, batch):
        c = self.config
        _, logp, entropy = response_logprobs(model, batch, temperature=c.temperature, with_rubric=False)
        b = logp.shape[0] // 2
        without = jax.tree.map(lambda x: x[b:], batch)
        return policy_loss(logp[b:], entropy[b:], jax.lax.stop_gradient(logp[:b]), without, c)


TORCH = "pytorch"  # transformers, two forwards
LAYOUTS = ("two-stream", "packed", "two forwards", "unshared [2B, T]", TORCH)


def layouts(samples: list[StepSample]):
    """The three batches and the tokens each layout's forward runs over (padded)."""
    plain = lambda s, with_rubric: dataclasses.replace(  # noqa: E731
        s, prefix=[*s.prefix, *s.insert] if with_rubric else s.prefix, insert=()
    )
    rubric_flag = lambda b: b.replace(has_rubric=np.ones_like(b.has_rubric))  # noqa: E731
    with_rows = build_batch([plain(s, True) for s in samples])
    without_rows = rubric_flag(build_batch([plain(s, False) for s in samples]))
    unshared = rubric_flag(build_batch([plain(s, True) for s in samples] + [plain(s, False) for s in samples]))
    return {
        "two-stream": (OrsdLoss, build_batch(samples, layout="two-stream")),
        "packed": (OrsdLoss, build_batch(samples)),
        "two forwards": (TwoForwardLoss, (with_rows, without_rows)),
        "unshared [2B, T]": (UnsharedLoss, unshared),
    }


def executed_flops(config, name: str, batch) -> float:
    """Dense FLOPs of one train step of ``name`` on ``batch`` (``orsd_jax.estimate``)."""
    if name == "two forwards":
        with_rows, without_rows = batch
        y = with_rows.response.shape[1]
        return forward_flops(config, *with_rows.tokens.shape, y) + train_flops(config, *without_rows.tokens.shape, y)
    if name.startswith("unshared"):
        return train_flops(config, *batch.tokens.shape, batch.response.shape[1])
    return step_flops(config, batch)


def first_layers(model: CausalLM, n: int) -> CausalLM:
    """The model cut to its first ``n`` layers (quicker runs; per-layer costs are unchanged)."""
    config = dataclasses.replace(model.config, num_layers=n)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    cut = lambda path, x: x[:n] if "layers" in jax.tree_util.keystr(path) else x  # noqa: E731
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(cut, nnx.state(model)))


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def matmul_seconds(dtype=jnp.float32) -> Callable[[], float]:
    """A timer of one 2048^3 matmul in ``dtype`` (compiled): ``2 * 2048**3`` FLOPs over its median
    is the machine's peak rate here."""
    matrix = jnp.ones((2048, 2048), dtype)
    matmul = jax.jit(lambda x: x @ x)
    matmul(matrix).block_until_ready()
    return lambda: timed(lambda: matmul(matrix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="step samples per batch")
    parser.add_argument("--prompt", type=int, default=600, help="user text tokens (plus the chat head)")
    parser.add_argument("--rubric", type=int, default=150)
    parser.add_argument("--response", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-remat", action="store_true", help="keep every layer's activations")
    parser.add_argument("--layers", type=int, default=None, help="use only the first N of the 30 layers")
    parser.add_argument(
        "--frozen-layers", type=int, default=0, help="train only the layers above the first N (cpu-demo: 26)"
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument(
        "--query-blocks", type=int, nargs="+", default=[decoder.QUERY_BLOCKS], help="attention variants (1: dense)"
    )
    args = parser.parse_args()

    model, tokenizer = load_model(EMBEDDED, remat=not args.no_remat, frozen_layers=args.frozen_layers)
    if args.layers:
        model = first_layers(model, args.layers)
    fmt = chat.chat_format(tokenizer)
    rng = np.random.RandomState(0)
    config = model.config
    samples = [
        StepSample(
            prefix=[*fmt.head, *rng.randint(0, config.vocab_size, args.prompt).tolist()],
            insert=rng.randint(0, config.vocab_size, args.rubric).tolist(),
            tail=list(fmt.tail),
            response=rng.randint(0, config.vocab_size, args.response).tolist(),
            old_logprobs=(-2.0 + 0.1 * rng.randn(args.response)).tolist(),
            advantage=float(rng.randn()),
        )
        for _ in range(args.rows)
    ]
    optimizer = make_optimizer(frozen_layers=args.frozen_layers)
    torch_step = None
    if TORCH in args.layouts:  # the same weights, loss, optimizer and samples in PyTorch
        from benchmarks.torch_step import make_torch_step

        torch_step = make_torch_step(
            model, samples, LossConfig(), OptimizerConfig(), frozen_layers=args.frozen_layers, remat=not args.no_remat
        )
    # One train state passed from layout to layout: the layouts share its structure and sharding.
    graphdef, state, sharding = init_train_state(model, optimizer, make_mesh(1))
    del model  # the state holds a copy of the parameters
    runs = {}
    for blocks in args.query_blocks:
        decoder.QUERY_BLOCKS = blocks  # read when the step is traced, on its first call just below
        for name, (loss_cls, batch) in layouts(samples).items():
            if name not in args.layouts:
                continue
            step = make_train_step(loss_cls(LossConfig()), optimizer, graphdef, sharding)
            start = time.perf_counter()
            state, _, _ = step(state, batch)
            jax.block_until_ready(state)
            runs[name, blocks] = {"step": step, "batch": batch, "compile": time.perf_counter() - start, "times": []}
    if torch_step is not None:
        start = time.perf_counter()
        torch_step()  # warm-up
        runs[TORCH, 0] = {
            "step": None,
            "batch": layouts(samples)["two forwards"][1],
            "compile": time.perf_counter() - start,
            "times": [],
        }
    matmul = matmul_seconds()
    matmul_times = []
    for _ in range(args.reps):  # interleaved, so load changes hit every layout and the peak alike
        for run in runs.values():
            start = time.perf_counter()
            if run["step"] is None:
                torch_step()
            else:
                state, metrics, _ = run["step"](state, run["batch"])
                jax.block_until_ready(metrics)
            run["times"].append(time.perf_counter() - start)
        matmul_times += [matmul() for _ in range(5)]
    peak = 2 * 2048**3 / statistics.median(matmul_times)

    p, s = len(samples[0].prefix), len(samples[0].tail)
    trained = args.rows * (p + s + args.response)  # tokens of the without-rubric sequences
    print(
        f"SmolLM2-135M f32 ({config.num_layers} layers, {args.frozen_layers} frozen), remat {not args.no_remat}, "
        f"{args.rows} samples: prompt {p} (chat head + text), rubric {args.rubric}, tail {s}, response {args.response}; "
        f"{jax.devices()[0].platform}, matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    median = {key: statistics.median(run["times"]) for key, run in runs.items()}
    # PyTorch's step is two forwards (the with-rubric one under no_grad), with torch's kernels.
    flops = {
        key: executed_flops(config, "two forwards" if key[0] == TORCH else key[0], run["batch"])
        for key, run in runs.items()
    }
    blocks_of = {name: blocks for name, blocks in runs}
    columns = [
        "layout",
        "query blocks",
        "tokens per row",
        "step s (median)",
        "trained tokens/s",
        "GFLOP/s executed",
        "% of matmul peak",
        "FLOP ratio vs two forwards",
        "measured vs two forwards",
        "measured / FLOP ratio",
        "vs packed",
    ]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for (name, blocks), run in runs.items():
        t, f = median[name, blocks], flops[name, blocks]
        batch = run["batch"]
        rows = batch if name in ("two forwards", TORCH) else (batch,)
        shape = " + ".join(str(b.tokens.shape[1]) for b in rows)
        if name == "two-stream":
            shape += f" + {batch.rubric_tokens.shape[1]}"
        blocks = blocks_of.get("two forwards", blocks) if name == TORCH else blocks  # compared with JAX's default
        cells = [
            name if name != TORCH else "PyTorch (transformers, two forwards)",
            blocks if name != TORCH else "sdpa",
            shape,
            f"{t:.2f}",
            f"{trained / t:.0f}",
            f"{f / t / 1e9:.0f}",
            f"{100 * f / t / peak:.0f}%",
        ]
        if ("two forwards", blocks) in runs:
            flop_ratio, measured = flops["two forwards", blocks] / f, median["two forwards", blocks] / t
            cells += [f"{flop_ratio:.2f}x", f"{measured:.2f}x", f"{measured / flop_ratio:.0%}"]
        else:
            cells += ["", "", ""]
        cells.append(f"{median['packed', blocks] / t:.2f}x" if ("packed", blocks) in runs else "")
        print("| " + " | ".join(map(str, cells)) + " |")
    if torch_step is not None:
        ours = min((median[key], key[0]) for key in median if key[0] != TORCH)
        print(f"fastest JAX layout ({ours[1]}) vs PyTorch: {median[TORCH, 0] / ours[0]:.2f}x")
    print("compile s: " + ", ".join(f"{name} ({blocks}) {run['compile']:.0f}" for (name, blocks), run in runs.items()))


if __name__ == "__main__":
    main()
