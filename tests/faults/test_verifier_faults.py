"""The frozen verifier's faults, produced by a real misbehaving HTTP server.

Every fault comes from a ``ThreadingHTTPServer`` on 127.0.0.1 that speaks the OpenAI
chat-completions JSON shape (and ``/v1/models``) and misbehaves on purpose: a port with nothing
listening, auth and client errors, rate limits and server errors with ``Retry-After``, a body
dripped a byte at a time, garbage and truncated bodies, failures only on some prompts. The real
``OpenAIVerifier`` talks to it through the real ``openai`` client; nothing is mocked. Each test
asserts what the user sees (scores, exceptions, counters, log lines, wall time) and what is kept
(the cache directory).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import multiprocessing
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import scipy.stats
from transformers import AutoTokenizer

from orsd_jax.envs.base import Task
from orsd_jax.models import EMBEDDED, resolve
from orsd_jax.rollout import Group, Step, Trajectory
from orsd_jax.rubrics import (
    DASHSCOPE,
    EndpointConfig,
    OpenAIVerifier,
    ParsedBundle,
    select_bundle,
    verify,
    verify_and_select,
)

TASK = Task("alfworld", "g", "cool", "cool an apple")
CRITERIA = ("The agent opens the fridge.", "The agent takes the apple.", "The agent goes to the sink.")
YES = '{"1": "yes", "2": "yes", "3": "yes"}'
NO = '{"1": "no", "2": "no", "3": "no"}'
SECRET = "sk-test-secret-0123456789"
KEY_ENV = "ORSD_TEST_VERIFIER_KEY"
MARKER = "UNSCORABLE"
LISTING = [
    {"id": "judge", "object": "model", "created": 0, "owned_by": "vllm", "root": "weights-a", "max_model_len": 4096}
]

# What the server does with one chat request: ("answer", content), ("status", code, headers),
# ("error", code, message),
# ("raw", body bytes, Content-Length or None for the body's own), ("drip", content, seconds a byte).
Action = tuple
Reply = Callable[[dict], Action]


class FaultServer(http.server.ThreadingHTTPServer):
    """Answers ``POST /v1/chat/completions`` with ``reply(body)`` and ``GET /v1/models`` with
    ``models`` (404 when None); records when each chat request arrived and what it carried."""

    def __init__(self, reply: Reply, models: list[dict] | None = LISTING, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.reply, self.models = reply, models
        self.chat_requests: list[tuple[float, dict]] = []  # (monotonic arrival time, body)
        self.model_requests = 0
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def stop(self) -> None:
        if not self.stopped.is_set():
            self.stopped.set()  # ends any drip in progress
            self.shutdown()
            self.server_close()
            self.thread.join()


def _completion(model: str, content: str) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    return json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107},
        }
    ).encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FaultServer

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path.rstrip("/") != "/v1/models" or self.server.models is None:
            self._send(404, b'{"error": {"message": "no such route"}}')
            return
        with self.server.lock:
            self.server.model_requests += 1
        self._send(200, json.dumps({"object": "list", "data": self.server.models}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.chat_requests.append((time.monotonic(), body))
        action = self.server.reply(body)
        if action[0] == "answer":
            self._send(200, _completion(body["model"], action[1]))
        elif action[0] == "status":
            # Providers echo what they were sent; the verifier must not pass the key on.
            error = {
                "error": {"message": f"scripted failure for {self.headers.get('Authorization')}", "code": action[1]}
            }
            self._send(action[1], json.dumps(error).encode(), dict(action[2]) if len(action) > 2 else {})
        elif action[0] == "error":  # a status with the server's own message, as vLLM sends it
            error = {"error": {"message": action[2], "type": "BadRequestError", "code": action[1]}}
            self._send(action[1], json.dumps(error).encode())
        elif action[0] == "raw":
            self.close_connection = True
            self._send(200, action[1], {"Content-Length": str(action[2])} if action[2] else {})
        elif action[0] == "drip":
            self._drip(_completion(body["model"], action[1]), action[2])

    def _send(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up first, as scripted
            pass

    def _drip(self, data: bytes, seconds_per_byte: float) -> None:
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.flush()
            for i in range(len(data)):
                if self.server.stopped.is_set():
                    return
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(seconds_per_byte)
        except (BrokenPipeError, ConnectionResetError):
            pass


def always(action: Action) -> Reply:
    return lambda body: action


def script(*actions: Action) -> Reply:
    """The actions in order, the last one repeated."""
    queue, lock = list(actions), threading.Lock()

    def reply(body):
        with lock:
            return queue.pop(0) if len(queue) > 1 else queue[0]

    return reply


def prompt_of(body: dict) -> str:
    return body["messages"][0]["content"]


@pytest.fixture
def serve():
    servers: list[FaultServer] = []

    def start(reply: Reply, **kw) -> FaultServer:
        servers.append(FaultServer(reply, **kw))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(action: str, reward: float) -> Step:
    values = {
        "user_text": "",
        "prompt_ids": (1,),
        "response_ids": (2,),
        "logprobs": (-0.1,),
        "response_text": "",
        "observation": "You see a fridge 1.",
        "action": action,
        "reward": reward,
        "truncated": False,
        "weight_version": 0,
    }
    # The validity flags, whatever the rollout names them, are all True.
    return Step(**{f.name: values.get(f.name, True) for f in dataclasses.fields(Step)})


def _trajectories(n: int, rewards=None, marker_at: int | None = None) -> tuple[Trajectory, ...]:
    """``n`` trajectories that render differently ("open fridge i"); ``marker_at`` carries MARKER."""
    rewards = [0.0] * n if rewards is None else rewards
    actions = [f"open fridge {i}" + (f" {MARKER}" if i == marker_at else "") for i in range(n)]
    return tuple(Trajectory(TASK, (_step(a, r),), r > 0, r) for a, r in zip(actions, rewards))


def _config(url: str, tmp_path, **kw) -> EndpointConfig:
    fast = dict(
        model="judge", timeout_s=1.0, max_retries=1, backoff_s=0.01, concurrency=2, cache_dir=str(tmp_path / "cache")
    )
    return EndpointConfig(base_url=url, **{**fast, **kw})


def _cached(tmp_path) -> list:
    return sorted((tmp_path / "cache").iterdir())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "orsd_jax" and r.levelno == logging.WARNING]


# 1. Nothing listening.


def test_unreachable_port_opens_the_circuit_breaker_until_the_cool_down(serve, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="orsd_jax")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    verifier = OpenAIVerifier(_config(url, tmp_path, breaker_failures=3, breaker_cooldown_s=1.5))
    started = time.perf_counter()
    scores = verifier.score_many(TASK.description, _trajectories(6), [CRITERIA, CRITERIA[:2]])  # 12 requests
    elapsed = time.perf_counter() - started
    stats = verifier.stats
    assert all(np.isnan(s).all() for s in scores)
    assert 3 <= stats.failures <= 4  # two at a time: one more may be in flight when it opens
    assert stats.breaker_skips == 12 - stats.failures
    assert stats.calls == stats.connection_errors == 2 * stats.failures and stats.retries == stats.failures
    assert elapsed < 2.0
    (warning,) = _warnings(caplog)
    assert "circuit breaker" in warning and url in warning
    assert not _cached(tmp_path)

    # The server comes up; until the cool-down has passed it is not asked.
    server = serve(always(("answer", YES)), port=port)
    assert np.isnan(verifier.score(TASK.description, _trajectories(1), CRITERIA)).all()
    assert not server.chat_requests and verifier.stats.breaker_skips == 13 - stats.failures
    time.sleep(1.5)
    np.testing.assert_array_equal(verifier.score(TASK.description, _trajectories(2), CRITERIA), np.ones((2, 3)))
    assert len(server.chat_requests) == 2 and len(_warnings(caplog)) == 1


# 2. Errors no retry can fix.


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_client_errors_raise_at_once_without_the_key(serve, tmp_path, monkeypatch, status):
    monkeypatch.setenv(KEY_ENV, SECRET)
    server = serve(always(("status", status)))
    verifier = OpenAIVerifier(_config(server.url, tmp_path, api_key_env=KEY_ENV, concurrency=1))
    with pytest.raises(verify.VerifierError) as raised:
        verifier.score_many(TASK.description, _trajectories(4), [CRITERIA])
    message = str(raised.value)
    assert str(status) in message and server.url in message and SECRET not in message
    assert len(server.chat_requests) == 1 and verifier.stats.calls == 1 and verifier.stats.retries == 0
    assert not _cached(tmp_path)


# 3. Rate limits and server errors.


@pytest.mark.parametrize(("status", "retry_after", "wait"), [(429, "1", 1.0), (503, "1", 1.0), (500, "30", 0.3)])
def test_rate_limits_and_server_errors_honour_retry_after(serve, tmp_path, status, retry_after, wait):
    server = serve(script(("status", status, {"Retry-After": retry_after}), ("status", status), ("answer", YES)))
    verifier = OpenAIVerifier(_config(server.url, tmp_path, max_retries=2, max_retry_after_s=0.3 if wait < 1 else 60.0))
    np.testing.assert_array_equal(verifier.score(TASK.description, _trajectories(1), CRITERIA), [[1, 1, 1]])
    (first, _), (second, _), (third, _) = server.chat_requests
    assert wait <= second - first < wait + 0.5  # the server's Retry-After (capped by max_retry_after_s)
    assert third - second < 0.5  # no Retry-After: the backoff (0.02 s)
    stats = verifier.stats
    assert stats.calls == 3 and stats.retries == 2 and stats.server_errors == 2 and stats.failures == 0
    assert len(_cached(tmp_path)) == 1


# 4. A body slower than the deadline.


def test_slow_drip_is_cut_at_the_request_deadline(serve, tmp_path):
    server = serve(always(("drip", YES, 0.05)))  # a byte every 50 ms: the whole answer takes ~12 s
    verifier = OpenAIVerifier(_config(server.url, tmp_path, timeout_s=0.5))
    started = time.perf_counter()
    scores = verifier.score(TASK.description, _trajectories(1), CRITERIA)
    elapsed = time.perf_counter() - started
    assert np.isnan(scores).all()
    assert verifier.stats.calls == verifier.stats.timeouts == 2 and verifier.stats.failures == 1
    assert len(server.chat_requests) == 2
    assert elapsed < 2 * (0.5 + 0.05) + 0.5  # two attempts, each cut at its deadline
    assert not _cached(tmp_path)


# 5. Bodies that are not a chat completion.


@pytest.mark.parametrize(
    ("body", "length", "counter"),
    [
        (b"this is not json", None, "bad_replies"),
        (_completion("judge", YES)[:60], None, "bad_replies"),  # truncated JSON, honest length
        (b'{"object": "error", "message": "overloaded"}', None, "bad_replies"),  # JSON, not a completion
        (_completion("judge", YES)[:60], len(_completion("judge", YES)), "connection_errors"),  # cut mid-body
    ],
    ids=["garbage", "truncated", "not-a-completion", "cut"],
)
def test_unreadable_bodies_are_counted_failures(serve, tmp_path, body, length, counter):
    server = serve(always(("raw", body, length)))
    verifier = OpenAIVerifier(_config(server.url, tmp_path))
    scores = verifier.score_many(TASK.description, _trajectories(2), [CRITERIA])
    assert np.isnan(scores[0]).all()
    stats = verifier.stats
    assert stats.failures == 2 and stats.calls == 4 and getattr(stats, counter) == 4
    assert len(server.chat_requests) == 4 and not _cached(tmp_path)


# 6. One trajectory that cannot be scored.

UP = ("Step one is done.", "Step two is done.", "Step three is done.", "Step four is done.")
DOWN = ("The agent stops early.", "The agent waits.", "The agent repeats itself.", "The agent gives up.")


def _graded(body: dict) -> Action:
    """Fails on MARKER; else trajectory ``i`` meets the first ``i`` of UP and the last ``4 - i`` of DOWN."""
    prompt = prompt_of(body)
    if MARKER in prompt:
        return ("status", 500)
    i = int(re.search(r"open fridge (\d+)", prompt).group(1))
    yes = [k <= i for k in range(1, 5)] if "Step one" in prompt else [k > i for k in range(1, 5)]
    return ("answer", json.dumps({str(k): "yes" if y else "no" for k, y in enumerate(yes, start=1)}))


def test_an_unscorable_trajectory_leaves_the_others_and_selection(serve, tmp_path):
    server = serve(_graded)
    rewards = [0.0, 10.0, 10.0, 0.0, 10.0]
    group = Group(TASK, _trajectories(5, rewards, marker_at=2))
    verifier = OpenAIVerifier(_config(server.url, tmp_path))
    bundles = [ParsedBundle(DOWN, ""), ParsedBundle(UP, "")]
    rubric = verify_and_select(verifier, group, bundles, "spearman", np.random.default_rng(0))
    kept = np.array([0, 1, 3, 4])
    assert np.isnan(rubric.satisfaction[:, 2]).all()
    np.testing.assert_array_equal(rubric.satisfaction[:, kept], [[1.0, 0.75, 0.25, 0.0], [0.0, 0.25, 0.75, 1.0]])
    expected = [scipy.stats.spearmanr(row[kept], np.array(rewards)[kept]).statistic for row in rubric.satisfaction]
    np.testing.assert_allclose(rubric.selection.correlations, expected)
    assert rubric.selection.index == 1 and rubric.selection.reason == ""
    assert verifier.stats.failures == 2 and len(_cached(tmp_path)) == 8  # the marked trajectory, once per bundle


# vLLM 0.32's refusal of a prompt that does not fit (vllm/renderers/params.py).
OVERFLOW = (
    "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
    "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."
)


def test_a_prompt_over_the_context_drops_only_its_pairs(serve, tmp_path):
    server = serve(lambda body: ("error", 400, OVERFLOW) if MARKER in prompt_of(body) else _graded(body))
    rewards = [0.0, 10.0, 10.0, 0.0, 10.0]
    group = Group(TASK, _trajectories(5, rewards, marker_at=2))
    verifier = OpenAIVerifier(_config(server.url, tmp_path, max_retries=3))
    rubric = verify_and_select(
        verifier, group, [ParsedBundle(DOWN, ""), ParsedBundle(UP, "")], "spearman", np.random.default_rng(0)
    )
    assert np.isnan(rubric.satisfaction[:, 2]).all() and not np.isnan(rubric.satisfaction[:, [0, 1, 3, 4]]).any()
    assert rubric.selection.index == 1 and np.isfinite(rubric.selection.correlations).all()
    refused = [body for _, body in server.chat_requests if MARKER in prompt_of(body)]
    assert len(refused) == 2  # once per bundle: the same prompt would be refused again
    assert verifier.stats.context_overflows == 2 and verifier.stats.retries == 0 and verifier.stats.failures == 2
    # Another 400 still stops the verifier (test_client_errors_raise_at_once_without_the_key).
    other = serve(always(("error", 400, "unknown parameter 'top_logprobs'")))
    with pytest.raises(verify.VerifierError, match="HTTP 400"):
        OpenAIVerifier(_config(other.url, tmp_path / "other")).score(TASK.description, _trajectories(2), CRITERIA)


def test_the_trajectory_budget_is_counted_with_the_tokenizer(serve, tmp_path):
    """Digits cost about a token a character, so 4 characters a token undercounts them: with the
    served model's tokenizer the trajectory in every prompt fits the budget, without it, it does not."""
    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    steps = tuple(_step(f"open fridge {' '.join(str(d % 10) for d in range(i, i + 40))}", 0.0) for i in range(12))
    trajectory = Trajectory(TASK, steps, False, 0.0)
    budget = 300

    def trajectory_tokens(server: FaultServer) -> list[int]:
        shown = [
            re.search(r"<trajectory>\n?(.*?)\n?</trajectory>", prompt_of(b), re.S) for _, b in server.chat_requests
        ]
        return [len(tokenizer.encode(m.group(1), add_special_tokens=False)) for m in shown]

    counted, guessed = serve(always(("answer", YES))), serve(always(("answer", YES)))
    for server, kw in ((counted, {"tokenizer": tokenizer}), (guessed, {})):
        config = _config(server.url, tmp_path / server.url[-5:], trajectory_budget_tokens=budget, mode="binary")
        OpenAIVerifier(config, **kw).score(TASK.description, (trajectory,), CRITERIA)
    assert trajectory_tokens(counted) and max(trajectory_tokens(counted)) <= budget
    assert min(trajectory_tokens(guessed)) > budget


