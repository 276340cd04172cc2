"""The frozen verifier: does trajectory ``i`` satisfy criterion ``k`` of bundle ``b``?

``OpenAIVerifier`` talks to any OpenAI-compatible chat endpoint through the ``openai`` client:
the paper's Qwen3.5-Plus on DashScope (``DASHSCOPE`` preset) or, by default, a local vLLM server
holding the frozen initial policy. Two modes:

- ``binary``: one request per (trajectory, bundle) asking for a JSON object mapping each
  criterion number to "yes" or "no"; a tolerant parser reads it.
- ``logprob``: one request per (trajectory, criterion) asking for a one-word yes/no answer;
  the score is ``p(yes) / (p(yes) + p(no))`` from the first token's top log-probs. Small models
  rarely write valid JSON but always put mass on "yes" and "no".

Requests run with bounded concurrency. Faults, and what the user sees of them:

- An answer no retry fixes (HTTP 400, 401, 403, 404, ...; ``is_fatal_status``) raises
  ``VerifierError`` at once, naming the status and the URL (never the key), and the verifier sends
  nothing more; so does a missing API key for an endpoint off this machine, at construction. A
  wrong key thus stops the run instead of silently turning ORSD into GRPO.
- Timeouts, lost connections, 429 and 5xx answers, and bodies that are not a chat completion are
  retried (``max_retries``, exponential backoff, or the server's ``Retry-After`` when it sends
  one) and counted by kind in ``VerifierStats``. ``timeout_s`` is a deadline for the whole
  request, body included. A prompt that still fails leaves NaN for its pairs (selection then
  ranks the bundles over the trajectories that were scored; see ``select``).
- A prompt longer than the endpoint's context (its HTTP 400 names the context length, as vLLM and
  OpenAI word it) is not retried and not fatal: its pairs are NaN, counted in
  ``context_overflows``, and selection ranks over the other trajectories. Trajectories are cut
  to ``trajectory_budget_tokens`` counted with ``tokenizer`` (the served model's, for the local
  verifier), so this only happens when the budget and the server's context disagree.
- A circuit breaker: after ``breaker_failures`` requests in a row failed (after their retries),
  a warning is logged once and no request is sent for ``breaker_cooldown_s`` (NaN scores, counted
  in ``breaker_skips``); then requests go through again, and the first answer closes it.

Successful answers are cached on disk under a hash of the request and the endpoint (URL, and the
served weights where ``/models`` lists them), so reruns and resumed runs do not pay twice; what is
cached is the endpoint's raw answer, parsed again when read, so an empty or corrupt entry is a
miss. Failures are never cached, and an unwritable cache only logs a warning.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import ipaddress
import json
import logging
import math
import os
import pathlib
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import httpx2
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax import chat
from orsd_jax.rollout import Trajectory
from orsd_jax.rubrics.render import render_trajectory
from orsd_jax.sampling.vllm_server import client_limits

VERIFIER_PROMPT_VERSION = 2  # 2: the trajectory between <trajectory> tags, written-out control tokens quoted
_YES = {"yes", "y", "true", "1", "satisfied", "pass"}
_NO = {"no", "n", "false", "0", "unsatisfied", "not satisfied", "fail"}
_LINE_ANSWER = re.compile(r"(\d{1,2})\s*[\"']?\s*[.:)=-]\s*[\"']?\s*(yes|no|true|false)\b", re.I)
log = logging.getLogger("orsd_jax")


class VerifierError(RuntimeError):
    """The verifier cannot work as configured: no API key, or an HTTP answer no retry fixes."""


class Verifier(Protocol):
    stats: VerifierStats  # counts since the verifier was made (the trainer logs each update's change)

    def score_many(
        self, task: str, trajectories: Sequence[Trajectory], bundles: Sequence[Sequence[str]]
    ) -> list[np.ndarray]:
        """One ``float[G, n_criteria]`` per bundle; NaN rows for pairs that could not be scored."""
        ...


@dataclasses.dataclass(frozen=True)
class EndpointConfig:
    """An OpenAI-compatible endpoint that verifies rubrics, and how it is asked."""

    base_url: str
    model: str
    # A server on a Unix socket (an owned ``VLLMServer``'s ``unix_socket``; base_url then
    # http://localhost/v1): requests go through the socket.
    unix_socket: str | None = None
    api_key_env: str = "OPENAI_API_KEY"  # read at construction; a local server needs none
    mode: str = "binary"  # "binary" | "logprob"
    concurrency: int = 8
    timeout_s: float = 60.0  # deadline of one request, the whole answer included
    max_retries: int = 3
    backoff_s: float = 1.0  # first retry waits this long, then doubles
    max_retry_after_s: float = 60.0  # a server's Retry-After is waited, up to this
    breaker_failures: int = 8  # failed requests in a row (after retries) that open the circuit breaker
    breaker_cooldown_s: float = 60.0  # how long the open breaker sends nothing
    max_tokens: int = 200
    # Each trajectory cut to this many tokens of the verifier's tokenizer (OpenAIVerifier's
    # ``tokenizer``; without one, 4 characters a token).
    trajectory_budget_tokens: int = 1500
    extra_body: tuple[tuple[str, object], ...] = ()  # provider options, e.g. (("enable_thinking", False),)
    cache_dir: str | None = None
    price_per_m_input: float = 0.0  # USD per million tokens, for the cost counter
    price_per_m_output: float = 0.0

    def __post_init__(self):
        if self.mode not in ("binary", "logprob"):
            raise ValueError(f"verifier mode must be 'binary' or 'logprob', got {self.mode!r}")
        if self.breaker_failures < 1:
            raise ValueError(f"breaker_failures must be at least 1, got {self.breaker_failures}")


# The paper's verifier: Qwen3.5-Plus through DashScope's OpenAI-compatible mode (international
# endpoint; in mainland China use https://dashscope.aliyuncs.com/compatible-mode/v1).
DASHSCOPE = EndpointConfig(
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
    # Failed attempts by kind:
    timeouts: int = 0  # past the request deadline
    connection_errors: int = 0  # no connection, or the connection lost mid-answer
    server_errors: int = 0  # 429 and 5xx answers
    bad_replies: int = 0  # bodies that are not a chat completion (garbage, truncated JSON)
    unparsed: int = 0  # chat completions without a readable answer
    context_overflows: int = 0  # prompts the endpoint refused as longer than its context (not retried)
    breaker_skips: int = 0  # requests not sent while the circuit breaker was open
    latency_s: float = 0.0  # summed over successful requests
    input_tokens: int = 0
    output_tokens: int = 0

    def cost_usd(self, config: EndpointConfig) -> float:
        return (self.input_tokens * config.price_per_m_input + self.output_tokens * config.price_per_m_output) / 1e6


# Chat control tokens as text (``<|im_end|>``, ``<|eot_id|>``): a remote server renders the
# messages with its template and tokenizes special tokens in them, so text that names one could
# end the verifier's turn. The local verifier encodes text as text anyway (``chat.encode``).
_CONTROL = re.compile(r"<\|([^|<>\s]{1,40})\|>")
_TRAJECTORY_TAG = re.compile(r"<\s*/?\s*trajectory\s*>", re.IGNORECASE)


def _quoted(text: str) -> str:
    """Model- or environment-written text made inert inside a verifier prompt: no control-token
    strings and no trajectory delimiters, so an action cannot close the trajectory early and
    speak to the verifier as the prompt (``tests/faults/test_model_output.py``)."""
    return _TRAJECTORY_TAG.sub("", _CONTROL.sub(r"< |\1| >", text))


def _attempt(task: str, trajectory_text: str) -> str:
    return (
        f"An agent attempted this task: {_quoted(task)}\n\n"
        "What it saw and did, step by step:\n"
        f"<trajectory>\n{_quoted(trajectory_text)}\n</trajectory>\n\n"
    )


def binary_prompt(task: str, trajectory_text: str, criteria: Sequence[str]) -> str:
    numbered = "\n".join(f"{k}. {_quoted(c)}" for k, c in enumerate(criteria, start=1))
    example = ", ".join(f'"{k}": "yes"' if k % 2 else f'"{k}": "no"' for k in range(1, min(len(criteria), 3) + 1))
    return (
        _attempt(task, trajectory_text) + f"Criteria:\n{numbered}\n\n"
        "For each criterion, judge whether the attempt satisfies it. Reply with only a JSON object that "
        f'maps every criterion number to "yes" or "no", for example {{{example}}}.'
    )


def criterion_prompt(task: str, trajectory_text: str, criterion: str) -> str:
    return (
        _attempt(task, trajectory_text) + f"Criterion: {_quoted(criterion)}\n"
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


class _DeadlineStream(httpx2.SyncByteStream):
    """A response body that raises a read timeout once ``deadline`` (monotonic) has passed."""

    def __init__(self, stream: httpx2.SyncByteStream, deadline: float, request: httpx2.Request):
        self._stream, self._deadline, self._request = stream, deadline, request

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._stream:
            if time.monotonic() > self._deadline:
                raise httpx2.ReadTimeout("the answer did not arrive within the request deadline", request=self._request)
            yield chunk

    def close(self) -> None:
        self._stream.close()


class _DeadlineTransport(httpx2.HTTPTransport):
    """Bounds each request, body included, by ``deadline_s`` from when it is sent. httpx's
    timeouts bound each read only, so a server that drips its answer a byte at a time would hold
    a request (and a worker) for as long as it liked; the deadline is checked as each chunk of the
    body arrives, so an attempt ends within about ``deadline_s`` plus one read timeout. Idle
    connections are dropped as the sampler's are, and there are at most ``max_connections`` (the
    verifier's concurrency: one a worker)."""

    def __init__(self, deadline_s: float, max_connections: int, uds: str | None = None):
        super().__init__(uds=uds, limits=client_limits(max_connections))
        self._deadline_s = deadline_s

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        deadline = time.monotonic() + self._deadline_s
        response = super().handle_request(request)
        assert isinstance(response.stream, httpx2.SyncByteStream)  # a sync transport's body
        response.stream = _DeadlineStream(response.stream, deadline, request)
        return response


