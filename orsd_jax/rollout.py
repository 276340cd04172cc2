"""Group rollouts: ``n_tasks x G`` episodes played to completion.

Turn-synchronous by default: every still-active environment's prompt goes into a single
``Sampler.generate`` call per turn (the sampler batches them), the answers are parsed with the
shared ``<think>/<action>`` parser and all environments step concurrently in the ``EnvPool``.
Asynchronous episodes (``RolloutConfig.asynchronous``) each go on as soon as their own step is
back. The result is immutable records:
per step what the policy saw and said, per trajectory the outcome.

Prompt budget rule (never silent): a prompt over ``max_prompt_tokens`` first loses history
entries, oldest first; if the prompt without history is still too long, the middle of the
current observation is replaced by `` [...] `` until it fits. The step records ``truncated``
and the collection counts them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from orsd_jax import chat, seeds
from orsd_jax.envs.actions import ParsedAction, parse_action
from orsd_jax.envs.base import EnvStep, Task
from orsd_jax.envs.pool import EnvPool
from orsd_jax.sampling.base import Completion, Sampler, SamplingParams

PromptBuilder = Callable[..., str]  # (task_description, observation, admissible, history, step_count, history_length)
Prompt = tuple[str, list[int], bool]  # user text, prompt ids, whether it was cut to fit


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
    # Each episode on its own (see collect_groups); off: verl-agent's turn-synchronous loop.
    asynchronous: bool = False


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
    sampler_seconds: float  # the sampler busy (a call in flight)
    env_seconds: float  # the environments busy
    overlap_seconds: float  # both at once (asynchronous episodes)
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


class _Clock:
    """Busy intervals of the sampler and of the environments (threads may overlap them)."""

    def __init__(self) -> None:
        self._intervals: dict[str, list[tuple[float, float]]] = {"sampler": [], "envs": []}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def busy(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._intervals[stage].append((t0, time.perf_counter()))

    def seconds(self) -> tuple[float, float, float]:
        """Seconds the sampler was busy, the environments were, and both at once."""
        sampler, envs = (_merged(self._intervals[k]) for k in ("sampler", "envs"))
        both = sum(
            max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in sampler for b0, b1 in envs
        )  # merged intervals are disjoint, so the pairwise intersections add up
        return _length(sampler), _length(envs), both


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


class _Episode:
    """One episode in play: what its next prompt is built from, and its steps so far."""

    def __init__(self, task: Task, first: EnvStep):
        self.task, self.current = task, first
        self.steps: list[Step] = []
        self.history: list[tuple[str, str]] = []

    def prompt(self, config: RolloutConfig, build_prompt: PromptBuilder, fmt, tokenizer) -> Prompt:
        current = self.current
        return fit_prompt(
            build_prompt,
            fmt,
            tokenizer,
            config.max_prompt_tokens,
            self.task,
            current.observation,
            current.admissible_actions,
            self.history,
            len(self.steps),
            config.history_length,
        )

    def parse(self, fmt: chat.ChatFormat, completion: Completion) -> ParsedAction:
        # The answer starts with what the chat template pre-filled (Qwen3's empty think block).
        return parse_action(fmt.prefill + completion.text, self.current.admissible_actions)

    def advance(self, prompt: Prompt, c: Completion, p: ParsedAction, result: EnvStep) -> None:
        text, ids, cut = prompt
        self.steps.append(
            Step(
                user_text=text,
                prompt_ids=tuple(ids),
                response_ids=c.token_ids,
                logprobs=c.logprobs,
                response_text=c.text,
                observation=self.current.observation,
                action=p.action,
                valid_format=p.valid_format,
                admissible=p.admissible,
                reward=result.reward,
                truncated=cut,
                weight_version=c.weight_version,
            )
        )
        self.history.append((self.current.observation, p.action or ""))
        self.current = result

    def trajectory(self) -> Trajectory:
        return Trajectory(task=self.task, steps=tuple(self.steps), won=self.current.won, score=self.current.score)


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
    """Plays ``group_size`` episodes of each task; environment ``i`` plays ``tasks[i // group_size]``.

    Turn-synchronous (verl-agent's loop): one sampler call per turn for every live episode, then
    every environment steps. ``config.asynchronous``: each episode asks for its next answer as
    soon as its observation is back, so environments step while other episodes generate; turn
    ``t`` of episode ``i`` samples with seed ``derive(seed, t, i)`` (the synchronous loop:
    ``derive(seed, t)`` for the turn's call), so only greedy decoding plays the same episodes.
    """
    n = len(tasks) * group_size
    if envs.n_envs != n:
        raise ValueError(f"the pool holds {envs.n_envs} environments; {len(tasks)} tasks x {group_size} need {n}")
    start = time.perf_counter()
    task_of = [tasks[i // group_size] for i in range(n)]
    clock = _Clock()
    params = SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_response_tokens,
        stop=config.stop,
        include_stop=True,  # the parser needs the closing tag
        stop_token_ids=fmt.stop_token_ids,
    )
    prompt_of = functools.partial(
        _Episode.prompt, config=config, build_prompt=build_prompt, fmt=fmt, tokenizer=tokenizer
    )
    loop = _play_asynchronously if config.asynchronous else _play_by_turns
    episodes = loop(task_of, _Play(sampler, envs, config, params, seed, clock, prompt_of, fmt, group_size))
    trajectories = [e.trajectory() for e in episodes]
    groups = tuple(
        Group(task=tasks[g], trajectories=tuple(trajectories[g * group_size : (g + 1) * group_size]))
        for g in range(len(tasks))
    )
    steps = [s for t in trajectories for s in t.steps]
    sampler_seconds, env_seconds, both = clock.seconds()
    stats = RolloutStats(
        env_steps=len(steps),
        generated_tokens=sum(len(s.response_ids) for s in steps),
        prompt_tokens=sum(len(s.prompt_ids) for s in steps),
        truncated_prompts=sum(s.truncated for s in steps),
        invalid_answers=sum(not s.valid for s in steps),
        sampler_seconds=sampler_seconds,
        env_seconds=env_seconds,
        overlap_seconds=both,
        wall_seconds=time.perf_counter() - start,
    )
    return groups, stats


@dataclasses.dataclass(frozen=True)
class _Play:
    """What both loops play with."""

    sampler: Sampler
    envs: EnvPool
    config: RolloutConfig
    params: SamplingParams
    seed: int
    clock: _Clock
    prompt_of: Callable[[_Episode], Prompt]
    fmt: chat.ChatFormat
    group_size: int  # episode i belongs to group i // group_size


def _play_by_turns(task_of: list[Task], play: _Play) -> list[_Episode]:
    with play.clock.busy("envs"):
        episodes = [_Episode(t, first) for t, first in zip(task_of, play.envs.reset(task_of))]
    for turn in range(play.config.max_steps):
        live = [i for i, e in enumerate(episodes) if not e.current.done]
        if not live:
            break
        prompts = [play.prompt_of(episodes[i]) for i in live]
        with play.clock.busy("sampler"):
            # One seed per turn; samplers draw independent samples for the prompts of one call.
            params = dataclasses.replace(play.params, seed=seeds.derive(play.seed, turn))
            groups = [i // play.group_size for i in live]
            completions = play.sampler.generate([ids for _, ids, _ in prompts], params, groups)
        parsed = [episodes[i].parse(play.fmt, c) for i, c in zip(live, completions)]
        actions: list[str | None] = [None] * len(episodes)
        for i, p in zip(live, parsed):
            actions[i] = p.action or ""  # an unparseable answer is a no-op that still uses a step
        with play.clock.busy("envs"):
            results = play.envs.step(actions)
        for i, prompt, c, p in zip(live, prompts, completions, parsed):
            result = results[i]
            assert result is not None  # every live env was sent an action
            episodes[i].advance(prompt, c, p, result)
    return episodes


def _play_asynchronously(task_of: list[Task], play: _Play) -> list[_Episode]:
    # A sampler that cannot serve calls from several threads (the in-process JAX one) takes them
    # one at a time; environments still step meanwhile.
    serial: contextlib.AbstractContextManager = (
        contextlib.nullcontext() if getattr(play.sampler, "concurrent_calls", False) else threading.Lock()
    )

    def run(i: int) -> _Episode:
        # Each episode resets its own environment: the first prompts generate while later games load.
        with play.clock.busy("envs"):
            episode = _Episode(task_of[i], play.envs.reset_one(i, task_of[i]))
        for turn in range(play.config.max_steps):
            if episode.current.done:
                break
            prompt = play.prompt_of(episode)
            with play.clock.busy("sampler"), serial:
                params = dataclasses.replace(play.params, seed=seeds.derive(play.seed, turn, i))
                [c] = play.sampler.generate([prompt[1]], params, [i // play.group_size])
            p = episode.parse(play.fmt, c)
            with play.clock.busy("envs"):
                result = play.envs.step_one(i, p.action or "")
            episode.advance(prompt, c, p, result)
        return episode

    with concurrent.futures.ThreadPoolExecutor(len(task_of), thread_name_prefix="episode") as pool:
        return [future.result() for future in [pool.submit(run, i) for i in range(len(task_of))]]


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
        "time/rollout_sampler": stats.sampler_seconds,
        "time/rollout_envs": stats.env_seconds,
        "time/rollout_overlap": stats.overlap_seconds,
    }
    for task_type in sorted({t.task.task_type for t in trajs}):
        out[f"env/success/{task_type}"] = float(np.mean([t.won for t in trajs if t.task.task_type == task_type]))
    return out