def test_selection_drops_trajectories_no_bundle_scored():
    nan = np.nan
    rewards = np.array([0.0, 10.0, 5.0, 7.0, 3.0])
    satisfaction = np.array([[0.1, nan, 0.3, nan, 0.2], [0.9, 0.8, 0.1, nan, 0.4], [nan] * 5])
    selection = select_bundle(satisfaction, rewards, "spearman", np.random.default_rng(0))
    # Column 3 no bundle scored is dropped; bundle 0's own gap at column 1 leaves it undefined.
    kept = [0, 1, 2, 4]
    assert np.isnan(selection.correlations[0]) and np.isnan(selection.correlations[2])
    assert selection.correlations[1] == pytest.approx(
        scipy.stats.spearmanr(satisfaction[1, kept], rewards[kept]).statistic
    )
    assert selection.index == 1


@pytest.mark.parametrize(
    ("satisfaction", "rewards", "reason"),
    [
        ([[np.nan, 0.5, np.nan], [np.nan, 0.2, np.nan]], [0.0, 10.0, 5.0], "constant rewards"),  # one scored
        ([[0.1, 0.5, np.nan], [0.3, 0.2, np.nan]], [10.0, 10.0, 0.0], "constant rewards"),  # the scored two agree
        ([[np.nan] * 3, [np.nan] * 3], [0.0, 10.0, 5.0], "no valid bundle"),
        ([[0.1, 0.5, np.nan], [0.3, 0.2, np.nan]], [0.0, 10.0, 5.0], ""),
    ],
)
def test_selection_needs_two_scored_trajectories_with_varied_rewards(satisfaction, rewards, reason):
    selection = select_bundle(np.array(satisfaction), np.array(rewards), "spearman", np.random.default_rng(0))
    assert selection.reason == reason and (selection.index is None) == bool(reason)


