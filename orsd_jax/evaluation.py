"""Deterministic evaluation sweeps: every task of a split played once, in split order.

Episodes run ``pool.n_envs`` at a time through the same rollout code as training (group size 1).
ALFWorld reports success per task type and overall; WebShop reports score (mean reward x 100)
and success (reward == 1). Both report the fraction of steps whose answer was valid, and write
every step's observation and answer, to see what the invalid ones were.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Sequence

from orsd_jax import chat, seeds
from orsd_jax.envs.alfworld.metrics import success_markdown, success_table
from orsd_jax.envs.base import Task
from orsd_jax.envs.pool import EnvPool
from orsd_jax.rollout import PromptBuilder, RolloutConfig, Trajectory, collect_groups
from orsd_jax.sampling.base import Sampler


@dataclasses.dataclass(frozen=True)
class Episode:
    key: str
    task_type: str
    won: bool
    score: float
    steps: int
    valid_steps: int
    # (observation, answer, valid) per step: eval_steps.jsonl, not the CSV.
    transcript: tuple[tuple[str, str, bool], ...] = dataclasses.field(default=(), repr=False)


_COLUMNS = ("key", "task_type", "won", "score", "steps", "valid_steps")


def sweep(
    sampler: Sampler,
    pool: EnvPool,
    tasks: Sequence[Task],
    config: RolloutConfig,
    seed: int,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
    build_prompt: PromptBuilder,
) -> list[Episode]:
    """Plays each task once; chunks of ``pool.n_envs`` tasks (the last chunk is padded with repeats)."""
    episodes: list[Episode] = []
    for start in range(0, len(tasks), pool.n_envs):
        chunk = list(tasks[start : start + pool.n_envs])
        padded = chunk + [chunk[-1]] * (pool.n_envs - len(chunk))
        groups, _ = collect_groups(
            sampler,
            pool,
            padded,
            1,
            config,
            seeds.derive(seed, start),
            tokenizer=tokenizer,
            fmt=fmt,
            build_prompt=build_prompt,
        )
        episodes += [_episode(g.trajectories[0]) for g in groups[: len(chunk)]]
    return episodes


def _episode(t: Trajectory) -> Episode:
    transcript = tuple((s.observation, s.response_text, s.valid) for s in t.steps)
    return Episode(
        t.task.key, t.task.task_type, t.won, t.score, len(t.steps), sum(s.valid for s in t.steps), transcript
    )


def summary(env: str, episodes: Sequence[Episode]) -> dict[str, float]:
    """Success (ALFWorld: per task type too) or score and success (WebShop), and the valid-step rate."""
    steps = sum(e.steps for e in episodes)
    out = {"episodes": float(len(episodes)), "valid_step_rate": sum(e.valid_steps for e in episodes) / max(steps, 1)}
    if env == "alfworld":
        out |= {f"success/{k}": v for k, v in success_table((e.task_type, e.won) for e in episodes).items()}
    else:
        out |= {"success/All": sum(e.won for e in episodes) / max(len(episodes), 1)}
        out["score"] = 100 * sum(e.score for e in episodes) / max(len(episodes), 1)
    return out


def markdown(env: str, episodes: Sequence[Episode], title: str) -> str:
    if env == "alfworld":
        table = success_markdown(((e.task_type, e.won) for e in episodes), title)
    else:
        s = summary(env, episodes)
        table = (
            f"| | Score | Success (%) |\n|---|---:|---:|\n| {title} | {s['score']:.1f} | {100 * s['success/All']:.1f} |"
        )
    rate = summary(env, episodes)["valid_step_rate"]
    return f"{table}\n\nValid answers: {100 * rate:.1f}% of {sum(e.steps for e in episodes)} steps."


def write(env: str, episodes: Sequence[Episode], out_dir: str | os.PathLike, title: str) -> None:
    """``eval.md`` (the table), ``eval.csv`` (one row per episode) and ``eval_steps.jsonl`` (one row
    per step: observation, answer, valid) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "eval.md"), "w") as f:
        f.write(markdown(env, episodes, title) + "\n")
    with open(os.path.join(out_dir, "eval.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_COLUMNS)
        writer.writeheader()
        writer.writerows({k: getattr(e, k) for k in _COLUMNS} for e in episodes)
    with open(os.path.join(out_dir, "eval_steps.jsonl"), "w") as f:
        for e in episodes:
            for step, (observation, answer, valid) in enumerate(e.transcript):
                row = {"key": e.key, "step": step, "observation": observation, "answer": answer, "valid": valid}
                f.write(json.dumps(row) + "\n")
