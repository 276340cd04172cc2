"""Rollout loop throughput: environment steps and generated tokens per second of ``collect_groups``.

Usage: python -m benchmarks.rollout [--model NAME] [--tasks 2] [--group-size 4] [--max-steps 8]
           [--repeats 3] [--samplers vllm jax]

The configuration of the end-to-end rubric-stage test: generated ``easy`` ALFWorld games, groups
of ``--group-size`` episodes of ``--tasks`` tasks, the embedded model at temperature 1. Each
sampler plays the same groups (same seeds), one untimed warm-up round first (jit compilation,
the server's first requests), then the median of ``--repeats`` timed rounds. The environment
pool (one worker per core) is shared by both. Time splits: the sampler's calls, the
environments' resets and steps, and the wall clock of the whole loop.
"""

from __future__ import annotations

import argparse
import functools
import statistics

from orsd_jax import chat
from orsd_jax.envs import EnvPool
from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split
from orsd_jax.models import EMBEDDED, load_model, resolve
from orsd_jax.rollout import RolloutConfig, collect_groups


def make_sampler(kind: str, model_name: str, max_len: int):
    model, tokenizer = load_model(model_name)
    if kind == "jax":
        from orsd_jax.sampling.jax_sampler import JaxSampler

        return JaxSampler(model, tokenizer, max_model_len=max_len), tokenizer
    from orsd_jax.sampling.vllm_sampler import VLLMSampler
    from orsd_jax.sampling.vllm_server import ServerOptions

    return VLLMSampler(resolve(model_name), tokenizer, options=ServerOptions(max_model_len=max_len)), tokenizer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samplers", nargs="+", default=["vllm", "jax"], choices=["vllm", "jax"])
    args = p.parse_args(argv)  # before any game loads: the planner overwrites sys.argv
    rollout = RolloutConfig(max_steps=args.max_steps, max_prompt_tokens=1024, max_response_tokens=48)
    tasks = load_split(default_games("easy", 0, 200, 50), "train")[: args.tasks]
    pool = EnvPool(functools.partial(AlfworldEnv, max_steps=args.max_steps), args.tasks * args.group_size)
    rows = []
    try:
        for kind in args.samplers:
            sampler, tokenizer = make_sampler(kind, args.model, rollout.max_prompt_tokens + rollout.max_response_tokens)
            fmt = chat.chat_format(tokenizer)
            try:
                runs = []
                for seed in range(args.repeats + 1):
                    _, stats = collect_groups(
                        sampler,
                        pool,
                        tasks,
                        args.group_size,
                        rollout,
                        seed=seed % 2,
                        tokenizer=tokenizer,
                        fmt=fmt,
                        build_prompt=build_prompt,
                    )
                    if seed:  # the first round warms up
                        runs.append(stats)
                        print(
                            f"{kind}: {stats.env_steps} steps, {stats.generated_tokens} tokens in {stats.wall_seconds:.1f} s "
                            f"(sampler {stats.sampler_seconds:.1f} s, environments {stats.env_seconds:.1f} s)",
                            flush=True,
                        )
            finally:
                sampler.close()
            med = lambda f, runs=runs: statistics.median(f(s) for s in runs)  # noqa: E731
            rows.append(
                (
                    kind,
                    med(lambda s: s.env_steps / s.wall_seconds),
                    med(lambda s: s.generated_tokens / s.wall_seconds),
                    med(lambda s: s.sampler_seconds / s.wall_seconds),
                    med(lambda s: s.env_seconds / s.wall_seconds),
                )
            )
    finally:
        pool.close()
    base = rows[0][1]
    print(
        f"\n{args.tasks} tasks x {args.group_size} episodes, up to {args.max_steps} steps, {args.model}; medians of {args.repeats}"
    )
    print(
        f"{'sampler':<8} {'env steps/s':>12} {'gen tokens/s':>13} {'sampler share':>14} {'env share':>10} {'vs ' + rows[0][0]:>9}"
    )
    for kind, steps, tokens, sampler_share, env_share in rows:
        print(
            f"{kind:<8} {steps:>12.2f} {tokens:>13.1f} {sampler_share:>14.0%} {env_share:>10.0%} {steps / base:>8.2f}x"
        )


if __name__ == "__main__":
    main()
