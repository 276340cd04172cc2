"""The frozen verifier: does trajectory ``i`` satisfy criterion ``k`` of bundle ``b``?

``OpenAIVerifier`` talks to any OpenAI-compatible chat endpoint through the ``openai`` client:
the paper's Qwen3.5-Plus on DashScope (``DASHSCOPE`` preset) or, by default, a local vLLM server
holding the frozen initial policy. Two modes:

- ``binary``: one request per (trajectory, bundle) asking for a JSON object mapping each
  criterion number to "yes" or "no"; a tolerant parser reads it.
- ``logprob``: one request per (trajectory, criterion) asking for a one-word yes/no answer;
  the score is ``p(yes) / (p(yes) + p(no))`` from the first token's top log-probs. Small models
  rarely write valid JSON but always put mass on "yes" and "no".

Requests run with bounded concurrency, a timeout, and retries with exponential backoff. A
(trajectory, bundle) pair that still fails leaves NaN in its row, which marks the bundle
invalid for selection. Successful answers are cached on disk by a hash of the request, so
reruns and resumed runs do not pay twice; failures are never cached.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import re
import threading
import time
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax import chat
from orsd_jax.rollout import Trajectory
from orsd_jax.rubrics.render import render_trajectory

VERIFIER_PROMPT_VERSION = 1
_YES = {"yes", "y", "true", "1", "satisfied", "pass"}
_NO = {"no", "n", "false", "0", "unsatisfied", "not satisfied", "fail"}
_LINE_ANSWER = re.compile(r"(\d{1,2})\s*[\"']?\s*[.:)=-]\s*[\"']?\s*(yes|no|true|false)\b", re.I)


class Verifier(Protocol):
    def score_many(
        self, task: str, trajectories: Sequence[Trajectory], bundles: Sequence[Sequence[str]]
    ) -> list[np.ndarray]:
        """One ``float[G, n_criteria]`` per bundle; NaN rows for pairs that could not be scored."""
        ...


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
    base_url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"  # read at construction; a local server needs none
    mode: str = "binary"  # "binary" | "logprob"
    concurrency: int = 8
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 1.0  # first retry waits this long, then doubles
    max_tokens: int = 200
    trajectory_budget_tokens: int = 1500  # each trajectory cut to this (about 4 characters a token)
    extra_body: tuple[tuple[str, object], ...] = ()  # provider options, e.g. (("enable_thinking", False),)
    cache_dir: str | None = None
    price_per_m_input: float = 0.0  # USD per million tokens, for the cost counter
    price_per_m_output: float = 0.0

    def __post_init__(self):
        if self.mode not in ("binary", "logprob"):
            raise ValueError(f"verifier mode must be 'binary' or 'logprob', got {self.mode!r}")


# The paper's verifier: Qwen3.5-Plus through DashScope's OpenAI-compatible mode (international
# endpoint; in mainland China use https://dashscope.aliyuncs.com/compatible-mode/v1).
DASHSCOPE = VerifierConfig(
    base_url="https://dashscope-intl.aliyuncs.com/compatible-mode/v1",
    model="qwen3.5-plus",
    api_key_env="DASHSCOPE_API_KEY",
    extra_body=(("enable_thinking", False),),
    price_per_m_input=0.4,
    price_per_m_output=2.4,
)


@dataclasses.dataclass
class VerifierStats:
    """Counters since construction (or the last ``reset``)."""

    calls: int = 0  # HTTP requests sent, retries included
    retries: int = 0
    failures: int = 0  # requests that failed after every retry
    cache_hits: int = 0
    latency_s: float = 0.0  # summed over successful requests
    input_tokens: int = 0
    output_tokens: int = 0

    def cost_usd(self, config: VerifierConfig) -> float:
        return (self.input_tokens * config.price_per_m_input + self.output_tokens * config.price_per_m_output) / 1e6


def binary_prompt(task: str, trajectory_text: str, criteria: Sequence[str]) -> str:
    numbered = "\n".join(f"{k}. {c}" for k, c in enumerate(criteria, start=1))
    example = ", ".join(f'"{k}": "yes"' if k % 2 else f'"{k}": "no"' for k in range(1, min(len(criteria), 3) + 1))
    return (
        f"An agent attempted this task: {task}\n\n"
        f"What it saw and did, step by step:\n{trajectory_text}\n\n"
        f"Criteria:\n{numbered}\n\n"
        "For each criterion, judge whether the attempt satisfies it. Reply with only a JSON object that "
        f"maps every criterion number to \"yes\" or \"no\", for example {{{example}}}."
    )


def criterion_prompt(task: str, trajectory_text: str, criterion: str) -> str:
    return (
        f"An agent attempted this task: {task}\n\n"
        f"What it saw and did, step by step:\n{trajectory_text}\n\n"
        f"Criterion: {criterion}\n"
        "Does the attempt satisfy the criterion? Answer with one word: yes or no."
    )


def parse_binary_answer(text: str, n_criteria: int) -> list[float] | None:
    """``[n]`` of 0/1 from a reply, or None if some criterion has no readable answer."""
    if not isinstance(text, str):
        return None
    found: dict[int, float] = {}
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"[{\[]", text)):
        try:
            value, _ = decoder.raw_decode(text[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and isinstance(value.get("answers"), list):
            value = value["answers"]
        if isinstance(value, list):
            value = {str(k): v for k, v in enumerate(value, start=1)}
        if isinstance(value, dict):
            for key, answer in value.items():
                number = re.sub(r"\D", "", str(key))
                word = str(answer).strip().lower()
                if number and (word in _YES or word in _NO):
                    found.setdefault(int(number), 1.0 if word in _YES else 0.0)
            if found:
                break
    if not found:
        for number, word in _LINE_ANSWER.findall(text):
            found.setdefault(int(number), 1.0 if word.lower() in _YES else 0.0)
    if all(k in found for k in range(1, n_criteria + 1)):
        return [found[k] for k in range(1, n_criteria + 1)]
    return None


def yes_probability(top_logprobs: Sequence[tuple[str, float]]) -> float | None:
    """``p(yes) / (p(yes) + p(no))`` from (token, log-prob) pairs; None if neither word appears."""
    yes = sum(math.exp(lp) for token, lp in top_logprobs if token.strip().lower() in ("yes", "y"))
    no = sum(math.exp(lp) for token, lp in top_logprobs if token.strip().lower() in ("no", "n"))
    return yes / (yes + no) if yes + no > 0 else None


class OpenAIVerifier:
    def __init__(self, config: VerifierConfig, client=None):
        import openai

        self.config = config
        api_key = os.environ.get(config.api_key_env) or "EMPTY"  # local servers accept any key
        # Retries are ours (counted, with backoff), so the client's own are off.
        self._client = client or openai.OpenAI(
            base_url=config.base_url, api_key=api_key, timeout=config.timeout_s, max_retries=0
        )
        self._cache = pathlib.Path(config.cache_dir) if config.cache_dir else None
        if self._cache:
            self._cache.mkdir(parents=True, exist_ok=True)
        self.stats = VerifierStats()
        self._lock = threading.Lock()

    def _count(self, **increments) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _request(self, prompt: str, parse: Callable, logprobs: bool):
        """The parsed answer to one prompt, from the cache or the endpoint; None on failure."""
        body = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": 1 if logprobs else self.config.max_tokens,
            **({"logprobs": True, "top_logprobs": 20} if logprobs else {}),
        }
        key = hashlib.sha256(json.dumps([VERIFIER_PROMPT_VERSION, body, self.config.extra_body]).encode()).hexdigest()
        path = self._cache / f"{key}.json" if self._cache else None
        if path is not None and path.exists():
            self._count(cache_hits=1)
            return json.loads(path.read_text())
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self._count(retries=1)
                time.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            self._count(calls=1)
            started = time.perf_counter()
            try:
                reply = self._client.chat.completions.create(**body, extra_body=dict(self.config.extra_body) or None)
                choice = reply.choices[0]
                if logprobs:
                    content = choice.logprobs.content if choice.logprobs else None
                    top = [(t.token, t.logprob) for t in content[0].top_logprobs] if content else []
                    answer = parse(top)
                else:
                    answer = parse(choice.message.content or "")
            except Exception:  # network errors, HTTP errors, timeouts, malformed replies: retry
                answer = None
            else:
                usage = getattr(reply, "usage", None)
                if usage is not None:
                    self._count(input_tokens=usage.prompt_tokens or 0, output_tokens=usage.completion_tokens or 0)
            if answer is not None:
                self._count(latency_s=time.perf_counter() - started)
                if path is not None:
                    tmp = path.with_suffix(f".tmp{threading.get_ident()}")
                    tmp.write_text(json.dumps(answer))
                    tmp.replace(path)
                return answer
        self._count(failures=1)
        return None

    def score_many(self, task: str, trajectories: Sequence[Trajectory], bundles: Sequence[Sequence[str]]) -> list[np.ndarray]:
        def count_tokens(text: str) -> int:
            return len(text) // 4

        texts = [render_trajectory(t, self.config.trajectory_budget_tokens, count_tokens) for t in trajectories]
        jobs = []  # (bundle, trajectory, criterion or None, prompt, parse, logprobs)
        for b, criteria in enumerate(bundles):
            for i, text in enumerate(texts):
                if self.config.mode == "binary":
                    jobs.append((b, i, None, binary_prompt(task, text, criteria), lambda s, n=len(criteria): parse_binary_answer(s, n), False))
                else:
                    for k, criterion in enumerate(criteria):
                        jobs.append((b, i, k, criterion_prompt(task, text, criterion), yes_probability, True))
        out = [np.full((len(trajectories), len(criteria)), np.nan) for criteria in bundles]
        # Identical prompts (trajectories that render alike) are asked once.
        unique = {(job[3], job[5]): job for job in jobs}
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            answered = dict(zip(unique, pool.map(lambda job: self._request(job[3], job[4], job[5]), unique.values())))
            for (b, i, k, prompt, _, logprobs) in jobs:
                answer = answered[(prompt, logprobs)]
                if answer is None:
                    continue
                if k is None:
                    out[b][i] = answer
                else:
                    out[b][i, k] = answer
        # A pair with any unscored criterion is unscored as a whole.
        for scores in out:
            scores[np.isnan(scores).any(axis=1)] = np.nan
        return out

    def score(self, task: str, trajectories: Sequence[Trajectory], bundle: Sequence[str]) -> np.ndarray:
        """``float[G, n_criteria]`` for one bundle."""
        return self.score_many(task, trajectories, [bundle])[0]


class LocalModelVerifier:
    """A frozen model in this process, in ``logprob`` mode: the score of a criterion is
    ``p(yes) / (p(yes) + p(no))`` of the model's first answer token, over the same prompts as
    ``OpenAIVerifier``. For runs without a second server (tests, notebooks)."""

    def __init__(self, model, tokenizer, *, trajectory_budget_tokens: int = 1500, batch_rows: int = 8):
        self._graphdef, self._state = nnx.split(model)
        self._tokenizer = tokenizer
        self._fmt = chat.chat_format(tokenizer)
        self._budget = trajectory_budget_tokens
        self._rows = batch_rows
        vocab = tokenizer.get_vocab()
        self._yes = sorted({vocab[t] for t in ("yes", "Yes", "YES", "Ġyes", "ĠYes", "▁yes", "▁Yes") if t in vocab})
        self._no = sorted({vocab[t] for t in ("no", "No", "NO", "Ġno", "ĠNo", "▁no", "▁No") if t in vocab})
        if not self._yes or not self._no:
            raise ValueError("the tokenizer has no single-token 'yes' / 'no' to score with")
        self.stats = VerifierStats()

    def score_many(self, task: str, trajectories: Sequence[Trajectory], bundles: Sequence[Sequence[str]]) -> list[np.ndarray]:
        texts = [render_trajectory(t, self._budget, lambda s: len(s) // 4) for t in trajectories]
        jobs = [(b, i, k) for b, criteria in enumerate(bundles) for i in range(len(texts)) for k in range(len(criteria))]
        prompts = [chat.prompt_ids(self._fmt, self._tokenizer, criterion_prompt(task, texts[i], bundles[b][k])) for b, i, k in jobs]
        probs = []
        for start in range(0, len(prompts), self._rows):
            probs += self._yes_probabilities(prompts[start : start + self._rows])
        self.stats.calls += len(prompts)
        out = [np.full((len(trajectories), len(criteria)), np.nan) for criteria in bundles]
        for (b, i, k), p in zip(jobs, probs):
            out[b][i, k] = p
        return out

    def _yes_probabilities(self, prompts: list[list[int]]) -> list[float]:
        length = -(-max(map(len, prompts)) // 64) * 64  # length buckets bound the compiles
        tokens = np.zeros((self._rows, length), np.int32)
        last = np.zeros((self._rows,), np.int32)
        for r, ids in enumerate(prompts):
            tokens[r, : len(ids)], last[r] = ids, len(ids) - 1
        logp = np.asarray(_last_logprobs(self._graphdef, self._state, jnp.asarray(tokens), jnp.asarray(last)))
        yes = np.exp(logp[:, self._yes]).sum(axis=1)
        no = np.exp(logp[:, self._no]).sum(axis=1)
        return (yes / (yes + no)).tolist()[: len(prompts)]


@functools.partial(jax.jit, static_argnums=0)
def _last_logprobs(graphdef, state, tokens: jax.Array, last: jax.Array) -> jax.Array:
    """Next-token log-probs ``[B, V]`` after position ``last [B]`` of right-padded ``tokens [B, T]``."""
    model = nnx.merge(graphdef, state)
    hidden, _ = model.hidden_states(tokens)
    return jax.nn.log_softmax(model.logits(hidden[jnp.arange(tokens.shape[0]), last]), axis=-1)
