"""ALFWorld on the real engine: game generation time, 16 environments stepped concurrently in an
EnvPool versus one after another in one process, and the engine's memoised text parses versus
TextWorld's own.

Usage: python -m benchmarks.alfworld_envs [--difficulty easy standard] [--envs 16] [--group 8]
           [--rounds 10] [--repeats 3] [--workers W] [--train 200] [--unseen 50] [--parts ...]

Generation writes ``--train`` train and ``--unseen`` valid_unseen games with 2 worker processes
(the issue's budget: under 10 minutes on 2 cores) and reports the train games' planner
walkthrough length (overall and per task type), receptacle and object counts over all runs.
Stepping plays ``--envs`` environments, groups of ``--group`` copies of a game, for ``--rounds``
steps each with a seeded random policy over the admissible commands; both modes take the same
actions. Steps are timed apart from resets and steps/s are medians of ``--repeats`` runs; the
reset time is the first run's, which loads the games (later resets of a loaded game skip the
PDDL translation). The machine's load average is printed: other processes skew the ratio.
Parses plays the same games one after another in a fresh process per run, with the engine's
memoised parses and with TextWorld parsing every text (``engine._memoise_parses`` off), the two
kinds of process interleaved: the first loads and resets of each game, then steps timed apart.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orsd_jax.envs.alfworld import TASK_TYPES, AlfworldEnv, generate_games, load_split
from orsd_jax.envs.pool import EnvPool


def generation_run(difficulty: str, n_train: int, n_unseen: int, seed: int) -> tuple[float, list[dict]]:
    """Seconds to generate, and per train game its walkthrough length, receptacles and objects."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        generate_games(out, {"train": n_train, "valid_unseen": n_unseen}, seed, difficulty, workers=2)
        seconds = time.perf_counter() - start
        games = []
        for task in load_split(out, "train"):
            trial = Path(task.key).parent
            sizes = json.loads((trial / "traj_data.json").read_text())["generator"]
            walkthrough = json.loads(Path(task.key).read_text())["walkthrough"]
            games.append({"type": task.task_type, "steps": len(walkthrough), **sizes})
    return seconds, games


def describe(games: list[dict]) -> str:
    steps = [g["steps"] for g in games]
    receptacles = [g["receptacles"] for g in games]
    by_type = " / ".join(f"{statistics.mean(g['steps'] for g in games if g['type'] == t):.1f}" for t in TASK_TYPES)
    return (
        f"{statistics.mean(steps):.2f} | {by_type} | {statistics.mean(receptacles):.1f} "
        f"({min(receptacles)}-{max(receptacles)}) | {statistics.mean(g['objects'] for g in games):.1f}"
    )


class Sequential:
    """The EnvPool interface over environments in this process."""

    def __init__(self, n_envs: int):
        self.envs = [AlfworldEnv() for _ in range(n_envs)]

    def reset(self, tasks):
        return [env.reset(task) for env, task in zip(self.envs, tasks)]

    def step(self, actions):
        return [None if a is None else env.step(a) for env, a in zip(self.envs, actions)]


def play(stepper, tasks, rounds: int, seed: int) -> tuple[float, float, int]:
    """(reset seconds, step seconds, steps taken) for one run of the random policy."""
    rngs = [random.Random(f"{seed}/{i}") for i in range(len(tasks))]
    start = time.perf_counter()
    current = stepper.reset(tasks)
    reset_s = time.perf_counter() - start
    steps, step_s = 0, 0.0
    for _ in range(rounds):
        actions = [None if s.done else rng.choice(s.admissible_actions) for s, rng in zip(current, rngs)]
        start = time.perf_counter()
        out = stepper.step(actions)
        step_s += time.perf_counter() - start
        steps += sum(a is not None for a in actions)
        current = [new or old for new, old in zip(out, current)]
    return reset_s, step_s, steps


