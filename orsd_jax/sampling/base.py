"""The sampler interface: token ids in, token ids and log-probs out.

Two implementations: ``VLLMSampler`` (a vLLM server process, fed new weights after each update)
and ``JaxSampler`` (in-process, for tests, notebooks and machines without vLLM).
Log-probs are those of the *processed* distribution the token was drawn from (after
temperature, top-k and top-p), which is what an importance ratio against the sampler needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol


class SamplingError(ValueError):
    """A request that cannot be served as asked; raised before anything is sent."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before them unless include_stop
    include_stop: bool = False  # keep the stop string at the end of the text
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these
    seed: int | None = None
    n: int = 1  # samples per prompt
    regex: str | None = None  # the text must match this (vLLM structured outputs; JaxSampler refuses it)

    def validate(self) -> None:
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.n < 1:
            raise SamplingError(f"n must be positive, got {self.n}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty")


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per token in token_ids
    text: str
    finish_reason: str  # "stop" (stop token or string) | "length"
    weight_version: int = 0  # the weights that produced it


def validate_prompts(prompts: Sequence[Sequence[int]], max_model_len: int, params: SamplingParams) -> None:
    """Rejects what no sampler could serve: empty prompts, and prompts with no room to generate."""
    params.validate()
    if not prompts:
        raise SamplingError("no prompts given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise SamplingError(f"prompt {i} is empty")
        if len(prompt) + 1 > max_model_len:
            raise SamplingError(
                f"prompt {i} has {len(prompt)} tokens; the context holds {max_model_len}, "
                "which leaves no room to generate"
            )


class Sampler(Protocol):
    max_model_len: int
    weight_version: int

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams, groups: Sequence[int] | None = None
    ) -> list[Completion]:
        """``len(prompts) * params.n`` completions, prompt-major (all samples of prompt 0 first).

        ``max_new_tokens`` is clamped per prompt to the room left in the context. ``groups``: each
        prompt's group, which a sampler on several servers uses to keep a group on one server.
        """
        ...

    def push_weights(self, model, version: int) -> None: ...

    def close(self) -> None: ...