# 7. No API key for a remote endpoint.


def test_missing_key_fails_at_construction_except_on_loopback(monkeypatch):
    connections: list = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: connections.append(a) or [])
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: connections.append(address))
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv(DASHSCOPE.api_key_env, "")
    for config in (EndpointConfig(base_url="https://example.invalid/v1", model="m", api_key_env=KEY_ENV), DASHSCOPE):
        with pytest.raises(verify.VerifierError, match=config.api_key_env):
            OpenAIVerifier(config)
    for host in ("127.0.0.1", "localhost", "[::1]"):
        OpenAIVerifier(EndpointConfig(base_url=f"http://{host}:9/v1", model="m", api_key_env=KEY_ENV))
    assert not connections


# 8. The answer cache.


def test_cache_is_keyed_by_the_endpoint(serve, tmp_path):
    # Same served name "judge", other weights (as a listing's root names them).
    first, second = (
        serve(always(("answer", YES))),
        serve(always(("answer", NO)), models=[{**LISTING[0], "root": "weights-b"}]),
    )
    trajectories = _trajectories(3)
    ones = OpenAIVerifier(_config(first.url, tmp_path)).score(TASK.description, trajectories, CRITERIA)
    other = OpenAIVerifier(_config(second.url, tmp_path))
    np.testing.assert_array_equal(other.score(TASK.description, trajectories, CRITERIA), np.zeros((3, 3)))
    assert other.stats.cache_hits == 0 and other.stats.calls == 3
    again = OpenAIVerifier(_config(first.url, tmp_path))
    np.testing.assert_array_equal(again.score(TASK.description, trajectories, CRITERIA), ones)
    assert again.stats.cache_hits == 3 and again.stats.calls == 0
    assert first.model_requests == 2 and second.model_requests == 1  # the listing: once per verifier
    assert len(_cached(tmp_path)) == 6
    # A local server of the same weights on another port (a resumed run's) finds the answers.
    restarted = OpenAIVerifier(_config(serve(always(("answer", NO))).url, tmp_path))
    np.testing.assert_array_equal(restarted.score(TASK.description, trajectories, CRITERIA), ones)
    assert restarted.stats.cache_hits == 3 and restarted.stats.calls == 0
    # Without a listing a server is known by its URL alone.
    unlisted = OpenAIVerifier(_config(serve(always(("answer", NO)), models=None).url, tmp_path))
    assert unlisted.score(TASK.description, trajectories, CRITERIA).sum() == 0 and unlisted.stats.cache_hits == 0