def bench_stepping(difficulty: str, args) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        generate_games(root, {"train": args.envs // args.group}, args.seed, difficulty, workers=1)
        games = load_split(root, "train")
        tasks = [task for task in games for _ in range(args.group)]
        start = time.perf_counter()
        pool = EnvPool(functools.partial(AlfworldEnv, max_steps=50), len(tasks), n_workers=args.workers)
        spawn_s = time.perf_counter() - start
        steppers = {"sequential": Sequential(len(tasks)), "concurrent": pool}
        runs = {mode: [] for mode in steppers}
        try:
            for repeat in range(args.repeats):
                for mode, stepper in steppers.items():
                    runs[mode].append(play(stepper, tasks, args.rounds, repeat))
        finally:
            pool.close()
    out = {"spawn_s": spawn_s}
    for mode, results in runs.items():
        out[f"{mode}_reset_s"] = results[0][0]  # the first reset loads the games; later ones reuse them
        out[f"{mode}_steps_per_s"] = statistics.median(r[2] / r[1] for r in results)
    return out


def parse_run(root: str, memoised: bool, rounds: int, seed: int) -> dict[str, float]:
    """One fresh process: every game of ``root``'s train split loaded and played ``rounds`` steps."""
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.alfworld_envs",
            "--child-parses",
            root,
            str(int(memoised)),
            str(rounds),
            str(seed),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(child.stdout)


def child_parses(root: str, memoised: str, rounds: str, seed: str) -> None:
    from orsd_jax.envs.alfworld import engine

    if memoised == "0":
        engine._memoise_parses = lambda: None
    tasks = load_split(root, "train")
    reset_s, step_s, steps = play(Sequential(len(tasks)), tasks, int(rounds), int(seed))
    print(json.dumps({"reset_s": reset_s, "step_s": step_s, "steps": steps}))


def report_parses(args) -> None:
    print(
        "\n| preset | games | TextWorld's parses: first resets, steps/s | memoised: first resets, steps/s | ratio (steps) |"
    )
    print("|---|---:|---:|---:|---:|")
    for difficulty in args.difficulty:
        with tempfile.TemporaryDirectory() as root:
            n_games = args.envs // args.group
            generate_games(root, {"train": n_games}, args.seed, difficulty, workers=1)
            runs = {False: [], True: []}
            for repeat in range(args.repeats):
                for memoised in runs:
                    runs[memoised].append(parse_run(root, memoised, args.rounds, repeat))
        med = {
            m: (statistics.median(r["reset_s"] for r in rs), statistics.median(r["steps"] / r["step_s"] for r in rs))
            for m, rs in runs.items()
        }
        print(
            f"| {difficulty} | {n_games} | {med[False][0]:.2f} s, {med[False][1]:.1f} | {med[True][0]:.2f} s, "
            f"{med[True][1]:.1f} | {med[True][1] / med[False][1]:.2f}x |",
            flush=True,
        )


def report_generation(args) -> None:
    print(
        f"| preset | generate {args.train} train + {args.unseen} unseen (2 workers) | walkthrough steps "
        f"| by type ({' / '.join(TASK_TYPES)}) | receptacles (min-max) | objects |"
    )
    print("|---|---:|---:|---|---:|---:|")
    for difficulty in args.difficulty:
        runs = [generation_run(difficulty, args.train, args.unseen, args.seed + r) for r in range(args.repeats)]
        seconds = statistics.median(seconds for seconds, _ in runs)
        print(f"| {difficulty} | {seconds:.1f} s | {describe([g for _, games in runs for g in games])} |", flush=True)


def report_stepping(args) -> None:
    print(
        f"\n| preset | {args.envs} envs | sequential steps/s | concurrent steps/s | ratio "
        "| sequential first reset | concurrent first reset | pool start |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for difficulty in args.difficulty:
        r = bench_stepping(difficulty, args)
        print(
            f"| {difficulty} | {args.envs // args.group} games x {args.group} "
            f"| {r['sequential_steps_per_s']:.1f} | {r['concurrent_steps_per_s']:.1f} "
            f"| {r['concurrent_steps_per_s'] / r['sequential_steps_per_s']:.2f}x "
            f"| {r['sequential_reset_s']:.1f} s | {r['concurrent_reset_s']:.1f} s | {r['spawn_s']:.1f} s |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--difficulty", nargs="+", default=["easy", "standard"])
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="copies of each game")
    parser.add_argument("--rounds", type=int, default=10, help="steps per environment and run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None, help="EnvPool processes (default: CPUs)")
    parser.add_argument("--train", type=int, default=200)
    parser.add_argument("--unseen", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parts", nargs="+", default=["generation", "stepping", "parses"], choices=["generation", "stepping", "parses"]
    )
    parser.add_argument("--child-parses", nargs=4, help=argparse.SUPPRESS)  # one run of report_parses
    args = parser.parse_args()
    if args.child_parses:
        return child_parses(*args.child_parses)
    if args.envs % args.group:
        parser.error("--envs must be a multiple of --group")
    workers = args.workers or os.cpu_count()
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; EnvPool with {workers} workers; "
        f"medians of {args.repeats} runs\n"
    )

    if "generation" in args.parts:
        report_generation(args)
    if "stepping" in args.parts:
        report_stepping(args)
    if "parses" in args.parts:
        report_parses(args)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
