"""Rollout loop throughput: turn-synchronous against asynchronous episodes, and the samplers.

Usage: python -m benchmarks.rollout [--difficulty standard] [--envs 16 32] [--group-size 4]
           [--max-steps 8] [--loops sync async] [--samplers vllm] [--repeats 2] [--model NAME]

``collect_groups`` on generated ALFWorld games of ``--difficulty``: ``envs / group-size`` tasks of
``--group-size`` episodes, the embedded model at temperature 1, 48 new tokens a step. For each
number of environments, each sampler plays the same groups (same seeds) with each loop, one
untimed warm-up round first (jit compilation, the server's first requests), then the median of
``--repeats`` timed rounds, the loops interleaved round by round. The environment pool (one worker
per core) is shared. Reported: environment steps and generated tokens per second of wall time;
seconds the sampler was busy, the environments were, and both at once; and the share of the
smaller stage hidden behind the larger (``(sampler + envs - wall) / min(sampler, envs)``: 0 when
nothing overlaps, 1 when the smaller stage is wholly hidden).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics

from orsd_jax import chat
from orsd_jax.envs import EnvPool
from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split
from orsd_jax.models import EMBEDDED, load_model, resolve
from orsd_jax.rollout import RolloutConfig, RolloutStats, collect_groups


def make_sampler(kind: str, model_name: str, max_len: int):
    model, tokenizer = load_model(model_name)
    if kind == "jax":
        from orsd_jax.sampling.jax_sampler import JaxSampler

        return JaxSampler(model, tokenizer, max_model_len=max_len), tokenizer
    from orsd_jax.sampling.vllm_sampler import VLLMSampler
    from orsd_jax.sampling.vllm_server import ServerOptions

    return VLLMSampler(resolve(model_name), tokenizer, options=ServerOptions(max_model_len=max_len)), tokenizer


def hidden_share(s: RolloutStats) -> float:
    """The share of the smaller stage that ran while the other did (by the wall clock)."""
    return (s.sampler_seconds + s.env_seconds - s.wall_seconds) / max(min(s.sampler_seconds, s.env_seconds), 1e-9)


COLUMNS = (
    ("env steps/s", lambda s: s.env_steps / s.wall_seconds, "{:.2f}"),
    ("gen tokens/s", lambda s: s.generated_tokens / s.wall_seconds, "{:.1f}"),
    ("wall s", lambda s: s.wall_seconds, "{:.1f}"),
    ("sampler busy s", lambda s: s.sampler_seconds, "{:.1f}"),
    ("envs busy s", lambda s: s.env_seconds, "{:.1f}"),
    ("both s", lambda s: s.overlap_seconds, "{:.1f}"),
    ("hidden", hidden_share, "{:.0%}"),
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--difficulty", default="standard")
    p.add_argument("--envs", type=int, nargs="+", default=[16, 32])
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--loops", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--samplers", nargs="+", default=["vllm"], choices=["vllm", "jax"])
    args = p.parse_args(argv)  # before any game loads: the planner overwrites sys.argv
    rollout = RolloutConfig(max_steps=args.max_steps, max_prompt_tokens=1024, max_response_tokens=48)
    train = load_split(default_games(args.difficulty, 0, max(args.envs) // args.group_size, 2), "train")
    rows = []
    for kind in args.samplers:
        sampler, tokenizer = make_sampler(kind, args.model, rollout.max_prompt_tokens + rollout.max_response_tokens)
        fmt = chat.chat_format(tokenizer)
        try:
            for n in args.envs:
                tasks = train[: n // args.group_size]
                runs: dict[str, list[RolloutStats]] = {loop: [] for loop in args.loops}
                with EnvPool(
                    functools.partial(AlfworldEnv, max_steps=args.max_steps), len(tasks) * args.group_size
                ) as pool:
                    for round_ in range(args.repeats + 1):
                        for loop in args.loops:
                            config = dataclasses.replace(rollout, asynchronous=loop == "async")
                            _, stats = collect_groups(
                                sampler,
                                pool,
                                tasks,
                                args.group_size,
                                config,
                                seed=round_ % 2,
                                tokenizer=tokenizer,
                                fmt=fmt,
                                build_prompt=build_prompt,
                            )
                            print(f"{kind} {loop} {n} envs, round {round_}: {stats}", flush=True)
                            if round_:  # the first round warms up
                                runs[loop].append(stats)
                for loop, stats in runs.items():
                    rows.append((kind, loop, n, [statistics.median(f(s) for s in stats) for _, f, _ in COLUMNS]))
        finally:
            sampler.close()
    print(
        f"\n{args.difficulty} games, {args.group_size} episodes a task, up to {args.max_steps} steps, "
        f"{args.model}; medians of {args.repeats}"
    )
    print("| sampler | loop | envs | " + " | ".join(name for name, _, _ in COLUMNS) + " | vs sync |")
    print("|---|---|---:|" + "---:|" * (len(COLUMNS) + 1))
    for kind, loop, n, values in rows:
        sync = next(v for k, lp, m, v in rows if (k, m) == (kind, n) and lp == args.loops[0])
        cells = " | ".join(pattern.format(v) for (_, _, pattern), v in zip(COLUMNS, values))
        print(f"| {kind} | {loop} | {n} | {cells} | {values[0] / sync[0]:.2f}x |")


if __name__ == "__main__":
    main()
