"""Evaluate a policy on an evaluation split: success per task type and the valid-answer rate.

    python -m experiments.evaluate --policy runs/cpu-demo-alfworld-orsd/policy --split valid_unseen
    python -m experiments.evaluate                       # the cpu-demo preset's warm start (cached)
    python -m experiments.evaluate --env webshop --preset tiny --policy DIR --games 100

The split, the games and the rollout settings (step limit, prompt budget) come from ``--preset``;
one deterministic sweep (seeded sampling at ``--temperature``) over the first ``--games`` tasks.
Writes OUT/eval.md, OUT/eval.csv (per episode) and OUT/eval_steps.jsonl (every step's
observation, answer and validity) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from experiments.common import task_types
from orsd_jax.config import PRESETS, preset


def evaluate_policy(
    policy, suite, tasks, rollout, out: pathlib.Path, sampler_kind: str, title: str, seed: int = 0
) -> dict:
    """Success and valid-answer rate of the Hugging Face directory ``policy`` on ``tasks`` of ``suite``."""
    from orsd_jax import chat, evaluation
    from orsd_jax.envs import EnvPool
    from orsd_jax.models import load_model

    max_len = rollout.max_prompt_tokens + rollout.max_response_tokens
    if sampler_kind == "vllm":  # the server loads the weights; this process needs the tokenizer only
        from orsd_jax.models import load_tokenizer
        from orsd_jax.sampling.vllm_sampler import VLLMSampler
        from orsd_jax.sampling.vllm_server import ServerOptions

        tokenizer = load_tokenizer(policy)
        sampler = VLLMSampler(policy, tokenizer, options=ServerOptions(max_model_len=max_len))
    else:
        from orsd_jax.sampling.jax_sampler import JaxSampler

        model, tokenizer = load_model(policy)
        sampler = JaxSampler(model, tokenizer, max_model_len=max_len)
    fmt = chat.chat_format(tokenizer)
    pool = EnvPool(suite.make_env, n_envs=min(16, len(tasks)))
    try:
        episodes = evaluation.sweep(
            sampler, pool, tasks, rollout, seed=seed, tokenizer=tokenizer, fmt=fmt, build_prompt=suite.build_prompt
        )
    finally:
        pool.close()
        sampler.close()
    evaluation.write(suite.name, episodes, out, title)
    return evaluation.summary(suite.name, episodes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", help="Hugging Face directory or registry name (default: the preset's initial policy)")
    p.add_argument("--env", default="alfworld", choices=["alfworld", "webshop"])
    p.add_argument("--preset", default="cpu-demo", choices=sorted(PRESETS))
    p.add_argument("--split", help="ALFWorld: valid_seen or valid_unseen; WebShop: test (default: the preset's first)")
    p.add_argument("--games", type=int, help="tasks to evaluate (default: the preset's eval_games)")
    p.add_argument("--task-types", type=task_types, help="ALFWorld task types, comma-separated (default: the preset's)")
    p.add_argument("--temperature", type=float, help="default: the preset's eval temperature")
    p.add_argument("--sampler", default="vllm", choices=["vllm", "jax"])
    p.add_argument(
        "--run-seed",
        type=int,
        help="sample as the final evaluation of a training run with this --seed does (default: the sweep's seed 0)",
    )
    p.add_argument("--data-dir", help="WebShop data (default $WEBSHOP_DATA)")
    p.add_argument("--out", default="runs/eval", help="output directory")
    args = p.parse_args(argv)  # before any game loads: the planner overwrites sys.argv
    config = preset(args.preset, args.env)
    split = args.split or config.eval_splits[0]
    env = dataclasses.replace(
        config.env,
        eval_splits=(split,),
        data_dir=args.data_dir or config.env.data_dir,
        task_types=args.task_types or config.env.task_types,
    )
    config = dataclasses.replace(config, env=env)
    from orsd_jax.models import resolve
    from orsd_jax.services import make_suite

    if args.policy:
        policy = resolve(args.policy)
    elif config.model.warmstart is not None:
        from orsd_jax.warmstart import cached_warmstart

        policy = cached_warmstart(config.model.warmstart)
    else:
        policy = resolve(config.model.name)
    suite = make_suite(config)
    tasks = suite.eval[split][: args.games or config.eval_games]
    rollout = dataclasses.replace(
        config.rollout, temperature=config.eval_temperature if args.temperature is None else args.temperature
    )
    out = pathlib.Path(args.out)
    from orsd_jax import seeds

    seed = 0 if args.run_seed is None else seeds.derive(args.run_seed, seeds.EVALUATION)
    summary = evaluate_policy(policy, suite, tasks, rollout, out, args.sampler, f"{policy} on {split}", seed)
    print((out / "eval.md").read_text())
    print(", ".join(f"{k} {v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