def test_cache_is_keyed_by_the_served_model(serve, tmp_path):
    port = _free_port()
    trajectories = _trajectories(1)

    def score_at(answer: str, models) -> OpenAIVerifier:
        server = serve(always(("answer", answer)), models=models, port=port)
        verifier = OpenAIVerifier(_config(server.url, tmp_path))
        verifier.score(TASK.description, trajectories, CRITERIA)
        server.stop()
        return verifier

    assert score_at(YES, LISTING).stats.calls == 1
    assert score_at(NO, [{**LISTING[0], "root": "weights-b"}]).stats.calls == 1  # other weights, same URL and name
    assert score_at(NO, [{**LISTING[0], "max_model_len": 2048}]).stats.calls == 1
    assert score_at(NO, None).stats.calls == 1  # no listing: the URL alone
    assert score_at(NO, None).stats.cache_hits == 1
    assert score_at(YES, LISTING).stats.cache_hits == 1


@pytest.mark.parametrize("content", ["", "{not json", "[1.0, 0.0, 1.0]", '"no answer here"'])
def test_corrupt_cache_entries_are_misses(serve, tmp_path, content):
    server = serve(always(("answer", YES)))
    trajectories = _trajectories(1)
    OpenAIVerifier(_config(server.url, tmp_path)).score(TASK.description, trajectories, CRITERIA)
    (entry,) = _cached(tmp_path)
    entry.write_text(content)
    verifier = OpenAIVerifier(_config(server.url, tmp_path))
    np.testing.assert_array_equal(verifier.score(TASK.description, trajectories, CRITERIA), [[1, 1, 1]])
    assert verifier.stats.cache_hits == 0 and verifier.stats.calls == 1
    healed = OpenAIVerifier(_config(server.url, tmp_path))  # the entry was rewritten
    healed.score(TASK.description, trajectories, CRITERIA)
    assert healed.stats.cache_hits == 1 and healed.stats.calls == 0


