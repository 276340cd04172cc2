"""Online rubric writing by the current policy, and the rubric the policy then reads.

The policy sees the task and its group's ``G`` trajectories (no rewards, see ``render``) and is
sampled ``K`` times for a list of 5-8 process criteria, freely or under the list's grammar
(``RubricConfig.constrained``). One sampler call serves every group.
The chosen bundle goes back into each step prompt as ``rubric_insert`` text at the end of the
user turn (see ``orsd_jax.chat``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from orsd_jax import chat
from orsd_jax.envs.base import Task
from orsd_jax.rollout import Group, Trajectory
from orsd_jax.rubrics.parse import MIN_CRITERIA, ParsedBundle, bundle_regex, parse_bundle
from orsd_jax.rubrics.render import render_group
from orsd_jax.sampling.base import Sampler, SamplingParams

RANK_TARGETS = ("outcome", "return")
SELECTIONS = ("spearman", "single", "random", "gap-alignment")


@dataclasses.dataclass(frozen=True)
class RubricConfig:
    candidates: int = 4  # K bundles sampled per group
    trajectory_budget_tokens: int = 300  # each trajectory cut to this in the rubric prompt
    max_prompt_tokens: int = 6000
    max_new_tokens: int = 400
    temperature: float = 1.0
    top_p: float = 1.0
    # Sample under the numbered-list grammar (``bundle_regex``; vLLM sampler only), lines of at most
    # ``criterion_chars``. Free, small writers stop after 2-4 items or ramble past 8; constrained,
    # long lines can still use up ``max_new_tokens`` before the fifth (docs/results/cpu-demo.md,
    # "The rubric writer").
    constrained: bool = False
    criterion_chars: int = 150
    # Selection keeps the best bundle only when its Spearman correlation reaches this (None: always,
    # the paper's rule, even when every bundle ranks the episodes backwards).
    min_correlation: float | None = None
    # What selection rank-correlates satisfaction with: "outcome" (the paper: the group's outcome
    # rewards) or "return" (outcome minus invalid-answer penalties, which also ranks groups whose
    # outcomes are all equal).
    rank_by: str = "outcome"
    # Where the candidates come from (``sources.SOURCES``): the policy's writing (the paper), the
    # oracle, another task's oracle bundle, or ``source_file`` (JSON: task key -> criteria).
    source: str = "policy"
    source_file: str | None = None
    # How a bundle is chosen: "spearman" (the paper: satisfaction vs the rank target), "single",
    # "random", or "gap-alignment" (``alignment``: the candidate whose replayed per-trajectory gap
    # rank-correlates best with the returns; one extra replay forward per step).
    selection: str = "spearman"
    # Rubric memory (``memory``, beyond the paper; off): the writer's prompt shows this many of the
    # best-recorded criteria of the task's type, and/or the remembered bundle of the type joins the
    # K candidates; at most ``memory_size`` criteria are kept per type.
    memory_examples: int = 0
    memory_candidate: bool = False
    memory_size: int = 16

    @property
    def uses_memory(self) -> bool:
        return bool(self.memory_examples) or self.memory_candidate

    def __post_init__(self):
        from orsd_jax.rubrics.sources import SOURCES

        if self.source not in SOURCES:
            raise ValueError(f"unknown rubric source {self.source!r}; expected one of {SOURCES}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown selection {self.selection!r}; expected one of {SELECTIONS}")
        if (self.source == "file") != (self.source_file is not None):
            raise ValueError("rubric source 'file' and source_file go together")
        if self.rank_by not in RANK_TARGETS:
            raise ValueError(f"unknown rank target {self.rank_by!r}; expected one of {RANK_TARGETS}")
        if self.constrained:
            bundle_regex(self.criterion_chars)  # refuses a line length no criterion fits
        if self.memory_examples and self.source != "policy":
            raise ValueError("memory examples go into the writer's prompt: they need rubric source 'policy'")
        if self.memory_size < MIN_CRITERIA:
            raise ValueError(f"memory_size must hold a bundle ({MIN_CRITERIA} criteria), got {self.memory_size}")
        if self.memory_examples < 0:
            raise ValueError(f"memory_examples must be at least 0, got {self.memory_examples}")


def rubric_prompt(task: str, attempts: str, n_attempts: int, examples: Sequence[str] = ()) -> str:
    """The writer's request; ``examples`` (the rubric memory's best criteria for tasks of this
    kind) are shown before it, to reuse or improve on."""
    shown = "".join(f"- {c}\n" for c in examples)
    before = f"Criteria that separated better attempts at tasks of this kind before:\n{shown}\n" if examples else ""
    return (
        f"Several attempts by an agent at the same task are shown below.\n"
        f"Task: {task}\n\n{attempts}\n\n{before}"
        f"Compare the {n_attempts} attempts and write between 5 and 8 criteria about the process "
        "(which actions were chosen, in what order, what was checked or repeated) that separate "
        "better attempts from worse ones. Each criterion is one sentence that can be answered "
        "yes or no for any attempt. Write them as a numbered list, one per line, and nothing else."
    )


def rubric_insert(criteria: Sequence[str]) -> str:
    """The text appended to a step's user message when the policy reads the rubric."""
    numbered = "\n".join(f"{k}. {c}" for k, c in enumerate(criteria, start=1))
    return f"\n\nA good attempt at this task satisfies these criteria:\n{numbered}"


def group_prompt(
    task: Task,
    trajectories: Sequence[Trajectory],
    config: RubricConfig,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
    examples: Sequence[str] = (),
) -> list[int]:
    """The rubric writer's prompt for one group: every trajectory rendered within the token budget,
    halved until the whole prompt fits ``config.max_prompt_tokens``."""

    def count_tokens(text: str) -> int:
        return len(chat.encode(tokenizer, text))

    budget = config.trajectory_budget_tokens
    while True:
        attempts = render_group(trajectories, budget, count_tokens)
        ids = chat.prompt_ids(fmt, tokenizer, rubric_prompt(task.description, attempts, len(trajectories), examples))
        if len(ids) <= config.max_prompt_tokens:
            return ids
        if budget <= 16:
            raise ValueError(
                f"the rubric prompt for {task.key} needs {len(ids)} tokens even with "
                f"{budget}-token trajectories; raise RubricConfig.max_prompt_tokens"
            )
        budget //= 2  # shorter renderings until the whole group fits


def generate_bundles(
    sampler: Sampler,
    groups: Sequence[Group],
    config: RubricConfig,
    seed: int,
    *,
    tokenizer,
    fmt: chat.ChatFormat,
    examples: Sequence[Sequence[str]] | None = None,
) -> list[tuple[ParsedBundle, ...]]:
    """``K`` parsed bundles per group (valid or not), in one sampler call; ``examples``: per group,
    the criteria its writer's prompt shows (the rubric memory's)."""
    shown = examples or [()] * len(groups)
    prompts = [
        group_prompt(g.task, g.trajectories, config, tokenizer=tokenizer, fmt=fmt, examples=e)
        for g, e in zip(groups, shown)
    ]
    params = SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens,
        stop_token_ids=fmt.stop_token_ids,
        seed=seed,
        n=config.candidates,
        regex=bundle_regex(config.criterion_chars) if config.constrained else None,
    )
    completions = sampler.generate(prompts, params)
    k = config.candidates
    bundles = [parse_bundle(c.text, cut=c.finish_reason == "length") for c in completions]
    return [tuple(bundles[g * k : (g + 1) * k]) for g in range(len(groups))]
