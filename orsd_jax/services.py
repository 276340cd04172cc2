"""The resources of a training run: its games, the policy it starts from, the compiled train
step, the sampler, the verifier and the environment pool. ``trainer`` composes them."""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
import typing
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orsd_jax import chat, distributed
from orsd_jax.checkpoints import Checkpoints
from orsd_jax.config import TrainConfig
from orsd_jax.envs.base import Task, TextEnv
from orsd_jax.envs.pool import EnvPool
from orsd_jax.estimate import attention_tokens
from orsd_jax.loss import OrsdLoss, response_logprobs
from orsd_jax.models import CausalLM, ModelConfig, cache_dir, load_model, load_tokenizer, resolve, save_hf
from orsd_jax.rollout import PromptBuilder
from orsd_jax.rubrics import sources as rubric_sources
from orsd_jax.train_step import DATA, TrainState, init_train_state, make_mesh, make_optimizer, make_train_step

if typing.TYPE_CHECKING:
    from orsd_jax.envs.webshop.goals import Split
    from orsd_jax.rubrics import Verifier
    from orsd_jax.sampling.base import Sampler
    from orsd_jax.sampling.vllm_server import ServerOptions, VLLMServer

log = logging.getLogger("orsd_jax")


@dataclasses.dataclass(frozen=True)
class EnvSuite:
    name: str
    make_env: Callable[[], TextEnv]  # picklable, for spawned workers
    build_prompt: PromptBuilder
    train: tuple[Task, ...]
    eval: dict[str, tuple[Task, ...]]  # evaluation split -> its tasks, in sweep order


def make_suite(config: TrainConfig) -> EnvSuite:
    e, steps = config.env, config.rollout.max_steps
    if e.name == "alfworld":
        from orsd_jax.envs import alfworld

        root = alfworld.default_games(e.difficulty, e.games_seed, e.train_games, e.eval_games)
        splits = {
            split: tuple(alfworld.load_split(root, split, e.task_types)) for split in ("train", *config.eval_splits)
        }
        return EnvSuite(
            "alfworld",
            functools.partial(alfworld.AlfworldEnv, max_steps=steps),
            alfworld.build_prompt,
            _pool(splits.pop("train"), e.train_pool),
            splits,
        )
    from orsd_jax.envs import webshop

    goals = functools.partial(webshop.load_goals, e.data_dir, categories=e.task_types, goals=e.goals)
    return EnvSuite(
        "webshop",
        functools.partial(webshop.WebShopEnv, e.data_dir, max_steps=steps, reward=e.reward),
        webshop.build_prompt,
        _pool(tuple(goals("train")), e.train_pool),
        # TrainConfig.validate checked the split names.
        {split: tuple(goals(typing.cast("Split", split))) for split in config.eval_splits},
    )


def _pool(train: tuple[Task, ...], size: int | None) -> tuple[Task, ...]:
    if size is None:
        return train
    if not 0 < size <= len(train):
        raise ValueError(f"train_pool={size}: the train split has {len(train)} tasks")
    return train[:size]


def initial_policy(config: TrainConfig, out: pathlib.Path) -> tuple[CausalLM, object, pathlib.Path]:
    """The model to train, its tokenizer, and a Hugging Face directory of its weights (for samplers)."""
    m = config.model
    load = functools.partial(
        load_model, dtype=m.dtype, compute_dtype=m.compute_dtype, remat=m.remat, frozen_layers=m.frozen_layers
    )
    if m.random_shape is not None:
        tokenizer = load_tokenizer(resolve(m.name))
        shape = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, **m.random_shape}
        model = CausalLM(ModelConfig(**shape, param_dtype=m.dtype), nnx.Rngs(config.seed))
        directory = out / "initial_policy"
        if not (directory / "config.json").is_file():
            save_hf(model, tokenizer, directory)
        model, _ = load(directory)  # through the checkpoint, as a real model
        return model, tokenizer, directory
    if m.warmstart is not None:
        from orsd_jax.warmstart import cached_warmstart

        directory = cached_warmstart(m.warmstart, log=log.info)
    else:
        directory = resolve(m.name)
    model, tokenizer = load(directory)
    return model, tokenizer, directory


def _max_len(config: TrainConfig) -> int:
    return max(
        config.rollout.max_prompt_tokens + config.rollout.max_response_tokens,
        config.rubric.max_prompt_tokens + config.rubric.max_new_tokens,
    )


def sampler_options(config: TrainConfig) -> ServerOptions:
    """The options of the policy's vLLM servers (``experiments.serve`` starts one the same way)."""
    from orsd_jax.sampling.vllm_server import ServerOptions

    return ServerOptions(max_model_len=_max_len(config), seed=config.seed)