def _score_into(url: str, cache_dir: str, n: int) -> int:
    """One verifier process's work for the test below: scores ``n`` trajectories, returns its calls."""
    verifier = OpenAIVerifier(EndpointConfig(base_url=url, model="judge", concurrency=8, cache_dir=cache_dir))
    np.testing.assert_array_equal(verifier.score(TASK.description, _trajectories(n), CRITERIA), np.ones((n, 3)))
    return verifier.stats.calls


def test_two_processes_writing_one_cache_leave_only_parseable_entries(serve, tmp_path):
    """Two verifier processes score the same trajectories into one cache directory at once: the
    server holds each answer until both processes have asked for it, so the two writes of every
    entry overlap. Every entry left is whole, and no partial file remains."""
    n, arrived, both = 16, {}, threading.Condition()

    def in_pairs(body: dict) -> Action:
        with both:
            arrived[prompt_of(body)] = arrived.get(prompt_of(body), 0) + 1
            both.notify_all()
            both.wait_for(lambda: arrived[prompt_of(body)] >= 2, timeout=20)
        return ("answer", YES)

    server = serve(in_pairs)
    cache = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        calls = pool.starmap(_score_into, [(server.url, str(cache), n)] * 2)
    assert calls == [n, n] and sorted(arrived.values()) == [2] * n  # both asked for every entry
    entries = sorted(cache.iterdir())
    assert len(entries) == n and all(e.suffix == ".json" for e in entries), entries
    assert all(json.loads(e.read_text()) == YES for e in entries)


@pytest.mark.parametrize("how", ["file-size-limit", "not-a-directory"])
def test_unwritable_cache_does_not_stop_scoring(serve, tmp_path, caplog, how):
    """A cache that cannot be written: every write fails as on a full disk (RLIMIT_FSIZE 0, with
    SIGXFSZ ignored so the write returns EFBIG, which holds for root too), or the cache directory
    is a file."""
    import resource
    import signal

    server = serve(always(("answer", YES)))
    verifier = OpenAIVerifier(_config(server.url, tmp_path))
    cache = tmp_path / "cache"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if how == "file-size-limit":
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
    else:
        shutil.rmtree(cache)
        cache.write_text("")
    try:
        for n in (2, 3):
            np.testing.assert_array_equal(verifier.score(TASK.description, _trajectories(n), CRITERIA), np.ones((n, 3)))
    finally:
        if how == "file-size-limit":
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, previous)
    if how == "file-size-limit":
        assert not list(cache.iterdir())  # nothing kept, not even the partial files
    assert verifier.stats.calls == 5 and verifier.stats.cache_hits == 0
    (warning,) = _warnings(caplog)
    assert "cache" in warning