def is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The seconds a ``Retry-After`` header asks for; None without one (or in the HTTP-date form)."""
    try:
        seconds = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if seconds >= 0 else None  # NaN fails the comparison too


def is_fatal_status(status: int) -> bool:
    """4xx answers no retry fixes: a bad key (401), no access (403), a wrong URL or model (404),
    a request the server refuses (400, 422, ...). 408, 409 and 429 are worth retrying (as the
    ``openai`` client itself judges), like 5xx."""
    return 400 <= status < 500 and status not in (408, 409, 429)


def reply_content(reply, logprobs: bool) -> str | list[tuple[str, float]]:
    """What a chat completion answered: its text, or its first token's top (token, log-prob) pairs.
    Raises (AttributeError, IndexError, TypeError) when ``reply`` is not a chat completion."""
    choice = reply.choices[0]
    if not logprobs:
        return choice.message.content or ""
    content = choice.logprobs.content if choice.logprobs else None
    return [(t.token, t.logprob) for t in content[0].top_logprobs] if content else []


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """One HTTP request's outcome: the answer's raw content, or the VerifierStats counter of its fault."""

    raw: str | list | None
    fault: str = ""  # "timeouts" | "connection_errors" | "server_errors" | "bad_replies" | "context_overflows"
    retry_after_s: float | None = None
    retry: bool = True  # False: the endpoint answered, and would answer the same again


# How vLLM ("This model's maximum context length is ...", "... longer than the maximum model
# length ...") and OpenAI ("context_length_exceeded") refuse a prompt that does not fit.
_CONTEXT_OVERFLOW = re.compile(r"maximum context length|longer than the maximum model length|context_length_exceeded")


def is_context_overflow(status: int, message: str) -> bool:
    return status == 400 and _CONTEXT_OVERFLOW.search(message) is not None


class OpenAIVerifier:
    """The verifier behind an OpenAI-compatible endpoint; see the module docstring for its faults."""

    def __init__(self, config: EndpointConfig, client=None, tokenizer=None):
        """``tokenizer`` counts the trajectory budget (the served model's; default 4 characters a
        token); ``client``: an ``openai.OpenAI`` to use instead of one made here."""
        import openai

        self.config = config
        self._tokenizer = tokenizer
        api_key = os.environ.get(config.api_key_env, "")
        if client is None and not api_key and not is_loopback(config.base_url):
            raise VerifierError(
                f"no API key for the verifier at {config.base_url}: set ${config.api_key_env} "
                "(any value for a server that needs none)"
            )
        self._api_key = api_key
        # Retries are ours (counted, with backoff and Retry-After), so the client's own are off.
        self._client = client or openai.OpenAI(
            base_url=config.base_url,
            api_key=api_key or "EMPTY",
            timeout=config.timeout_s,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(
                transport=_DeadlineTransport(config.timeout_s, config.concurrency, config.unix_socket)
            ),
        )
        self._cache = pathlib.Path(config.cache_dir) if config.cache_dir else None
        if self._cache:
            self._cache.mkdir(parents=True, exist_ok=True)
        self.stats = VerifierStats()
        self._lock = threading.Lock()
        self._endpoint: str | None = None  # the cache keys' name for the endpoint, fetched once
        self._fatal: VerifierError | None = None
        self._failures_in_a_row = 0
        self._breaker_until = 0.0  # monotonic time the open breaker lets requests through again
        self._cache_warned = False

    def _count(self, **increments) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _endpoint_name(self) -> str:
        """The URL and, where ``/models`` lists the served model, its weights (``root``) and context
        length: two servers serving different weights under one name at one URL (a restart) never
        share cache entries. A listing that fails leaves the URL alone (then a later verifier that
        gets the listing keys differently, and asks again). A server on this machine that lists its
        weights is keyed by them without its port: the trainer's local verifier starts on a free
        port each time, and a resumed run should find the answers it already paid for."""
        import openai

        try:
            listed = [m.model_dump() for m in self._client.models.list().data]
        except (openai.OpenAIError, ValueError, TypeError, AttributeError):  # no listing, or not the OpenAI shape
            listed = []
        served = [
            {k: m.get(k) for k in ("id", "root", "max_model_len")} for m in listed if m.get("id") == self.config.model
        ]
        where = "loopback" if served and is_loopback(self.config.base_url) else self.config.base_url
        return json.dumps([where, served[0] if served else None])

    def _cache_path(self, body: dict) -> pathlib.Path | None:
        if self._cache is None:
            return None
        key = json.dumps([VERIFIER_PROMPT_VERSION, self._endpoint, body, self.config.extra_body])
        return self._cache / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def _read_cache(self, path: pathlib.Path | None, parse: Callable):
        """The cached answer, or None: no entry, or one that is empty, corrupt or unreadable."""
        if path is None:
            return None
        try:
            return parse(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def _write_cache(self, path: pathlib.Path | None, raw) -> None:
        """Stores the raw answer (re-parsed when read, so an entry the parser rejects is a miss); an
        unwritable cache is warned about once and otherwise ignored."""
        if path is None:
            return
        # A name of this process and thread: writers of one entry never share a partial file
        # (thread ids repeat across processes).
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        try:
            tmp.write_text(json.dumps(raw))
            tmp.replace(path)
        except OSError as error:
            with contextlib.suppress(OSError):  # a cache that is a file holds no partial file either
                tmp.unlink()
            with self._lock:
                warn, self._cache_warned = not self._cache_warned, True
            if warn:
                log.warning("verifier cache %s is not writable (%s); answers are not cached", self._cache, error)

    def _breaker_open(self) -> bool:
        with self._lock:
            return self._failures_in_a_row >= self.config.breaker_failures and time.monotonic() < self._breaker_until

    def _record(self, reached: bool) -> None:
        """Feeds the circuit breaker one finished request: ``reached`` when the endpoint answered
        with a chat completion (readable or not), else a failure. ``breaker_failures`` failures in a
        row open it for ``breaker_cooldown_s``; then requests go through again, each failure
        re-opens it, and the first answer closes it."""
        config = self.config
        with self._lock:
            was_open = self._failures_in_a_row >= config.breaker_failures
            self._failures_in_a_row = 0 if reached else self._failures_in_a_row + 1
            opens = not was_open and self._failures_in_a_row >= config.breaker_failures
            if self._failures_in_a_row >= config.breaker_failures:
                self._breaker_until = time.monotonic() + config.breaker_cooldown_s
        if opens:
            log.warning(
                "verifier circuit breaker open: %d requests in a row to %s failed; no requests for %.0f s "
                "(their scores are NaN, counted in breaker_skips)",
                config.breaker_failures,
                config.base_url,
                config.breaker_cooldown_s,
            )
        elif was_open and reached:
            log.info("verifier circuit breaker closed: %s answers again", config.base_url)

    def _attempt(self, body: dict, logprobs: bool) -> _Attempt:
        """One HTTP request; raises VerifierError (and stops the verifier) on an answer no retry fixes."""
        import openai

        try:
            reply = self._client.chat.completions.create(**body, extra_body=dict(self.config.extra_body) or None)
        except openai.APITimeoutError:
            return _Attempt(None, "timeouts")
        except openai.APIConnectionError:
            return _Attempt(None, "connection_errors")
        except openai.APIStatusError as error:
            if is_context_overflow(error.status_code, f"{error.message} {getattr(error, 'code', None) or ''}"):
                return _Attempt(None, "context_overflows", retry=False)
            if not is_fatal_status(error.status_code):
                return _Attempt(None, "server_errors", retry_after_s(error.response.headers))
            said = error.message.replace(self._api_key, "***") if self._api_key else error.message
            fatal = VerifierError(
                f"the verifier endpoint {self.config.base_url} answered HTTP {error.status_code} ({said}); "
                f"check the URL, the model name {self.config.model!r} and ${self.config.api_key_env}"
            )
            with self._lock:
                self._fatal = self._fatal or fatal
            raise fatal from None  # the client's error holds the request, key included
        except (openai.OpenAIError, ValueError):  # a 200 whose body is not JSON
            return _Attempt(None, "bad_replies")
        try:
            raw = reply_content(reply, logprobs)
        except (AttributeError, IndexError, TypeError):
            return _Attempt(None, "bad_replies")
        usage = getattr(reply, "usage", None)
        if usage is not None:
            self._count(input_tokens=usage.prompt_tokens or 0, output_tokens=usage.completion_tokens or 0)
        return _Attempt(raw)

    def _request(self, prompt: str, parse: Callable, logprobs: bool):
        """The parsed answer to one prompt, from the cache or the endpoint; None on failure."""
        if self._fatal is not None:  # the endpoint refused; send nothing more
            raise self._fatal
        body = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": 1 if logprobs else self.config.max_tokens,
            **({"logprobs": True, "top_logprobs": 20} if logprobs else {}),
        }
        path = self._cache_path(body)
        cached = self._read_cache(path, parse)
        if cached is not None:
            self._count(cache_hits=1)
            return cached
        if self._breaker_open():
            self._count(breaker_skips=1)
            return None
        wait = 0.0
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self._count(retries=1)
                time.sleep(wait)
            self._count(calls=1)
            started = time.perf_counter()
            outcome = self._attempt(body, logprobs)
            answer = None if outcome.raw is None else parse(outcome.raw)
            if answer is not None:
                self._count(latency_s=time.perf_counter() - started)
                self._write_cache(path, outcome.raw)
                self._record(reached=True)
                return answer
            self._count(**{outcome.fault or "unparsed": 1})
            if not outcome.retry:
                break
            server_wait = outcome.retry_after_s
            wait = (
                self.config.backoff_s * 2**attempt
                if server_wait is None
                else min(server_wait, self.config.max_retry_after_s)
            )
        self._count(failures=1)
        self._record(reached=outcome.raw is not None or not outcome.retry)
        return None

    def score_many(
        self, task: str, trajectories: Sequence[Trajectory], bundles: Sequence[Sequence[str]]
    ) -> list[np.ndarray]:
        """Raises VerifierError when the endpoint refuses (see ``is_fatal_status``); every other
        fault leaves NaN for the pairs it hit."""

        def count_tokens(text: str) -> int:
            if self._tokenizer is None:
                return len(text) // 4
            return len(self._tokenizer.encode(text, add_special_tokens=False))

        if self._cache is not None and self._endpoint is None:  # before the workers, so fetched once
            self._endpoint = self._endpoint_name()
        texts = [render_trajectory(t, self.config.trajectory_budget_tokens, count_tokens) for t in trajectories]
        jobs: list[_Job] = []
        for b, criteria in enumerate(bundles):
            for i, text in enumerate(texts):
                if self.config.mode == "binary":
                    parse = functools.partial(parse_binary_answer, n_criteria=len(criteria))
                    jobs.append(_Job(b, i, None, binary_prompt(task, text, criteria), parse, False))
                else:
                    for c, criterion in enumerate(criteria):
                        jobs.append(_Job(b, i, c, criterion_prompt(task, text, criterion), yes_probability, True))
        out = [np.full((len(trajectories), len(criteria)), np.nan) for criteria in bundles]
        # Identical prompts (trajectories that render alike) are asked once.
        unique = {(job.prompt, job.logprobs): job for job in jobs}
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            asked = pool.map(lambda job: self._request(job.prompt, job.parse, job.logprobs), unique.values())
            answered = dict(zip(unique, asked))
            for job in jobs:
                answer = answered[(job.prompt, job.logprobs)]
                if answer is None:
                    continue
                if job.criterion is None:
                    out[job.bundle][job.trajectory] = answer
                else:
                    out[job.bundle][job.trajectory, job.criterion] = answer
        # A pair with any unscored criterion is unscored as a whole.
        for scores in out:
            scores[np.isnan(scores).any(axis=1)] = np.nan
        return out

    def score(self, task: str, trajectories: Sequence[Trajectory], bundle: Sequence[str]) -> np.ndarray:
        """``float[G, n_criteria]`` for one bundle."""
        return self.score_many(task, trajectories, [bundle])[0]


@dataclasses.dataclass(frozen=True)
class _Job:
    """One request of ``score_many``: a bundle's criteria (binary mode, ``criterion`` None) or one
    criterion (logprob mode) on one trajectory, with how to read the answer."""

    bundle: int
    trajectory: int
    criterion: int | None
    prompt: str
    parse: Callable
    logprobs: bool


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

    def score_many(
        self, task: str, trajectories: Sequence[Trajectory], bundles: Sequence[Sequence[str]]
    ) -> list[np.ndarray]:
        texts = [render_trajectory(t, self._budget, lambda s: len(s) // 4) for t in trajectories]
        jobs = [
            (b, i, k) for b, criteria in enumerate(bundles) for i in range(len(texts)) for k in range(len(criteria))
        ]
        prompts = [
            chat.prompt_ids(self._fmt, self._tokenizer, criterion_prompt(task, texts[i], bundles[b][k]))
            for b, i, k in jobs
        ]
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
