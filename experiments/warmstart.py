"""Supervised warm start on expert episodes (ALFWorld's planner walkthroughs, WebShop's oracle
purchases), then an evaluation on held-out games or test goals.

    python -m experiments.warmstart --env alfworld --model smollm2-135m-instruct --out runs/warmstart
    python -m experiments.warmstart --env webshop --data-dir PATH --demo-games 48 --out runs/ws-warmstart

Writes OUT/policy (a Hugging Face directory the RL presets take as their initial policy),
OUT/demos.jsonl (every demonstration: the exact RL prompt and the target answer),
OUT/warmstart.json (settings, timings, loss curve) and OUT/eval.md / eval.csv / eval_steps.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import time

from experiments.common import task_types
from orsd_jax.envs.webshop.oracle import SEARCHES
from orsd_jax.envs.webshop.world import GOAL_SETS
from orsd_jax.rollout import RolloutConfig
from orsd_jax.train_step import OptimizerConfig
from orsd_jax.warmstart import FinetuneConfig, WarmStartRun, run_warmstart


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--env", default="alfworld", choices=["alfworld", "webshop"], help="environment of the demonstrations"
    )
    p.add_argument("--data-dir", help="WebShop: the official files (default: $WEBSHOP_DATA)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name or Hugging Face directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--difficulty", default="easy", choices=["easy", "standard", "hard"])
    p.add_argument("--games-seed", type=int, default=0)
    p.add_argument("--demo-games", type=int, default=120, help="train games to demonstrate")
    p.add_argument(
        "--task-types",
        type=task_types,
        default=(),
        help="ALFWorld task types or WebShop categories to demonstrate and evaluate, comma-separated (default: all)",
    )
    p.add_argument("--goals", default="all", choices=GOAL_SETS, help="WebShop: the goal set demonstrated and evaluated")
    p.add_argument(
        "--search",
        default="title",
        choices=SEARCHES,
        help="WebShop: what the oracle searches, the goal product's title or the goal's own words (copyable)",
    )
    p.add_argument("--history-length", type=int, default=2, help="earlier steps shown in the prompt")
    p.add_argument("--max-detours", type=int, default=2, help="random visits before the plan (exploration)")
    p.add_argument(
        "--rubric-games",
        type=int,
        default=0,
        help="the first N games demonstrated once more with their oracle rubric in the prompt (rubric reading)",
    )
    p.add_argument("--reasoning", action="store_true", help="a reasoning sentence in <think> (default: empty)")
    p.add_argument("--frozen-layers", type=int, default=0, help="train only the layers above this many")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="split each optimizer step's rows into this many passes (one pass of 16 WebShop demonstrations "
        "of up to 2059 tokens asked for 45 GB)",
    )
    p.add_argument(
        "--pack-tokens",
        type=int,
        default=0,
        help="updates of --batch-size rows of this many tokens, several demonstrations a row: one compiled "
        "shape (default 0: a row per demonstration)",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-steps", type=int, help="episode step limit (default: ALFWorld 50, WebShop 15)")
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument(
        "--eval-games",
        type=int,
        default=50,
        help="ALFWorld valid_seen games or WebShop test goals to evaluate on (0: none)",
    )
    p.add_argument("--eval-temperature", type=float, default=0.4)
    p.add_argument("--sampler", default="vllm", choices=["vllm", "jax"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # before any game loads: the planner overwrites sys.argv
    max_steps = args.max_steps or (50 if args.env == "alfworld" else 15)
    rollout = RolloutConfig(
        max_steps=max_steps, max_prompt_tokens=args.max_prompt_tokens, history_length=args.history_length
    )
    run = WarmStartRun(
        env=args.env,
        data_dir=args.data_dir,
        model=args.model,
        difficulty=args.difficulty,
        games_seed=args.games_seed,
        demo_games=args.demo_games,
        task_types=args.task_types,
        goals=args.goals,
        search=args.search,
        max_detours=args.max_detours,
        reasoning=args.reasoning,
        rubric_games=args.rubric_games,
        frozen_layers=args.frozen_layers,
        rollout=rollout,
        train=FinetuneConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            micro_batches=args.micro_batches,
            pack_tokens=args.pack_tokens,
            optimizer=OptimizerConfig(learning_rate=args.lr, weight_decay=0.0),
        ),
    )
    out = pathlib.Path(args.out)
    started = time.perf_counter()
    policy = run_warmstart(run, out)
    print(f"warm start done in {time.perf_counter() - started:.0f} s: {policy}")
    if args.eval_games:
        from experiments.evaluate import evaluate_policy
        from orsd_jax.services import EnvSuite

        eval_rollout = dataclasses.replace(rollout, temperature=args.eval_temperature)
        if run.env == "alfworld":
            from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split

            root = default_games(run.difficulty, run.games_seed, run.train_games, run.eval_games)
            tasks = load_split(root, "valid_seen", args.task_types)[: args.eval_games]
            make_env = functools.partial(AlfworldEnv, max_steps=max_steps)
            split = "valid_seen"
        else:
            from orsd_jax.envs import webshop

            goals = webshop.load_goals(run.data_dir, "test", categories=run.task_types, goals=run.goals)
            tasks = goals[: args.eval_games]
            make_env = functools.partial(webshop.WebShopEnv, run.data_dir, max_steps=max_steps)
            build_prompt, split = webshop.build_prompt, "test"
        suite = EnvSuite(run.env, make_env, build_prompt, (), {split: tuple(tasks)})
        summary = evaluate_policy(policy, suite, tasks, eval_rollout, out, args.sampler, "warm start")
        info = json.loads((out / "warmstart.json").read_text())
        (out / "warmstart.json").write_text(json.dumps(info | {"eval": summary}, indent=2))
        print((out / "eval.md").read_text())


if __name__ == "__main__":
    main()
