"""One update's training stage with rows of one sample and rows of several (``TrainConfig.pack_rows``).

Usage: python -m benchmarks.pack_rows [--samples 117] [--prompts N] [--method grpo|orsd] [--reps 3]
       [--row-tokens 512,1024] [--samples-from RUN/steps/00001]

The cpu-demo preset's training stage (embedded model, 26 of 30 layers frozen, minibatches of 16
step samples, the two-stream replay) over step samples shaped like an ALFWorld update's: prompts
whose history grows from step to step (``--prompt-min`` to ``--prompt-max`` user-text tokens,
uniform), responses of 16-48 tokens, and with ``--method orsd`` a rubric of 100-160 tokens on
every sample. Rows of several samples are as long as the longest sample, or at least each of
``--row-tokens`` (``TrainConfig.row_tokens``); "packed layout" is one sample per row in the packed
tree-mask layout. With ``--prompts`` fewer than the samples, some samples repeat an earlier one's
prompt (a group's episodes that took the same steps); "shared prompts" makes each row's prompts
one tree, their common beginnings once (``MinibatchSpec.share_prefix``, the other rows do not),
"shared, by prompt" also orders the samples by prompt and "shared, packed" packs the whole
update's rows at once and deals them out (``TrainConfig.minibatch_order``; "shared, packed, >= N":
rows of at least N tokens). ``--samples-from`` replays a real update's step samples instead (a
run's recorded update: ``orsd_jax.credit.load_samples``). Each configuration runs one warm-up
update (its compilations, reported apart) and then ``--reps`` timed updates, interleaved; the
table gives medians, the padded slots the forwards computed, the fill (tokens / slots), and the
speed-up and FLOP ratio against the first configuration run (``--configs`` picks some).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from orsd_jax import chat
from orsd_jax.batch import StepSample, prompt_groups
from orsd_jax.config import preset
from orsd_jax.credit import load_samples
from orsd_jax.estimate import attention_tokens, step_flops
from orsd_jax.loss import OrsdLoss
from orsd_jax.minibatches import MinibatchSpec, Step, minibatch, train_minibatches, update_steps
from orsd_jax.models import EMBEDDED, load_model
from orsd_jax.train_step import init_train_state, make_mesh, make_optimizer, make_train_step


def step_samples(args, tokenizer, vocab: int) -> list[StepSample]:
    """``args.samples`` samples of ``args.prompts`` distinct prompts (and rubrics): each sample past
    the first ``args.prompts`` repeats the prompt of an earlier one, with a response of its own."""
    fmt = chat.chat_format(tokenizer)
    rng = np.random.RandomState(0)
    out: list[StepSample] = []
    for i in range(args.samples):
        y = int(rng.randint(16, 49))
        prefix = [*fmt.head, *rng.randint(0, vocab, rng.randint(args.prompt_min, args.prompt_max + 1)).tolist()]
        insert = rng.randint(0, vocab, rng.randint(100, 161)).tolist() if args.method == "orsd" else ()
        if i >= (args.prompts or args.samples):
            source = out[rng.randint(args.prompts)]
            prefix, insert = source.prefix, source.insert
        out.append(
            StepSample(
                prefix=prefix,
                insert=insert,
                tail=list(fmt.tail),
                response=rng.randint(0, vocab, y).tolist(),
                old_logprobs=(-2.0 + 0.1 * rng.randn(y)).tolist(),
                advantage=float(rng.randn()),
            )
        )
    return out


def update_flops(model_config, samples: list[StepSample], steps: list[Step], spec: MinibatchSpec) -> float:
    """Dense FLOPs of the update's train steps (``orsd_jax.estimate.step_flops``) on the minibatches
    ``train_minibatches`` builds for ``spec``."""
    return sum(step_flops(model_config, minibatch([samples[i] for i in s.samples], spec, s)) for s in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=117, help="step samples of the update (cpu-study's 4 x 4 episodes: about 117)"
    )
    parser.add_argument("--method", choices=["grpo", "orsd"], default="grpo")
    parser.add_argument(
        "--prompts",
        type=int,
        help="distinct prompts among the samples (default: all distinct; a cpu-demo update's: 46 of 64)",
    )
    parser.add_argument("--prompt-min", type=int, default=150)
    parser.add_argument("--prompt-max", type=int, default=600)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--row-tokens", type=lambda text: [int(n) for n in text.split(",")], default=[512, 1024], help="comma list"
    )
    parser.add_argument(
        "--samples-from", help="a recorded update's steps/<update> folder: its step samples instead of synthetic ones"
    )
    parser.add_argument("--configs", nargs="+", help="the configurations to run, by their row names (default: all)")
    args = parser.parse_args()

    recorded = load_samples(args.samples_from) if args.samples_from else None
    if recorded:
        args.samples, args.prompts = len(recorded), len(prompt_groups(recorded))
        args.method = "orsd" if any(s.insert for s in recorded) else "grpo"
    base = dataclasses.replace(preset("cpu-demo"), method=args.method).resolved()
    model, tokenizer = load_model(EMBEDDED, remat=base.model.remat, frozen_layers=base.model.frozen_layers)
    samples = recorded or step_samples(args, tokenizer, model.config.vocab_size)
    optimizer = make_optimizer(base.optimizer, frozen_layers=base.model.frozen_layers)
    graphdef, state, sharding = init_train_state(model, optimizer, make_mesh(1))
    spec = dataclasses.replace(
        base.minibatch_spec(), share_prefix=False, attention_tokens=attention_tokens(model.config)
    )
    shared = dataclasses.replace(spec, share_prefix=True)
    configs = {
        # The default before the two-stream replay and packed rows (931436c's).
        "packed layout": (dataclasses.replace(spec, layout="packed", pack=False), "shuffled"),
        "one per row": (dataclasses.replace(spec, pack=False), "shuffled"),
        "packed rows": (spec, "shuffled"),
        **{f"packed, >= {n}": (dataclasses.replace(spec, row_tokens=n), "shuffled") for n in args.row_tokens},
        "shared prompts": (shared, "shuffled"),
        "shared, by prompt": (shared, "by-prompt"),
        "shared, packed": (shared, "packed"),
        **{f"shared, packed, >= {n}": (dataclasses.replace(shared, row_tokens=n), "packed") for n in args.row_tokens},
    }
    unknown = set(args.configs or ()) - set(configs)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; of {list(configs)}")
    configs = {name: c for name, c in configs.items() if not args.configs or name in args.configs}
    plans = {
        name: (s, update_steps(samples, 1, np.random.default_rng(1), order, s)) for name, (s, order) in configs.items()
    }
    runs = {
        name: {"times": [], "flops": update_flops(model.config, samples, steps, s)}
        for name, (s, steps) in plans.items()
    }
    # A train step of its own each: every configuration's first update compiles its own shapes.
    train_steps = {name: make_train_step(OrsdLoss(base.loss), optimizer, graphdef, sharding) for name in plans}
    for _ in range(1 + args.reps):
        for name, (spec, steps) in plans.items():
            start = time.perf_counter()
            trained = train_minibatches(train_steps[name], state, samples, steps, spec, record=False)
            state = jax.block_until_ready(trained.state)
            runs[name]["times"].append(time.perf_counter() - start)
            runs[name]["counts"] = trained.counts
    shape = args.samples_from or f"{args.prompt_min}-{args.prompt_max} tokens"
    print(
        f"{args.samples} step samples ({args.method}) of {args.prompts or args.samples} prompts, {shape}, "
        f"{jax.device_count()} device(s), medians of {args.reps}"
    )
    print(
        f"{'rows':<20}{'first (compiles)':>18}{'update':>10}{'slots':>10}{'fill':>7}{'TFLOP':>8}{'speed-up':>10}"
        f"{'FLOP ratio':>12}"
    )
    first = next(iter(runs.values()))  # the speed-up's and FLOP ratio's baseline
    one = statistics.median(first["times"][1:])
    for name, run in runs.items():
        c, median = run["counts"], statistics.median(run["times"][1:])
        print(
            f"{name:<20}{run['times'][0]:>17.1f}s{median:>9.1f}s{c['row_slots']:>10}{c['row_tokens'] / c['row_slots']:>7.0%}"
            f"{run['flops'] / 1e12:>8.2f}{one / median:>9.2f}x{first['flops'] / run['flops']:>11.2f}x"
        )


if __name__ == "__main__":
    main()
