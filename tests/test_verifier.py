"""OpenAIVerifier against a real local HTTP server that misbehaves on purpose.

Errors, malformed replies and slow replies cannot be had from a healthy model server, so this
server (real HTTP on 127.0.0.1, driven by the real ``openai`` client) plays them from a script.
The verifier against a real vLLM server is tested in ``test_rubric_stage.py``.
"""

import http.server
import json
import threading
import time

import numpy as np
import pytest

from orsd_jax.envs.base import Task
from orsd_jax.rollout import Step, Trajectory
from orsd_jax.rubrics import EndpointConfig, OpenAIVerifier
from orsd_jax.rubrics.verify import parse_binary_answer, yes_probability

CRITERIA = ["The agent opens the fridge.", "The agent takes the apple.", "The agent goes to the sink."]


class ScriptedServer(http.server.ThreadingHTTPServer):
    """Answers chat completions with the next scripted behaviour; counts requests."""

    def __init__(self, script):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script, self.requests, self.lock = list(script), [], threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def next_behaviour(self, body):
        with self.lock:
            self.requests.append(body)
            return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def stop(self):
        self.shutdown()
        self.server_close()
        self.thread.join()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kind, payload = self.server.next_behaviour(body)
        if kind == "delay":
            time.sleep(payload)
            kind, payload = "content", '{"1": "yes", "2": "yes", "3": "yes"}'
        if kind == "status":
            self._send(payload, b'{"error": {"message": "scripted failure"}}')
            return
        if kind == "garbage":
            self._send(200, b"this is not json")
            return
        message = {"role": "assistant", "content": payload if kind == "content" else "yes"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        if kind == "logprobs":
            top = [{"token": t, "logprob": lp, "bytes": None} for t, lp in payload]
            choice["logprobs"] = {
                "content": [{"token": "yes", "logprob": payload[0][1], "bytes": None, "top_logprobs": top}]
            }
        reply = {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107},
        }
        self._send(200, json.dumps(reply).encode())

    def _send(self, status, data):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except BrokenPipeError:  # the client timed out first, as scripted
            pass


@pytest.fixture
def serve():
    servers = []

    def start(*script):
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _trajectories(n=2, same=True):
    def step(i):
        return Step(
            "",
            (1,),
            (2,),
            (-0.1,),
            "",
            "You see a fridge 1.",
            f"open fridge {1 if same else i}",
            True,
            True,
            0.0,
            False,
            0,
        )

    return [Trajectory(Task("alfworld", "g", "cool", "cool an apple"), (step(i),), False, 0.0) for i in range(n)]


def _verifier(server, tmp_path, **kw):
    config = EndpointConfig(
        base_url=server.url,
        model="judge",
        timeout_s=1.0,
        max_retries=2,
        backoff_s=0.01,
        concurrency=2,
        cache_dir=str(tmp_path / "cache"),
        price_per_m_input=1.0,
        **kw,
    )
    return OpenAIVerifier(config)


def test_scores_and_caches(serve, tmp_path):
    server = serve(("content", 'Sure! {"1": "yes", "2": "no", "3": "YES"}'))
    verifier = _verifier(server, tmp_path)
    scores = verifier.score("cool an apple", _trajectories(), CRITERIA)
    np.testing.assert_array_equal(scores, [[1, 0, 1], [1, 0, 1]])
    assert len(server.requests) == 1  # both trajectories render alike: asked once
    assert verifier.stats.calls == 1 and verifier.stats.cache_hits == 0 and verifier.stats.input_tokens == 100
    assert verifier.stats.cost_usd(verifier.config) == pytest.approx(100 / 1e6)
    again = _verifier(server, tmp_path)  # a resumed run: everything from the disk cache
    np.testing.assert_array_equal(again.score("cool an apple", _trajectories(), CRITERIA), scores)
    assert len(server.requests) == 1 and again.stats.cache_hits == 1 and again.stats.calls == 0
    assert "criterion number" in server.requests[0]["messages"][0]["content"]


def test_retries_server_errors_then_succeeds(serve, tmp_path):
    server = serve(("status", 500), ("status", 429), ("content", '{"answers": ["no", "no", "yes"]}'))
    verifier = _verifier(server, tmp_path)
    np.testing.assert_array_equal(verifier.score("cool an apple", _trajectories(1), CRITERIA), [[0, 0, 1]])
    assert verifier.stats.calls == 3 and verifier.stats.retries == 2 and verifier.stats.failures == 0


@pytest.mark.parametrize(
    "behaviour",
    [
        ("status", 503),
        ("garbage", None),
        ("content", "I think the agent did fine."),
        ("content", '{"1": "yes"}'),
        ("delay", 3.0),
    ],
    ids=["http-error", "not-json", "no-answers", "missing-criteria", "timeout"],
)
def test_failed_pair_marks_bundle_invalid_and_is_not_cached(serve, tmp_path, behaviour):
    server = serve(behaviour)
    verifier = _verifier(server, tmp_path)
    started = time.perf_counter()
    scores = verifier.score_many("cool an apple", _trajectories(2, same=False), [CRITERIA, CRITERIA[:2]])
    assert all(np.isnan(s).all() for s in scores)
    assert verifier.stats.failures == 4 and verifier.stats.calls == 12 and verifier.stats.retries == 8
    assert not list((tmp_path / "cache").iterdir())
    if behaviour[0] == "delay":  # 3 attempts of ~1 s per pair, 4 pairs two at a time
        assert time.perf_counter() - started < 2 * 3 * 1.2 + 2.0


def test_logprob_mode(serve, tmp_path):
    server = serve(("logprobs", [("yes", np.log(0.6)), ("no", np.log(0.2)), ("maybe", np.log(0.2))]))
    verifier = _verifier(server, tmp_path, mode="logprob")
    scores = verifier.score("cool an apple", _trajectories(1), CRITERIA)
    np.testing.assert_allclose(scores, [[0.75, 0.75, 0.75]])
    assert len(server.requests) == 3 and all(r["max_tokens"] == 1 and r["top_logprobs"] == 20 for r in server.requests)


def test_answer_parsers():
    assert parse_binary_answer('{"1": "yes", "2": "no"}', 2) == [1.0, 0.0]
    assert parse_binary_answer('```json\n{"criterion 1": true, "criterion 2": "No"}\n```', 2) == [1.0, 0.0]
    assert parse_binary_answer("1. yes\n2: no\n3) yes", 3) == [1.0, 0.0, 1.0]
    assert parse_binary_answer('["yes", "no", "no"]', 3) == [1.0, 0.0, 0.0]
    assert parse_binary_answer('{"1": "yes"}', 2) is None
    assert parse_binary_answer("", 1) is None and parse_binary_answer(None, 1) is None
    assert yes_probability([(" Yes", np.log(0.3)), ("No", np.log(0.1))]) == pytest.approx(0.75)
    assert yes_probability([("maybe", 0.0)]) is None
