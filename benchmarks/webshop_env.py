"""WebShop environment throughput: world build time, steps/s in one process and in an EnvPool.

Usage: python benchmarks/webshop_env.py [--data DIR] [--steps N] [--envs 16] [--workers W]
A seeded random policy picks among the available actions (searching for words of the
instruction); finished episodes restart on the next test goal.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from pathlib import Path

from orsd_jax.envs.pool import EnvPool
from orsd_jax.envs.webshop import WebShopEnv, load_goals
from orsd_jax.envs.webshop.data import load_catalog, resolve_data_dir
from orsd_jax.envs.webshop.goals import make_goal_set
from orsd_jax.envs.webshop.pages import SEARCH_PLACEHOLDER
from orsd_jax.envs.webshop.reward import title_nouns
from orsd_jax.envs.webshop.search import SearchEngine


def random_action(rng: random.Random, step, task) -> str:
    action = rng.choice(step.admissible_actions)
    if action == SEARCH_PLACEHOLDER:
        return f"search[{' '.join(rng.sample(task.description.split(), 3))}]"
    return action


def timed(label: str, fn):
    start = time.perf_counter()
    out = fn()
    print(f"{label:<34} {time.perf_counter() - start:8.3f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="WebShop data directory (default: $WEBSHOP_DATA)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per measurement")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    data_dir = resolve_data_dir(args.data or Path(__file__).resolve().parents[2] / "shared" / "webshop")

    catalog = timed("load products + attributes", lambda: load_catalog(data_dir))
    timed("build goals (6910 on the 1k set)", lambda: make_goal_set(catalog))
    timed("build BM25 index", lambda: SearchEngine(catalog.products))
    timed("load spaCy + tag one title", lambda: title_nouns(catalog.products[0].title))
    env = timed("WebShopEnv() (builds its world)", lambda: WebShopEnv(data_dir))
    tasks = load_goals(data_dir, "test")

    rng = random.Random(0)
    episode, task = 0, tasks[0]
    step = env.reset(task)
    start = time.perf_counter()
    for _ in range(args.steps):
        step = env.step(random_action(rng, step, task))
        if step.done:
            episode += 1
            task = tasks[episode % len(tasks)]
            step = env.reset(task)
    sequential = args.steps / (time.perf_counter() - start)
    print(f"{'sequential steps/s (1 env)':<34} {sequential:8.1f}   ({episode} episodes)")

    make_env = functools.partial(WebShopEnv, data_dir=str(data_dir))
    pool = timed(f"EnvPool start ({args.envs} envs)", lambda: EnvPool(make_env, args.envs, args.workers))
    with pool:
        current = [tasks[i % len(tasks)] for i in range(args.envs)]
        steps = pool.reset(current)

        def play(rounds: int) -> None:
            nonlocal steps
            for r in range(rounds):
                steps = pool.step([random_action(rng, s, t) for s, t in zip(steps, current)])
                finished = [i for i, s in enumerate(steps) if s.done]
                for i in finished:
                    current[i] = tasks[(r * args.envs + i) % len(tasks)]
                if finished:
                    fresh = pool.reset([current[i] if i in finished else None for i in range(args.envs)])
                    steps = [fresh[i] if i in finished else s for i, s in enumerate(steps)]

        timed("EnvPool warm-up (spaCy per worker)", lambda: play(20))
        rounds = max(1, args.steps // args.envs)
        start = time.perf_counter()
        play(rounds)
        pooled = rounds * args.envs / (time.perf_counter() - start)
    print(f"{'EnvPool steps/s (' + str(args.envs) + ' envs)':<34} {pooled:8.1f}")


if __name__ == "__main__":
    main()