def _launch_servers(
    config: TrainConfig, directory: pathlib.Path, out: pathlib.Path, sampler_urls: Sequence[str]
) -> tuple[list[VLLMServer], VLLMServer | None]:
    """The sampler's vLLM server processes (none for the in-process sampler; attached ones where
    ``sampler_urls`` name them) and the verifier's (None where the run has none), launched without
    waiting for them to answer."""
    from orsd_jax.sampling.vllm_server import ServerOptions, VLLMServer

    samplers: list[VLLMServer] = []
    verifier = None
    try:
        if sampler_urls:
            samplers = [VLLMServer.attach(url) for url in sampler_urls]
        elif config.sampler == "vllm":
            for s in range(config.sampler_servers):
                log_path = out / "logs" / ("sampler.log" if s == 0 else f"sampler-{s}.log")
                samplers.append(VLLMServer(directory, sampler_options(config), log_path=log_path, wait=False))
        if config.uses_rubrics and config.verifier.kind == "local-vllm":
            options = ServerOptions(served_model_name="verifier", max_model_len=4096, seed=config.seed, dev_mode=False)
            verifier = VLLMServer(directory, options, log_path=out / "logs" / "verifier.log", wait=False)
    except BaseException:
        for server in samplers:
            server.close()
        raise
    return samplers, verifier


def _make_sampler(config: TrainConfig, servers: list[VLLMServer], model: CausalLM, tokenizer, out: pathlib.Path):
    """The policy's sampler: on its vLLM servers (started), or in process."""
    if not servers:
        from orsd_jax.sampling.jax_sampler import JaxSampler

        return JaxSampler(model, tokenizer, max_model_len=_max_len(config), seed=config.seed)
    from orsd_jax.sampling.vllm_sampler import VLLMSampler

    return VLLMSampler(servers, tokenizer, scratch_dir=out / "sampler_weights")


def _make_verifier(
    config: TrainConfig, server: VLLMServer | None, directory: pathlib.Path, tokenizer, out: pathlib.Path
) -> Verifier:
    """The frozen verifier: on its vLLM server (started), in process, or a remote endpoint."""
    from orsd_jax.rubrics import EndpointConfig, LocalModelVerifier, OpenAIVerifier

    v = config.verifier
    cache = str(out / "verifier_cache")
    if v.kind == "local-jax":
        frozen, _ = load_model(directory)
        return LocalModelVerifier(frozen, tokenizer)
    if v.kind == "openai":
        if v.endpoint is None:
            raise ValueError("verifier kind 'openai' needs its endpoint (VerifierSetup.endpoint)")
        # The policy's tokenizer counts the trajectory budget: the paper's verifier (Qwen3.5-Plus)
        # shares the Qwen3 policy's; another model's context overflow drops only its pairs.
        return OpenAIVerifier(dataclasses.replace(v.endpoint, cache_dir=cache), tokenizer=tokenizer)
    assert server is not None  # launched for local-vllm
    endpoint = EndpointConfig(
        base_url=f"{server.url}/v1",
        model="verifier",
        unix_socket=server.unix_socket,
        mode=v.mode,
        concurrency=8,
        cache_dir=cache,
    )
    return OpenAIVerifier(endpoint, tokenizer=tokenizer)  # the served model's own tokenizer


