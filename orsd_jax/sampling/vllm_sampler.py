"""``Sampler`` backed by a vLLM server process.

Prompts go as token ids to ``/v1/completions``, one request per prompt, sent concurrently (the
server batches them); each answer carries the output token ids and the log-prob of every
sampled token under the processed distribution (``--logprobs-mode processed_logprobs``; with
greedy decoding vLLM reports the unscaled log-probs). Generation ends only on
``params.stop_token_ids`` or stop strings (EOS is not implicit, as in ``JaxSampler``).

Weights are pushed as a Hugging Face safetensors directory that the server reloads in place
(``/collective_rpc``, dev mode, calling ``reload_weights_and_tied_head`` from
``vllm_worker_ext``), followed by a prefix-cache reset so no KV computed with the old weights
is reused. A server that dies is restarted with the latest
pushed weights and the failed requests are sent once more.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence

import httpx2

from orsd_jax.models import ModelConfig, save_hf
from orsd_jax.sampling.base import Completion, SamplingError, SamplingParams, validate_prompts
from orsd_jax.sampling.vllm_server import ServerError, ServerOptions, VLLMServer

# ModelConfig fields that decide the tensors and the numerics; the rest (token ids, dtypes)
# may differ between the pushed model and the served one.
_SERVED_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "rope_theta",
    "rms_norm_eps",
)


class _ServerDown(Exception):
    """A request got no answer, or a 5xx: the server may have died."""


def _start_servers(model_dir: str | os.PathLike, options: ServerOptions, n: int) -> list[VLLMServer]:
    """``n`` servers of ``model_dir``, starting side by side (each on its own socket)."""
    if n < 1:
        raise SamplingError(f"n_servers must be at least 1, got {n}")
    servers: list[VLLMServer] = []
    try:
        for _ in range(n):
            servers.append(VLLMServer(model_dir, options, wait=False))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers


class _Endpoint:
    """One server and what the sampler keeps for it: its HTTP client, and how often it was restarted
    (under ``lock``, so that requests that failed together restart it once)."""

    def __init__(self, server: VLLMServer, timeout_s: float, max_connections: int):
        self.server = server
        self.http = server.http(timeout_s=timeout_s, max_connections=max_connections)
        self.restarts = 0
        self.lock = threading.Lock()


class VLLMSampler:
    """``Sampler`` on vLLM servers: ``n_servers`` started here from a model directory, or given
    ``VLLMServer`` objects (used but not closed here: their owner closes them; attached ones serve
    nothing until the first push, version 0 or later, and are not restarted from here).

    With several servers, a prompt goes to server ``group % n`` (``generate(..., groups=)``: a
    group's episodes share one server's prefix cache; without groups, prompt ``i`` to ``i % n``);
    its seed does not depend on the server, so the same call draws the same samples on one server
    or several. A weight push is written once and loaded by every server, then checked on each
    (the worker reports the directory it loaded). A server that dies is restarted with the latest
    pushed weights while the others go on, and its failed requests are sent once more. Pushed
    weights go to ``scratch_dir`` (a temporary directory, removed on ``close()``, when not given);
    only the latest version is kept there. ``generate`` may be called from several threads at once
    (asynchronous episodes).
    """

    concurrent_calls = True

    def __init__(
        self,
        model_dir_or_servers: str | os.PathLike | VLLMServer | Sequence[VLLMServer],
        tokenizer,
        *,
        n_servers: int = 1,
        scratch_dir: str | os.PathLike | None = None,
        options: ServerOptions = ServerOptions(),
        max_concurrency: int = 64,
        request_timeout_s: float = 600.0,
    ):
        self.tokenizer = tokenizer
        self.request_timeout_s = request_timeout_s
        self._owns_scratch = scratch_dir is None
        # Absolute: the server resolves the paths it is sent against its own working directory.
        self.scratch_dir = pathlib.Path(scratch_dir or tempfile.mkdtemp(prefix="orsd_weights_")).resolve()
        self.scratch_dir.mkdir(parents=True, exist_ok=True)
        if isinstance(model_dir_or_servers, VLLMServer):
            servers, self._owns_servers = [model_dir_or_servers], False
        elif isinstance(model_dir_or_servers, (str, os.PathLike)):
            servers, self._owns_servers = _start_servers(model_dir_or_servers, options, n_servers), True
        else:
            servers, self._owns_servers = list(model_dir_or_servers), False
        if len({s.model_dir for s in servers}) != 1:
            raise SamplingError(f"the servers serve different models: {sorted(str(s.model_dir) for s in servers)}")
        self._endpoints = tuple(_Endpoint(s, request_timeout_s, max_concurrency) for s in servers)
        self.max_model_len = min(s.max_model_len for s in servers)
        # A server attached by URL may have started from other weights than the run's: it serves
        # an unknown version (-1) until the first push, and generate() refuses it until then.
        self.weight_version = 0 if all(s.owned for s in servers) else -1
        self._initial_dir = servers[0].model_dir
        self._latest_dir: pathlib.Path | None = None  # the latest pushed weights
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm-request")

    @property
    def servers(self) -> tuple[VLLMServer, ...]:
        return tuple(e.server for e in self._endpoints)

    @property
    def server(self) -> VLLMServer:
        """The first server (the only one, unless ``n_servers`` > 1)."""
        return self._endpoints[0].server

    # Generation.

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams, groups: Sequence[int] | None = None
    ) -> list[Completion]:
        """``groups``: the group of each prompt, which decides its server (see the class)."""
        if self.weight_version < 0:
            raise SamplingError(
                f"the attached server at {self.server.url} serves weights of unknown version: push the policy's first"
            )
        validate_prompts(prompt_token_ids, self.max_model_len, params)
        bodies = [self._request(list(map(int, p)), params, i) for i, p in enumerate(prompt_token_ids)]
        routes = [(i if groups is None else groups[i]) % len(self._endpoints) for i in range(len(bodies))]
        version = self.weight_version
        answers = self._post_all("/v1/completions", bodies, routes)
        return [
            self._completion(choice, version)
            for answer in answers
            for choice in sorted(answer["choices"], key=lambda c: c["index"])
        ]

    def _request(self, prompt: list[int], params: SamplingParams, index: int) -> dict:
        constrained = {} if params.regex is None else {"structured_outputs": {"regex": params.regex}}
        return constrained | {
            "model": self.server.served_model_name,
            "prompt": prompt,
            "max_tokens": min(params.max_new_tokens, self.max_model_len - len(prompt)),
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            # vLLM seeds sample j of a request with seed + j; distinct prompts get distinct seeds
            # so that G copies of one prompt do not all draw the same sample.
            "seed": None if params.seed is None else params.seed + index * params.n,
            "stop": list(params.stop),
            "include_stop_str_in_output": params.include_stop,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True,
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,
            "skip_special_tokens": True,
        }

    @staticmethod
    def _completion(choice: dict, version: int) -> Completion:
        token_ids = tuple(choice["token_ids"])
        logprobs = tuple(float(x) for x in choice["logprobs"]["token_logprobs"])
        if len(logprobs) != len(token_ids) or choice["finish_reason"] not in ("stop", "length"):
            raise ServerError(
                f"unexpected completion from vLLM: {len(token_ids)} tokens, {len(logprobs)} log-probs, "
                f"finish_reason {choice['finish_reason']!r}"
            )
        return Completion(token_ids, logprobs, choice["text"], choice["finish_reason"], version)

    # Weights.

    def push_weights(self, model, version: int) -> None:
        """Serves ``model``'s weights as ``version`` from now on, on every server (versions must increase)."""
        if version <= self.weight_version:
            raise SamplingError(f"weight versions must increase: serving {self.weight_version}, got {version}")
        self._check_config(model.config)
        directory = self._write(model, version)
        loads = [self._pool.submit(self._load, e, directory) for e in self._endpoints]
        errors = [error for error in (f.exception() for f in loads) if error is not None]
        if errors:
            shutil.rmtree(directory)
            if not all(isinstance(e, ServerError) for e in errors):
                raise next(e for e in errors if not isinstance(e, ServerError))
            # A failed in-place reload can leave the weights half replaced, and the servers that
            # loaded them serve a version the others do not: every server starts clean.
            for endpoint in self._endpoints:
                endpoint.server.restart(self._serving_dir)
            raise ServerError(
                f"{len(errors)} of {len(self._endpoints)} servers failed to load weights version {version} "
                f"({errors[0]}); every server was restarted and serves version {self.weight_version}"
            ) from errors[0]
        previous, self._latest_dir, self.weight_version = self._latest_dir, directory, version
        if previous is not None:
            shutil.rmtree(previous)

    def _load(self, endpoint: _Endpoint, directory: pathlib.Path) -> None:
        """Reloads ``directory`` in place on one server (restarting it once if it dies), then checks
        that the server's worker reports it loaded that directory."""
        self._with_recovery(endpoint, lambda: self._reload(endpoint, directory))
        [served] = self._post(endpoint, "/collective_rpc", {"method": "served_weights"})["results"]
        if served != str(directory):
            raise ServerError(f"the server on {endpoint.server.unix_socket or endpoint.server.url} serves {served}")

    @property
    def _serving_dir(self) -> pathlib.Path | None:
        return self._latest_dir or self._initial_dir

    def _reference_dir(self) -> pathlib.Path:
        """The directory the servers started from: the architecture pushed weights must fit."""
        if self._initial_dir is None:
            raise SamplingError(
                f"the server at {self.server.url} does not serve a local model directory: "
                "its weights cannot be checked or replaced from here"
            )
        return self._initial_dir

    def _check_config(self, config: ModelConfig) -> None:
        served = ModelConfig.from_hf_config(json.loads((self._reference_dir() / "config.json").read_text()))
        diff = [
            f"{name} {getattr(config, name)!r} (served: {getattr(served, name)!r})"
            for name in _SERVED_FIELDS
            if getattr(config, name) != getattr(served, name)
        ]
        if diff:
            raise SamplingError(
                f"the pushed model does not fit the served one ({self._reference_dir()}): " + ", ".join(diff)
            )

    def _write(self, model, version: int) -> pathlib.Path:
        """Writes under a temporary name, then renames, so a directory that exists is complete."""
        final = self.scratch_dir / f"weights-v{version}"
        partial = self.scratch_dir / f".weights-v{version}.partial"
        for leftover in (partial, final):
            shutil.rmtree(leftover, ignore_errors=True)
        save_hf(model, self.tokenizer, partial)
        os.replace(partial, final)
        return final

    def _reload(self, endpoint: _Endpoint, directory: pathlib.Path) -> None:
        rpc = {"method": "reload_weights_and_tied_head", "kwargs": {"weights_path": str(directory)}}
        self._post(endpoint, "/collective_rpc", rpc)
        self._post(endpoint, "/reset_prefix_cache", None)

    # HTTP and recovery.

    def _post(self, endpoint: _Endpoint, path: str, body: dict | None) -> dict:
        try:
            response = endpoint.http.post(path, json=body)
        except httpx2.TimeoutException as err:
            raise _ServerDown(f"{path}: no answer within {self.request_timeout_s:g} s ({err})") from err
        except httpx2.TransportError as err:  # refused, reset: no answer
            raise _ServerDown(f"{path}: {type(err).__name__}: {err}") from err
        if response.status_code >= 500:
            raise _ServerDown(f"{path} answered {response.status_code}: {response.text[:1000]}")
        if response.status_code != 200:
            raise SamplingError(f"the vLLM server rejected {path} ({response.status_code}): {response.text[:1000]}")
        return response.json()

    def _post_all(self, path: str, bodies: list[dict], routes: list[int]) -> list[dict]:
        """Posts concurrently, ``bodies[i]`` to server ``routes[i]``; a server that died is restarted
        (the others go on) and the requests it failed are sent to it once more."""
        sent_to = [e.restarts for e in self._endpoints]
        futures = [self._pool.submit(self._post, self._endpoints[r], path, b) for b, r in zip(bodies, routes)]
        answers: list = [f.exception() or f.result() for f in futures]
        failed = [i for i, a in enumerate(answers) if isinstance(a, BaseException)]
        if not failed:
            return answers
        if any(not isinstance(answers[i], _ServerDown) for i in failed):
            raise next(answers[i] for i in failed if not isinstance(answers[i], _ServerDown))
        for r in sorted({routes[i] for i in failed}):
            down = next(answers[i] for i in failed if routes[i] == r)
            self._restart_dead_server(self._endpoints[r], down, sent_to[r])
        retried = [self._pool.submit(self._post, self._endpoints[routes[i]], path, bodies[i]) for i in failed]
        for i, future in zip(failed, retried):
            answers[i] = self._unwrap(future.result)
        return answers

    def _with_recovery(self, endpoint: _Endpoint, call: Callable[[], object]) -> object:
        sent_to = endpoint.restarts
        try:
            return call()
        except _ServerDown as err:
            self._restart_dead_server(endpoint, err, sent_to)
        return self._unwrap(call)

    @staticmethod
    def _unwrap(call: Callable[[], object]) -> object:
        try:
            return call()
        except _ServerDown as err:
            raise ServerError(f"the vLLM server failed again after a restart: {err}") from err

    def _restart_dead_server(self, endpoint: _Endpoint, err: _ServerDown, sent_to: int) -> None:
        """Restarts the server that failed requests sent to its ``sent_to``-th start, unless
        another thread restarted it since (then the requests go to the new one)."""
        with endpoint.lock:
            if endpoint.restarts != sent_to:
                return
            if endpoint.server.alive():
                raise ServerError(f"the vLLM server is up but failed a request: {err}") from err
            endpoint.server.restart(self._serving_dir)
            self.max_model_len = min(e.server.max_model_len for e in self._endpoints)
            endpoint.restarts += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for endpoint in self._endpoints:
            endpoint.http.close()
            if self._owns_servers:
                endpoint.server.close()
        if self._owns_scratch:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)

    def __enter__(self) -> VLLMSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
