"""The sampler's and the verifier's HTTP clients against a real server that drops idle
connections as vLLM's does.

vLLM's API server (uvicorn) closes a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds
(5 by default). A request sent on such a connection just as the server closes it gets no answer:
``RemoteProtocolError: Server disconnected without sending a response`` (a CI run failed on it, in a
test that spent about 5 s between two requests). The server here makes that race certain: a
request that arrives on a connection idle for ``SERVER_KEEPALIVE_S`` less ``RACE_S`` is dropped
unanswered (both clocks run from the same reply, but on a loaded machine the client's send and the
server's close each come late by a fraction of a second).
"""

from __future__ import annotations

import http.server
import json
import select
import socket
import threading
import time

import pytest

from orsd_jax.rubrics.verify import EndpointConfig, OpenAIVerifier
from orsd_jax.sampling.vllm_server import VLLMServer

SERVER_KEEPALIVE_S = 5.0  # vLLM's default VLLM_HTTP_TIMEOUT_KEEP_ALIVE
RACE_S = 0.5
LISTING = {"data": [{"id": "policy", "root": "", "max_model_len": 64}]}


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def setup(self):
        super().setup()
        self.server.connections += 1
        self.last_reply = None

    def handle_one_request(self):
        if self.last_reply is not None:
            select.select([self.connection], [], [])  # the next request, or the client's close
            if not self.connection.recv(1, socket.MSG_PEEK):
                self.close_connection = True
                return
            if time.monotonic() - self.last_reply >= SERVER_KEEPALIVE_S - RACE_S:
                self.server.dropped += 1
                self.close_connection = True  # the server's idle timer fires as the request comes
                return
        super().handle_one_request()
        self.last_reply = time.monotonic()

    def _reply(self):
        body = json.dumps(LISTING).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.connections = httpd.dropped = 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _sampler_client(url: str):
    """A request through the sampler's client, its close, and the connections opened before it
    (attach's own)."""
    http = VLLMServer.attach(url).http()
    return (lambda: http.post("/v1/completions", json={}).raise_for_status()), http.close, 1


def _verifier_client(url: str):
    """The same through the verifier's own ``openai`` client (its retries are off: a dropped request
    raises)."""
    client = OpenAIVerifier(EndpointConfig(base_url=f"{url}/v1", model="policy"))._client
    return client.models.list, client.close, 0


@pytest.mark.parametrize("make_client", [_sampler_client, _verifier_client], ids=["sampler", "verifier"])
def test_no_request_goes_on_a_connection_the_server_may_be_dropping(server, make_client):
    request, close, opened_before = make_client(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        for _ in range(3):  # quick requests share one connection
            request()
        assert server.connections == opened_before + 1
        time.sleep(SERVER_KEEPALIVE_S - RACE_S / 2)
        request()
    finally:
        close()
    assert server.dropped == 0
    assert server.connections == opened_before + 2