class Services:
    """Everything a run's updates use besides the train state (``initial_state``: the state a
    fresh run starts from). ``start`` launches the sampler, verifier and environments."""

    def __init__(self, config: TrainConfig, out_dir: str | pathlib.Path, sampler_urls: Sequence[str] = ()):
        """``sampler_urls``: vLLM servers of the policy someone else started (``experiments.serve``),
        used in place of ``config.sampler_servers`` started here."""
        if sampler_urls and (config.sampler != "vllm" or config.sampler_servers != 1):
            raise ValueError(
                f"sampler URLs {list(sampler_urls)} replace the vLLM servers the run starts: they need "
                f"the vLLM sampler and sampler_servers 1 (got {config.sampler!r}, {config.sampler_servers})"
            )
        self.sampler_urls = tuple(sampler_urls)
        self.config = config = config.resolved()
        self.out = out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax_compile"))
        # Every program, not only those compiling for over a second (JAX's default): a run's many
        # small programs (decode steps, metrics) add up; a rerun of the tiny preset with a warm cache
        # (`python -m experiments.train_alfworld --preset tiny`, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
        # 0 against 1) took 20.2-21.5 s against 24.4-25.9 s (3 runs each, interleaved, at ac11213,
        # 2-core Xeon with AVX-512, a study run beside).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        # Process 0 first: it fills the caches (generated games, the warm start) the others read.
        self.suite = distributed.main_first("suite", lambda: make_suite(config))
        model, self.tokenizer, self.initial_dir = distributed.main_first(
            "initial policy", lambda: initial_policy(config, out)
        )
        self.fmt = chat.chat_format(self.tokenizer)
        mesh = make_mesh(config.devices)
        if config.minibatch_rows % (mesh.size * config.micro_batches):
            raise ValueError(
                f"minibatch_rows {config.minibatch_rows} must divide into {mesh.size} devices "
                f"x {config.micro_batches} micro-batches"
            )
        self.minibatch_spec = dataclasses.replace(
            config.minibatch_spec(), attention_tokens=attention_tokens(model.config)
        )
        optimizer = make_optimizer(config.optimizer, frozen_layers=config.model.frozen_layers)
        self.graphdef, self.initial_state, self.sharding = init_train_state(model, optimizer, mesh, config.fsdp)
        # The KL's reference policy: the initial policy's parameters, placed once like the policy's
        # (rebuilt from the same initial weights on resume, so it is not checkpointed). A copy, not
        # an alias: the train step donates (and so frees) the policy's own buffers.
        with_reference = bool(config.loss.kl_coef)
        copy = lambda x, sharding: jax.device_put(jax.numpy.copy(x), sharding)  # noqa: E731
        params = self.initial_state.params
        self.reference = jax.tree.map(copy, params, self.sharding.params) if with_reference else None
        self.train_step = make_train_step(
            OrsdLoss(config.loss), optimizer, self.graphdef, self.sharding, with_reference
        )
        graphdef, temperature = self.graphdef, config.loss.temperature
        by_rows = NamedSharding(mesh, P(DATA))
        forward = jax.jit(
            lambda params, batch: response_logprobs(
                nnx.merge(graphdef, params), batch, temperature=temperature, with_rubric=False
            )[1],
            in_shardings=(self.sharding.params, by_rows),
            out_shardings=by_rows,
        )
        self.old_logprobs = lambda params, batch: forward(params, distributed.to_global(batch, by_rows))
        self.checkpoints = Checkpoints(out / "checkpoints", config.keep_checkpoints)
        # What the non-policy rubric sources read: the oracle, or the user's file (checked now).
        r = config.rubric
        self.rubric_source = (
            {"oracle": rubric_sources.oracle_for(config.env.name, config.env.data_dir)}
            if r.source in ("oracle", "shuffled")
            else {"rubrics": rubric_sources.load_file(r.source_file)}
            if r.source == "file" and r.source_file is not None  # RubricConfig checks they go together
            else {}
        )
        self._model = model
        self.sampler: Sampler | None = None
        self.verifier: Verifier | None = None
        self.pool: EnvPool | None = None
        self.sampler_servers: list[VLLMServer] = []
        self.verifier_server: VLLMServer | None = None

    def start(self) -> None:
        """The sampler, the verifier and the environment pool. The vLLM servers start as processes
        and the environment workers come up meanwhile (the servers spend most of their start-up on
        imports and files); everything waits in this thread, so that a failure or a signal
        anywhere reaches ``close()`` with every launched process recorded."""
        c = self.config
        if not distributed.is_main():  # process 0 plays the episodes (distributed.py)
            return
        self.sampler_servers, self.verifier_server = _launch_servers(c, self.initial_dir, self.out, self.sampler_urls)
        self.pool = EnvPool(self.suite.make_env, c.n_tasks * c.group_size, c.env.workers)
        for server in [*self.sampler_servers, self.verifier_server]:
            if server is not None and server.owned:
                server.wait_ready()
        self.sampler = _make_sampler(c, self.sampler_servers, self._model, self.tokenizer, self.out)
        if self.sampler.weight_version < 0:  # attached servers: they may serve other weights
            self.sampler.push_weights(self._model, 0)
        if c.uses_rubrics:
            self.verifier = _make_verifier(c, self.verifier_server, self.initial_dir, self.tokenizer, self.out)

    def policy(self, state: TrainState) -> CausalLM:
        """The policy of ``state`` on this process's devices (several processes: every process
        asks at the same point, ``distributed.local``)."""
        return nnx.merge(self.graphdef, distributed.local(state.params))

    def close(self) -> None:
        for resource in (self.pool, self.sampler, *self.sampler_servers, self.verifier_server):
            if resource is not None:
                resource.close()
        self.checkpoints.close()
