"""Group rollouts: ``n_tasks x G`` episodes played to completion, one sampler call per turn.

Every still-active environment's prompt goes into a single ``Sampler.generate`` call per turn
(the sampler batches them), the answers are parsed with the shared ``<think>/<action>`` parser
and all environments step concurrently in the ``EnvPool``. The result is immutable records:
per step what the policy saw and said, per trajectory the outcome.

Prompt budget rule (never silent): a prompt over ``max_prompt_tokens`` first loses history
entries, oldest first; if the prompt without history is still too long, the middle of the
current observation is replaced by `` [...] `` until it fits. The step records ``truncated``
and the collection counts them.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence

import numpy as np

from orsd_jax import chat, seeds
from orsd_jax.envs.actions import parse_action
from orsd_jax.envs.base import EnvStep, Task
from orsd_jax.envs.pool import EnvPool
from orsd_jax.sampling.base import Sampler, SamplingParams

PromptBuilder = Callable[..., str]  # (task_description, observation, admissible, history, step_count, history_length)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_steps: int = 50  # environment steps per episode (ALFWorld 50, WebShop 15)
    history_length: int = 2
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Generation ends at the end of the answer: nothing after </action> is ever used.
    stop: tuple[str, ...] = ("</action>",)


@dataclasses.dataclass(frozen=True)
class Step:
    user_text: str  # the user message as sent (after any truncation)
    prompt_ids: tuple[int, ...]  # chat head + user text + tail
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # sampler log-probs of response_ids
    response_text: str
    observation: str  # the environment text the action was chosen on (the GiGPO anchor)
    action: str | None  # parsed action, None when the answer had no action tags
    valid_format: bool  # think and action tags, no CJK (verl-agent's validity)
    admissible: bool  # the action is one the environment admits
    reward: float  # environment reward of this transition
    truncated: bool  # the prompt was cut to fit the budget
    weight_version: int

    @property
    def valid(self) -> bool:
        """Well formed and admissible."""
        return self.valid_format and self.admissible


@dataclasses.dataclass(frozen=True)
class Trajectory:
    task: Task
    steps: tuple[Step, ...]
    won: bool
    score: float

    @property
    def reward(self) -> float:
        """Outcome reward: the sum of environment rewards (verl-agent: 10 if won, else 0)."""
        return float(sum(s.reward for s in self.steps))


@dataclasses.dataclass(frozen=True)
class Group:
    task: Task
    trajectories: tuple[Trajectory, ...]

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(t.reward for t in self.trajectories)


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    env_steps: int
    generated_tokens: int
    prompt_tokens: int
    truncated_prompts: int
    invalid_answers: int
    sampler_seconds: float
    env_seconds: float
    wall_seconds: float


def fit_prompt(
    build: PromptBuilder,
    fmt: chat.ChatFormat,
    tokenizer,
    budget: int,
    task: Task,
    observation: str,
    admissible: Sequence[str],
    history: Sequence[tuple[str, str]],
    step_count: int,
    history_length: int,
) -> tuple[str, list[int], bool]:
    """The user text and prompt ids under ``budget`` tokens, and whether anything was cut."""
    shown = list(history[-history_length:]) if history_length else []
    for drop in range(len(shown) + 1):
        text = build(task.description, observation, admissible, shown[drop:], step_count, history_length)
        ids = chat.prompt_ids(fmt, tokenizer, text)
        if len(ids) <= budget:
            return text, ids, drop > 0
    # Still too long without history: cut the middle of the observation.
    keep = len(observation)
    while keep > 0:
        keep = int(keep * min(0.9, budget / len(ids)))
        cut = observation[: keep // 2] + " [...] " + observation[len(observation) - keep // 2 :]
        text = build(task.description, cut, admissible, [], step_count, history_length)
        ids = chat.prompt_ids(fmt, tokenizer, text)
        if len(ids) <= budget:
            return text, ids, True
    raise ValueError(
        f"the prompt for {task.key} does not fit in {budget} tokens even with an empty observation; "
        "raise max_prompt_tokens"
    )


def collect_groups(
    sampler: Sampler,
    envs: EnvPool,
    tasks: Sequence[Task],
    group_size: int,
    config: RolloutConfig,
    seed: int,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
    build_prompt: PromptBuilder,
) -> tuple[tuple[Group, ...], RolloutStats]:
    """Plays ``group_size`` episodes of each task; environment ``i`` plays ``tasks[i // group_size]``."""
    n = len(tasks) * group_size
    if envs.n_envs != n:
        raise ValueError(f"the pool holds {envs.n_envs} environments; {len(tasks)} tasks x {group_size} need {n}")
    start = time.perf_counter()
    task_of = [tasks[i // group_size] for i in range(n)]
    t0 = time.perf_counter()
    current: list[EnvStep] = envs.reset(task_of)
    env_seconds = time.perf_counter() - t0
    sampler_seconds = 0.0
    steps: list[list[Step]] = [[] for _ in range(n)]
    history: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    active = [not s.done for s in current]
    params = SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_response_tokens,
        stop=config.stop,
        include_stop=True,  # the parser needs the closing tag
        stop_token_ids=fmt.stop_token_ids,
    )
    generated = prompt_tokens = truncated = invalid = env_steps = 0
    for turn in range(config.max_steps):
        live = [i for i in range(n) if active[i]]
        if not live:
            break
        prompts = [
            fit_prompt(
                build_prompt,
                fmt,
                tokenizer,
                config.max_prompt_tokens,
                task_of[i],
                current[i].observation,
                current[i].admissible_actions,
                history[i],
                len(steps[i]),
                config.history_length,
            )
            for i in live
        ]
        t0 = time.perf_counter()
        # One seed per turn; samplers draw independent samples for the prompts of one call.
        completions = sampler.generate(
            [ids for _, ids, _ in prompts], dataclasses.replace(params, seed=seeds.derive(seed, turn))
        )
        sampler_seconds += time.perf_counter() - t0
        # The answer starts with what the chat template pre-filled (Qwen3's empty think block).
        parsed = [parse_action(fmt.prefill + c.text, current[i].admissible_actions) for i, c in zip(live, completions)]
        actions: list[str | None] = [None] * n
        for i, p in zip(live, parsed):
            actions[i] = p.action or ""  # an unparseable answer is a no-op that still uses a step
        t0 = time.perf_counter()
        results = envs.step(actions)
        env_seconds += time.perf_counter() - t0
        for i, (text, ids, cut), c, p in zip(live, prompts, completions, parsed):
            result = results[i]
            assert result is not None  # every live env was sent an action
            steps[i].append(
                Step(
                    user_text=text,
                    prompt_ids=tuple(ids),
                    response_ids=c.token_ids,
                    logprobs=c.logprobs,
                    response_text=c.text,
                    observation=current[i].observation,
                    action=p.action,
                    valid_format=p.valid_format,
                    admissible=p.admissible,
                    reward=result.reward,
                    truncated=cut,
                    weight_version=c.weight_version,
                )
            )
            history[i].append((current[i].observation, p.action or ""))
            current[i] = result
            active[i] = not result.done
            generated += len(c.token_ids)
            prompt_tokens += len(ids)
            truncated += cut
            invalid += not p.valid
            env_steps += 1
    trajectories = [
        Trajectory(task=task_of[i], steps=tuple(steps[i]), won=current[i].won, score=current[i].score) for i in range(n)
    ]
    groups = tuple(
        Group(task=tasks[g], trajectories=tuple(trajectories[g * group_size : (g + 1) * group_size]))
        for g in range(len(tasks))
    )
    stats = RolloutStats(
        env_steps=env_steps,
        generated_tokens=generated,
        prompt_tokens=prompt_tokens,
        truncated_prompts=truncated,
        invalid_answers=invalid,
        sampler_seconds=sampler_seconds,
        env_seconds=env_seconds,
        wall_seconds=time.perf_counter() - start,
    )
    return groups, stats


def tasks_for_update(train: Sequence[Task], n_tasks: int, seed: int, update: int) -> list[Task]:
    """The data cursor: epochs of seeded shuffles of the train tasks, ``n_tasks`` per update."""
    orders: dict[int, list[int]] = {}  # epoch -> its shuffle, drawn once
    out = []
    for idx in range(update * n_tasks, (update + 1) * n_tasks):
        epoch, pos = divmod(idx, len(train))
        if epoch not in orders:
            orders[epoch] = list(range(len(train)))
            random.Random(f"{seed}/epoch{epoch}").shuffle(orders[epoch])
        out.append(train[orders[epoch][pos]])
    return out


def rollout_metrics(groups: Sequence[Group], stats: RolloutStats) -> dict[str, float]:
    """Outcomes (``env/``, per task type too) and the interaction budget (``rollout/``) of an update."""
    trajs = [t for g in groups for t in g.trajectories]
    out = {
        "env/success": float(np.mean([t.won for t in trajs])),
        "env/score": float(np.mean([t.score for t in trajs])),
        "env/reward": float(np.mean([t.reward for t in trajs])),
        "env/steps": float(np.mean([len(t.steps) for t in trajs])),
        "env/invalid_rate": stats.invalid_answers / max(stats.env_steps, 1),
        "env/mixed_groups": float(np.mean([len(set(g.rewards)) > 1 for g in groups])),
        "rollout/env_steps": float(stats.env_steps),
        "rollout/truncated_prompts": float(stats.truncated_prompts),
        "rollout/generated_tokens": float(stats.generated_tokens),  # the interaction budget (study reports)
        "rollout/generated_tokens_per_s": stats.generated_tokens / max(stats.sampler_seconds, 1e-9),
        "rollout/env_steps_per_s": stats.env_steps / max(stats.wall_seconds, 1e-9),
        "time/rollout": stats.wall_seconds,
    }
    for task_type in sorted({t.task.task_type for t in trajs}):
        out[f"env/success/{task_type}"] = float(np.mean([t.won for t in trajs if t.task.task_type == task_type]))
    return out
