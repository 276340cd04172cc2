"""The warm start's work against the machine: FLOPs of a preset's fine-tune, the fastest it could run.

Usage: python -m benchmarks.warmstart [--env alfworld webshop] [--data-dir DIR] [--measure 2] [--tree-tokens 1024]

For each environment's ``cpu-demo`` warm start (``orsd_jax.config``), the demonstrations are
recorded as the warm start records them and batched as ``warmstart.finetune_plan`` batches them
(the frozen layers' pass, then the updates). Per stage it prints the dense FLOPs
(``orsd_jax.estimate``) the batches execute (padding, and attention across the demonstrations
that share a packed row, included) and the FLOPs of the demonstrations alone (each its own
unpadded sequence: what any implementation has to compute), and both divided by the f32 matmul
rate (2048^3) measured in the same run: a lower bound on the stage's time on this machine. The
bf16 matmul rate is printed beside it (bf16 compute is the lever left for the rate).

``--measure N`` also times the real steps: the frozen layers' pass over its longest batch and
its median one, and the first ``N`` updates (on zero frozen states: the cost does not depend on
their values), each run once to compile and then timed, with the rate they reach.

``--tree-tokens T`` adds the frozen layers' pass as prompt trees (``tree_pass``: rows of ``T``
tokens, each the trie of its demonstrations' prompts, so that one game's steps share their
common beginning), its FLOPs and, with ``--measure``, its time the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.loss import matmul_seconds
from orsd_jax import chat
from orsd_jax.batch import Batch, StepSample, plan_rows
from orsd_jax.config import preset
from orsd_jax.estimate import frozen_flops, trained_flops
from orsd_jax.models import ModelConfig, load_model
from orsd_jax.train_step import init_train_state, make_mesh, make_optimizer, make_train_step
from orsd_jax.warmstart import (
    IndexedBatch,
    SupervisedLoss,
    WarmStartRun,
    demo_sample,
    demonstrations,
    finetune_plan,
    frozen_states,
    packed_batch,
    row_multiple,
)


@dataclasses.dataclass(frozen=True)
class WarmStartWork:
    """Per stage (the frozen layers' pass, the updates; or the frozen pass alone, as prompt trees):
    batches, FLOPs executed and of the demonstrations alone, and what ``--measure`` timed."""

    name: str
    batches: tuple[int, ...]
    executed: tuple[float, ...]
    alone: tuple[float, ...]
    measured: tuple[str, ...]


def pass_flops(c: ModelConfig, batch: Batch) -> float:
    """The frozen layers' forward over ``batch``."""
    return frozen_flops(c, *batch.tokens.shape)


def update_flops(c: ModelConfig, batch: Batch) -> float:
    """One update on the frozen layers' states (read, not computed): the trained layers, the LM
    head at each row's ``k x Y`` response slots."""
    rows, t = batch.tokens.shape
    return trained_flops(c, rows, t, batch.response.shape[0] // rows * batch.response.shape[1])


def alone_flops(c: ModelConfig, lengths: list[int], answers: list[int]) -> tuple[float, float]:
    """(frozen pass, one epoch of updates) FLOPs of the demonstrations, each its own unpadded row."""
    below = sum(frozen_flops(c, 1, n) for n in lengths)
    return below, sum(trained_flops(c, 1, n, a) for n, a in zip(lengths, answers))


def tree_pass(samples: list[StepSample], rows: int, tokens: int, multiple: int) -> list[IndexedBatch]:
    """The frozen layers' pass as prompt trees: the demonstrations planned into rows of ``tokens``
    tokens, each row the trie of its prompts (``batch.plan_rows(share_prefix=True)``), ``rows`` rows
    a batch. A token's states depend on its ancestors only, so each demonstration reads its own
    from its path in the tree (``warmstart.frozen_states``)."""
    planned = plan_rows(samples, pack=True, share_prefix=True, row_tokens=tokens).rows
    return [
        packed_batch(samples, planned[s : s + rows], share_prefix=True, batch_multiple=multiple)
        for s in range(0, len(planned), rows)
    ]


def time_pass(graphdef, params, batches, n: int, c: ModelConfig) -> str:
    """The frozen layers' pass over the longest and the median of ``batches``, each after a
    compiling run: time and rate."""
    by_length = sorted(batches, key=lambda ib: ib[1].tokens.shape[1])
    seconds, flops = 0.0, 0.0
    for chunk in (by_length[-1], by_length[len(by_length) // 2]):
        frozen_states(graphdef, params, [chunk], n)  # compiles
        start = time.perf_counter()
        frozen_states(graphdef, params, [chunk], n)
        seconds += time.perf_counter() - start
        flops += pass_flops(c, chunk[1])
    return f"{seconds:.1f} s for 2 batches, {flops / seconds / 1e9:.0f} GFLOP/s"


def measure(model, run: WarmStartRun, samples, plan, n: int, trees: list) -> tuple[str, str, str]:
    """The frozen layers' pass over its longest and its median batch (and those of ``trees``, when
    given), and updates 2 to ``n + 1`` (the first compiles), each after a compiling run: their time
    and rate."""
    c = model.config
    optimizer = make_optimizer(run.train.optimizer, frozen_layers=c.frozen_layers)
    graphdef, state, sharding = init_train_state(model, optimizer, make_mesh())
    frozen_pass = time_pass(graphdef, state.params, plan.frozen_pass, len(samples), c)
    as_trees = time_pass(graphdef, state.params, trees, len(samples), c) if trees else ""
    step = make_train_step(SupervisedLoss(), optimizer, graphdef, sharding)
    times = []
    for _, batch in [ib for epoch in plan.epochs for ib in epoch][: n + 1]:
        batch = dataclasses.replace(batch, frozen=np.zeros((*batch.tokens.shape, c.hidden_size), np.float32))
        start = time.perf_counter()
        state, metrics, _ = step(state, batch, run.train.micro_batches)  # the state is donated
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - start, update_flops(c, batch)))
    timed_updates = times[1:]
    rate = sum(f for _, f in timed_updates) / sum(t for t, _ in timed_updates)
    median = statistics.median(t for t, _ in timed_updates)
    return frozen_pass, f"{median:.1f} s an update (median of {len(timed_updates)}), {rate / 1e9:.0f} GFLOP/s", as_trees


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", nargs="+", default=["alfworld", "webshop"], choices=["alfworld", "webshop"])
    parser.add_argument("--data-dir", default="../shared/webshop", help="WebShop's files")
    parser.add_argument("--measure", type=int, default=0, help="updates to time (0: FLOPs only)")
    parser.add_argument(
        "--tree-tokens", type=int, default=0, help="also the frozen pass as prompt trees in rows of this many tokens"
    )
    args = parser.parse_args()

    matmul, matmul_bf16 = matmul_seconds(), matmul_seconds(jnp.bfloat16)
    peak_times, bf16_times = [matmul() for _ in range(5)], [matmul_bf16() for _ in range(5)]
    rows = []
    for env in args.env:
        run: WarmStartRun = preset("cpu-demo", env).model.warmstart
        if env == "webshop":
            run = dataclasses.replace(run, data_dir=args.data_dir)
        model, tokenizer = load_model(run.model, frozen_layers=run.frozen_layers)
        fmt = chat.chat_format(tokenizer)
        samples = [demo_sample(d, fmt) for d in demonstrations(run, tokenizer, fmt)]
        plan = finetune_plan(samples, run.train, devices=make_mesh().size, frozen=run.frozen_layers > 0)
        c = model.config
        updates = [b for epoch in plan.epochs for _, b in epoch]
        executed = (
            sum(pass_flops(c, b) for _, b in plan.frozen_pass),
            sum(update_flops(c, b) for b in updates),
        )
        lengths = [len(s.prefix) + len(s.tail) + len(s.response) for s in samples]
        below, above = alone_flops(c, lengths, [len(s.response) for s in samples])
        alone = (below, above * run.train.epochs)  # the frozen pass runs once
        multiple = row_multiple(run.train, make_mesh().size)
        trees = tree_pass(samples, run.train.batch_size, args.tree_tokens, multiple) if args.tree_tokens else []
        measured = measure(model, run, samples, plan, args.measure, trees) if args.measure else ("", "", "")
        name = f"{env} ({len(samples)} demonstrations, {sum(lengths):,} tokens, {c.frozen_layers} of {c.num_layers} layers frozen)"
        rows.append(WarmStartWork(name, (len(plan.frozen_pass), len(updates)), executed, alone, measured[:2]))
        if trees:
            tree = f"{name}, frozen layers' pass as prompt trees (rows of {args.tree_tokens} tokens)"
            rows.append(
                WarmStartWork(tree, (len(trees),), (sum(pass_flops(c, b) for _, b in trees),), (below,), measured[2:])
            )
        peak_times += [matmul() for _ in range(5)]
        bf16_times += [matmul_bf16() for _ in range(5)]
    peak = 2 * 2048**3 / statistics.median(peak_times)

    print(
        f"{jax.devices()[0].platform}, f32 matmul peak {peak / 1e9:.0f} GFLOP/s (2048^3, median of {len(peak_times)}); "
        f"bf16 {2 * 2048**3 / statistics.median(bf16_times) / 1e9:.0f} GFLOP/s, alternated with it"
    )
    print()
    header = "| warm start | stage | batches | executed TFLOP | demonstrations alone TFLOP | executed at peak | alone at peak | measured |"
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for w in rows:
        for stage, count, e, a, m in zip(
            ("frozen layers' pass", "updates"), w.batches, w.executed, w.alone, w.measured
        ):
            print(
                f"| {w.name} | {stage} | {count} | {e / 1e12:.1f} | {a / 1e12:.1f} | {e / peak:.0f} s | {a / peak:.0f} s | {m} |"
            )
        if len(w.batches) == 1:  # a stage alone (the frozen pass as prompt trees)
            continue
        print(
            f"| {w.name} | **all** | {sum(w.batches)} | {sum(w.executed) / 1e12:.1f} | {sum(w.alone) / 1e12:.1f} "
            f"| **{sum(w.executed) / peak:.0f} s** | **{sum(w.alone) / peak:.0f} s** | |"
        )


if __name__ == "__main__":
    main()
