"""The training loop. It composes the stages and does the I/O; every stage is a function above.

One update: collect ``n_tasks x G`` episodes -> (ORSD) write K rubric bundles per group, verify
them, select one -> GRPO/GiGPO advantages per step sample -> pack step samples (with the rubric
inserted for the with-rubric branch) -> optimizer steps over minibatches -> push the new weights
to the sampler. Checkpoints, logs and evaluations happen between updates.

Run directory: ``config.json``, ``metrics.jsonl`` and ``tb/`` (the same scalars), ``checkpoints/``
(Orbax), ``steps/<update>/`` (groups, rubrics and per-token credit of recorded updates),
``eval/<update>/`` (tables), ``policy/`` (the final policy as a Hugging Face directory).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import pathlib
import random
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from orsd_jax import chat, evaluation
from orsd_jax.advantages import AdvantageConfig, rank_targets, returns, step_advantages
from orsd_jax.batch import StepSample, build_batch
from orsd_jax.checkpoints import Checkpoints
from orsd_jax.config import TrainConfig, to_json
from orsd_jax.envs.base import Task, TextEnv
from orsd_jax.envs.pool import EnvPool
from orsd_jax.loss import OrsdLoss, response_logprobs
from orsd_jax.metrics_log import MetricsLog, progress
from orsd_jax.models import CausalLM, ModelConfig, load_model, resolve, save_hf
from orsd_jax.rollout import Group, PromptBuilder, collect_groups
from orsd_jax.rubrics import GroupRubric, generate_bundles, rubric_insert, rubric_metrics, verify_and_select
from orsd_jax.rubrics import sources as rubric_sources
from orsd_jax.rubrics.alignment import select_by_gap, trajectory_gaps
from orsd_jax.train_step import TrainState, init_train_state, make_mesh, make_optimizer, make_train_step

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

    return EnvSuite(
        "webshop",
        functools.partial(webshop.WebShopEnv, e.data_dir, max_steps=steps, reward=e.reward),
        webshop.build_prompt,
        _pool(tuple(webshop.load_goals(e.data_dir, "train")), e.train_pool),
        {split: tuple(webshop.load_goals(e.data_dir, split)) for split in config.eval_splits},
    )


def _pool(train: tuple[Task, ...], size: int | None) -> tuple[Task, ...]:
    if size is None:
        return train
    if not 0 < size <= len(train):
        raise ValueError(f"train_pool={size}: the train split has {len(train)} tasks")
    return train[:size]


def tasks_for_update(train: Sequence[Task], n_tasks: int, seed: int, update: int) -> list[Task]:
    """The data cursor: epochs of seeded shuffles of the train tasks, ``n_tasks`` per update."""
    out = []
    for idx in range(update * n_tasks, (update + 1) * n_tasks):
        epoch, pos = divmod(idx, len(train))
        order = list(range(len(train)))
        random.Random(f"{seed}/epoch{epoch}").shuffle(order)
        out.append(train[order[pos]])
    return out


def step_samples(
    groups: Sequence[Group],
    advantages: Sequence[Sequence[np.ndarray]],
    rubrics: Sequence[GroupRubric] | None,
    fmt: chat.ChatFormat,
    tokenizer,
) -> tuple[list[StepSample], list[tuple[int, int, int]]]:
    """Every step sample with its advantage and its group's rubric insert; and its (group, traj, step)."""
    samples, index = [], []
    tail = len(fmt.tail)
    for g, group in enumerate(groups):
        criteria = rubrics[g].criteria if rubrics else None
        insert = tuple(chat.encode(tokenizer, rubric_insert(criteria))) if criteria else ()
        for t, traj in enumerate(group.trajectories):
            for s, step in enumerate(traj.steps):
                samples.append(
                    StepSample(
                        prefix=step.prompt_ids[:-tail],
                        tail=step.prompt_ids[-tail:],
                        response=step.response_ids,
                        old_logprobs=step.logprobs,
                        advantage=float(advantages[g][t][s]),
                        insert=insert,
                    )
                )
                index.append((g, t, s))
    return samples, index


def rollout_metrics(groups: Sequence[Group], stats) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    out = {
        "env/success": float(np.mean([t.won for t in trajs])),
        "env/score": float(np.mean([t.score for t in trajs])),
        "env/reward": float(np.mean([t.reward for t in trajs])),
        "env/steps": float(np.mean([len(t.steps) for t in trajs])),
        "env/invalid_rate": stats.invalid_answers / max(stats.env_steps, 1),
        "env/mixed_groups": float(np.mean([len(set(g.rewards)) > 1 for g in groups])),
        "rollout/env_steps": float(stats.env_steps),
        "rollout/truncated_prompts": float(stats.truncated_prompts),
        "rollout/generated_tokens": float(stats.generated_tokens),  # the interaction budget (study reports)
        "rollout/generated_tokens_per_s": stats.generated_tokens / max(stats.sampler_seconds, 1e-9),
        "rollout/env_steps_per_s": stats.env_steps / max(stats.wall_seconds, 1e-9),
        "time/rollout": stats.wall_seconds,
    }
    for task_type in sorted({t.task.task_type for t in trajs}):
        out[f"env/success/{task_type}"] = float(np.mean([t.won for t in trajs if t.task.task_type == task_type]))
    return out


def _initial_policy(config: TrainConfig, out: pathlib.Path) -> tuple[CausalLM, object, pathlib.Path]:
    """The model to train, its tokenizer, and a Hugging Face directory of its weights (for samplers)."""
    m = config.model
    options = dict(dtype=m.dtype, compute_dtype=m.compute_dtype, remat=m.remat, frozen_layers=m.frozen_layers)
    if m.random_shape is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve(m.name))
        shape = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, **m.random_shape}
        model_config = ModelConfig(**shape, param_dtype=m.dtype)
        model = CausalLM(model_config, nnx.Rngs(config.seed))
        directory = out / "initial_policy"
        if not (directory / "config.json").is_file():
            save_hf(model, tokenizer, directory)
        model, _ = load_model(directory, **options)  # through the checkpoint, as a real model
        return model, tokenizer, directory
    if m.warmstart is not None:
        from orsd_jax.warmstart import cached_warmstart

        directory = cached_warmstart(m.warmstart, log=log.info)
    else:
        directory = resolve(m.name)
    model, tokenizer = load_model(directory, **options)
    return model, tokenizer, directory


def _make_sampler(config: TrainConfig, directory: pathlib.Path, model: CausalLM, tokenizer, out: pathlib.Path):
    """The policy's sampler and the server it runs on (None in process)."""
    max_len = max(
        config.rollout.max_prompt_tokens + config.rollout.max_response_tokens,
        config.rubric.max_prompt_tokens + config.rubric.max_new_tokens,
    )
    if config.sampler == "jax":
        from orsd_jax.sampling.jax_sampler import JaxSampler

        return JaxSampler(model, tokenizer, max_model_len=max_len, seed=config.seed), None
    from orsd_jax.sampling.vllm_sampler import VLLMSampler
    from orsd_jax.sampling.vllm_server import ServerOptions, VLLMServer

    server = VLLMServer(
        directory, ServerOptions(max_model_len=max_len, seed=config.seed), log_path=out / "logs" / "sampler.log"
    )
    return VLLMSampler(server, tokenizer, scratch_dir=out / "sampler_weights"), server


def _make_verifier(config: TrainConfig, directory: pathlib.Path, tokenizer, out: pathlib.Path):
    """The frozen verifier and the server it owns (or None)."""
    from orsd_jax.rubrics import LocalModelVerifier, OpenAIVerifier, VerifierConfig

    v = config.verifier
    cache = str(out / "verifier_cache")
    if v.kind == "local-jax":
        frozen, _ = load_model(directory)
        return LocalModelVerifier(frozen, tokenizer), None
    if v.kind == "openai":
        return OpenAIVerifier(dataclasses.replace(v.endpoint, cache_dir=cache)), None
    from orsd_jax.sampling.vllm_server import ServerOptions, VLLMServer

    options = ServerOptions(served_model_name="verifier", max_model_len=4096, seed=config.seed, dev_mode=False)
    server = VLLMServer(directory, options, log_path=out / "logs" / "verifier.log")
    endpoint = VerifierConfig(
        base_url=f"{server.url}/v1", model="verifier", mode=v.mode, concurrency=8, cache_dir=cache
    )
    return OpenAIVerifier(endpoint), server


def _save_step(out: pathlib.Path, update: int, advantage: AdvantageConfig, groups, rubrics, index, minibatches) -> None:
    """What the credit maps show: groups (text), rubric candidates and selection, per-token values,
    and (ALFWorld) whether each step's action was expert-consistent (``expert.label_episodes``)."""
    directory = out / "steps" / f"{update:05d}"
    directory.mkdir(parents=True, exist_ok=True)
    expert = [[[None] * len(t.steps) for t in g.trajectories] for g in groups]
    if groups and groups[0].task.env == "alfworld":
        from orsd_jax.envs.alfworld.expert import label_groups

        expert = label_groups(groups)
    payload = {
        "groups": [
            {
                "task": dataclasses.asdict(g.task),
                "trajectories": [
                    {
                        "won": t.won,
                        "score": t.score,
                        "reward": t.reward,
                        "return": float(r),
                        "steps": [
                            {
                                "observation": s.observation,
                                "response": s.response_text,
                                "action": s.action,
                                "valid": s.valid,
                                "valid_format": s.valid_format,
                                "reward": s.reward,
                                "response_ids": list(s.response_ids),
                                "expert": e,
                            }
                            for s, e in zip(t.steps, labels)
                        ],
                    }
                    for t, r, labels in zip(g.trajectories, returns(g, advantage), experts)
                ],
            }
            for g, experts in zip(groups, expert)
        ],
        "rubrics": None
        if rubrics is None
        else [
            {
                "candidates": [{"criteria": list(b.criteria), "reason": b.reason} for b in r.bundles],
                "satisfaction": np.where(np.isnan(r.satisfaction), None, r.satisfaction).tolist(),
                "correlations": [None if np.isnan(c) else float(c) for c in r.selection.correlations],
                "chosen": r.selection.index,
                "reason": r.selection.reason,
            }
            for r in rubrics
        ],
    }
    (directory / "step.json").write_text(json.dumps(payload))
    for k, (rows, values, mask) in enumerate(minibatches):
        np.savez_compressed(directory / f"credit_{k}.npz", rows=np.array([index[r] for r in rows]), mask=mask, **values)


class Run:
    """The resources of one training run; ``train`` drives it."""

    def __init__(self, config: TrainConfig, out_dir: str | os.PathLike):
        self.config = config = config.resolved()
        self.out = out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(_compile_cache()))
        self.suite = make_suite(config)
        self.model, self.tokenizer, self.initial_dir = _initial_policy(config, out)
        self.fmt = chat.chat_format(self.tokenizer)
        mesh = make_mesh(config.devices)
        if config.minibatch_rows % (mesh.size * config.micro_batches):
            raise ValueError(
                f"minibatch_rows {config.minibatch_rows} must divide into {mesh.size} devices x {config.micro_batches} micro-batches"
            )
        optimizer = make_optimizer(config.optimizer, frozen_layers=config.model.frozen_layers)
        self.graphdef, self.state, self.sharding = init_train_state(self.model, optimizer, mesh, config.fsdp)
        # The KL's reference policy: the initial policy's parameters, placed once like the policy's
        # (rebuilt from the same initial weights on resume, so it is not checkpointed).
        with_reference = bool(config.loss.kl_coef)
        # A copy, not an alias: the train step donates (and so frees) the policy's own buffers.
        copy = lambda x, sharding: jax.device_put(jax.numpy.copy(x), sharding)  # noqa: E731
        self.reference = jax.tree.map(copy, self.state.params, self.sharding.params) if with_reference else None
        self.train_step = make_train_step(
            OrsdLoss(config.loss), optimizer, self.graphdef, self.sharding, with_reference
        )
        graphdef, temperature = self.graphdef, config.loss.temperature
        self.old_logprobs = jax.jit(
            lambda params, batch: response_logprobs(
                nnx.merge(graphdef, params), batch, temperature=temperature, with_rubric=False
            )[1]
        )
        self.checkpoints = Checkpoints(out / "checkpoints", config.keep_checkpoints)
        # What the non-policy rubric sources read: the oracle, or the user's file (checked now).
        r = config.rubric
        self.rubric_source = (
            {"oracle": rubric_sources.oracle_for(config.env.name, config.env.data_dir)}
            if r.source in ("oracle", "shuffled")
            else {"rubrics": rubric_sources.load_file(r.source_file)}
            if r.source == "file"
            else {}
        )
        self.sampler = self.sampler_server = self.verifier = self.verifier_server = self.pool = None

    def start_services(self) -> None:
        """The sampler, the verifier and the environment pool, started side by side (vLLM servers
        spend most of their start-up waiting on imports and files)."""
        c = self.config
        with concurrent.futures.ThreadPoolExecutor(3) as executor:
            sampler = executor.submit(_make_sampler, c, self.initial_dir, self.model, self.tokenizer, self.out)
            verifier = (
                executor.submit(_make_verifier, c, self.initial_dir, self.tokenizer, self.out)
                if c.uses_rubrics
                else None
            )
            envs = executor.submit(EnvPool, self.suite.make_env, c.n_tasks * c.group_size, c.env.workers)
        # Keep whatever started, so that close() stops it when another part failed.
        if sampler.exception() is None:
            self.sampler, self.sampler_server = sampler.result()
        if verifier is not None and verifier.exception() is None:
            self.verifier, self.verifier_server = verifier.result()
        if envs.exception() is None:
            self.pool = envs.result()
        for future in (sampler, verifier, envs):
            if future is not None and future.exception() is not None:
                raise future.exception()

    def policy(self) -> CausalLM:
        return nnx.merge(self.graphdef, self.state.params)

    def close(self) -> None:
        for resource in (self.pool, self.sampler, self.sampler_server, self.verifier_server):
            if resource is not None:
                resource.close()
        self.checkpoints.close()


def _compile_cache() -> pathlib.Path:
    from orsd_jax.models import cache_dir

    return cache_dir() / "jax_compile"


def train_minibatches(
    train_step,
    state: TrainState,
    samples: Sequence[StepSample],
    orders: Sequence[np.ndarray],
    config: TrainConfig,
    record: bool,
    reference=None,
) -> tuple[TrainState, dict[str, float], dict[str, float], list]:
    """Optimizer steps over ``samples``, one pass (PPO epoch) per permutation in ``orders``,
    ``config.minibatch_rows`` at a time; ``reference``: the KL's frozen parameters.

    Returns the new state; the loss metrics of the whole update, computed once from the loss sums
    of every minibatch (so the gap statistics are exact over the update, not means of means);
    counts (``tokens``: response tokens; ``row_tokens``: the tokens the forward passes read, the
    packed rows without their padding; ``row_slots``: the same with it); and, when ``record``, per
    minibatch of the first pass (rows, the token values its step's loss computed, response mask).
    """
    totals: dict[str, float] = {}
    weighted = {"loss": 0.0, "grad_norm": 0.0}  # per-step values, token-weighted
    counts, recorded = {"tokens": 0.0, "row_tokens": 0, "row_slots": 0}, []
    passes = [(epoch, start) for epoch in range(len(orders)) for start in range(0, len(samples), config.minibatch_rows)]
    mismatch = {}
    for epoch, start in progress(passes, "train"):
        rows = orders[epoch][start : start + config.minibatch_rows].tolist()
        batch = minibatch([samples[r] for r in rows], config)
        tokens, slots = batch.token_counts()
        counts["row_tokens"] += tokens
        counts["row_slots"] += slots
        state, step_metrics, values = train_step(state, batch, config.micro_batches, reference)
        if not mismatch:  # the first step's log-probs are at the rollout's parameters
            sampler = batch.old_logp if batch.sampler_logp is None else batch.sampler_logp
            mismatch = logprob_mismatch(np.asarray(values["logp_without"]), sampler, batch.response_mask)
        if record and epoch == 0:
            slots = batch.sample_slots()
            recorded.append((rows, {k: np.asarray(v)[slots] for k, v in values.items()}, batch.response_mask[slots]))
        step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        for k, v in step_metrics.items():
            if k.startswith("sum/"):
                totals[k[4:]] = totals.get(k[4:], 0.0) + v
        for k in weighted:
            weighted[k] += step_metrics[k] * step_metrics["tokens"]
        counts["tokens"] += step_metrics["tokens"]
    tokens = counts["tokens"]
    metrics = {k: float(v) for k, v in OrsdLoss.metrics(totals, tokens).items()} | mismatch
    return state, metrics | {k: v / max(tokens, 1.0) for k, v in weighted.items()}, counts, recorded


def minibatch(samples: Sequence[StepSample], config: TrainConfig):
    """The step samples of one optimizer step as a batch in the run's replay layout: rows of
    several samples (``config.pack_rows``; as many rows as they fill, a multiple of the devices x
    micro-batches), or one per row (``minibatch_rows`` rows)."""
    if config.pack_rows:
        multiple = (config.devices or jax.device_count()) * config.micro_batches
        return build_batch(
            samples,
            seq_multiple=128,
            response_multiple=32,
            batch_multiple=multiple,
            layout=config.replay,
            pack=True,
            row_tokens=config.row_tokens,
        )
    return build_batch(
        samples, seq_multiple=128, response_multiple=32, batch_multiple=config.minibatch_rows, layout=config.replay
    )


def logprob_mismatch(trainer: np.ndarray, sampler: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """How far the trainer's log-probs ``[B, Y]`` of the response tokens are from the sampler's at
    the same parameters: the mean and max absolute difference, and the mean ratio p_trainer /
    p_sampler (1 when they agree; the PPO ratio's value before any update)."""
    real = mask > 0
    diff = (trainer - sampler)[real]
    return {
        "logprob_mismatch_mean": float(np.mean(np.abs(diff))),
        "logprob_mismatch_max": float(np.max(np.abs(diff))),
        "sampler_ratio_mean": float(np.mean(np.exp(diff))),
    }


def with_trainer_logprobs(forward, params, samples: Sequence[StepSample], config: TrainConfig) -> list[StepSample]:
    """Truncated importance sampling's two sides: the samples with the trainer's own log-probs at
    ``params`` (the rollout's) as ``old_logprobs`` and the sampler's as ``sampler_logprobs``.
    ``forward(params, batch) -> [B, Y]``: the without-rubric log-probs (one forward, no gradient)."""
    out = []
    for start in range(0, len(samples), config.minibatch_rows):
        chunk = samples[start : start + config.minibatch_rows]
        batch = minibatch([dataclasses.replace(s, insert=()) for s in chunk], config)
        logp = np.asarray(forward(params, batch))[batch.sample_slots()]
        out += [
            dataclasses.replace(s, old_logprobs=logp[i, : len(s.response)].tolist(), sampler_logprobs=s.old_logprobs)
            for i, s in enumerate(chunk)
        ]
    return out


def run_update(run: Run, update: int) -> tuple[dict[str, float], tuple]:
    """One update of ``run.state``; returns its metrics and what ``_save_step`` records."""
    c, started = run.config, time.perf_counter()
    tasks = tasks_for_update(run.suite.train, c.n_tasks, c.seed, update)
    seed = c.seed * 1_000_003 + update
    groups, stats = collect_groups(
        run.sampler,
        run.pool,
        tasks,
        c.group_size,
        c.rollout,
        seed,
        tokenizer=run.tokenizer,
        fmt=run.fmt,
        build_prompt=run.suite.build_prompt,
    )
    metrics = rollout_metrics(groups, stats)
    # The reward less the invalid-answer penalties: what GRPO's advantages normalise.
    metrics["env/return"] = float(np.mean(np.concatenate([returns(g, c.advantage) for g in groups])))
    rubrics = None
    if c.uses_rubrics:
        t0 = time.perf_counter()
        if c.rubric.source == "policy":
            bundles = generate_bundles(run.sampler, groups, c.rubric, seed, tokenizer=run.tokenizer, fmt=run.fmt)
        else:
            bundles = rubric_sources.candidates(c.rubric.source, [g.task for g in groups], **run.rubric_source)
        metrics["time/rubric_writing"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rng = np.random.default_rng([c.seed, update])
        before = dataclasses.replace(run.verifier.stats)
        targets = [rank_targets(g, c.rubric.rank_by, c.advantage) for g in groups]
        aligned = c.selection_mode == "gap-alignment"  # verified as spearman (logged), then chosen by the replay
        mode = "spearman" if aligned else c.selection_mode
        rubrics = [
            verify_and_select(run.verifier, g, b, mode, rng, r, c.rubric.min_correlation)
            for g, b, r in progress(list(zip(groups, bundles, targets)), "verify")
        ]
        metrics["time/verification"] = time.perf_counter() - t0
        if aligned:
            t0, policy = time.perf_counter(), run.policy()
            for i, (g, r) in enumerate(zip(groups, rubrics)):
                gaps = trajectory_gaps(policy, g, r.bundles, run.fmt, run.tokenizer, temperature=c.loss.temperature)
                rubrics[i] = dataclasses.replace(r, selection=select_by_gap(gaps, np.asarray(targets[i], float)))
            metrics["time/selection_replay"] = time.perf_counter() - t0
        metrics |= rubric_metrics(rubrics)
        metrics["rubric/update_without_rubric"] = float(not metrics["rubric/groups_with_rubric"])
        if not metrics["rubric/groups_with_rubric"]:
            reasons = ", ".join(
                f"{k.removeprefix('rubric/no_rubric/')} {v:.0f}"
                for k, v in metrics.items()
                if k.startswith("rubric/no_rubric/")
            )
            message = f"update {update + 1}: no group got a rubric ({reasons}); this update trains as plain GRPO"
            if c.strict:
                raise RuntimeError(message + " (--strict)")
            log.warning(message)
        after = run.verifier.stats
        for field in dataclasses.fields(after):
            metrics[f"verifier/{field.name}"] = float(getattr(after, field.name) - getattr(before, field.name))
    samples, index = step_samples(
        groups, step_advantages(groups, c.method, c.advantage), rubrics, run.fmt, run.tokenizer
    )
    rng = np.random.default_rng([c.seed, update, 1])
    orders = [rng.permutation(len(samples)) for _ in range(c.ppo_epochs)]
    t0 = time.perf_counter()
    if c.old_logprobs == "trainer":
        samples = with_trainer_logprobs(run.old_logprobs, run.state.params, samples, c)
    record = c.credit_every and (update + 1) % c.credit_every == 0 or update + 1 == c.updates
    run.state, loss_metrics, counts, recorded = train_minibatches(
        run.train_step, run.state, samples, orders, c, record, run.reference
    )
    without_rubric = ("gap", "rubric_token_frac")  # meaningless without a rubric stage
    metrics |= {f"loss/{k}": v for k, v in loss_metrics.items() if c.uses_rubrics or not k.startswith(without_rubric)}
    metrics["train/tokens"] = counts["tokens"]
    metrics["train/row_tokens"] = float(counts["row_tokens"])
    metrics["train/row_fill"] = counts["row_tokens"] / counts["row_slots"]
    metrics["train/step_samples"] = float(len(samples))
    metrics["time/train"] = time.perf_counter() - t0
    metrics["train/tokens_per_s"] = counts["tokens"] / metrics["time/train"]
    metrics["train/row_tokens_per_s"] = counts["row_tokens"] / metrics["time/train"]
    t0 = time.perf_counter()
    run.sampler.push_weights(run.policy(), update + 1)
    metrics["time/weight_push"] = time.perf_counter() - t0
    metrics["time/update"] = time.perf_counter() - started
    return metrics, (groups, rubrics, index, recorded)


def update_line(update: int, updates: int, metrics: dict[str, float]) -> str:
    """One console line per update: outcomes, the rubric stage when there is one, the loss, the time."""
    parts = [
        f"update {update}/{updates}: success {metrics['env/success']:.0%}",
        f"invalid answers {metrics['env/invalid_rate']:.0%}",
        f"mixed groups {metrics['env/mixed_groups']:.0%}",
    ]
    if "rubric/groups_with_rubric" in metrics:
        parts.append(f"groups with a rubric {metrics['rubric/groups_with_rubric']:.0f}")
    parts += [f"loss {metrics['loss/loss']:+.4f}", f"{metrics['time/update']:.0f} s"]
    return ", ".join(parts)


def evaluate(run: Run, update: int) -> dict[str, float]:
    """A deterministic sweep over the first ``eval_games`` tasks of each evaluation split, written
    to ``eval/<update>/<split>/``; metrics ``eval/<split>/<name>``."""
    c = run.config
    rollout = dataclasses.replace(c.rollout, temperature=c.eval_temperature)
    metrics = {}
    for split, tasks in run.suite.eval.items():
        episodes = evaluation.sweep(
            run.sampler,
            run.pool,
            tasks[: c.eval_games],
            rollout,
            seed=c.seed + 7,
            tokenizer=run.tokenizer,
            fmt=run.fmt,
            build_prompt=run.suite.build_prompt,
        )
        title = f"{c.method} after {update} updates, {split}"
        evaluation.write(run.suite.name, episodes, run.out / "eval" / f"{update:05d}" / split, title)
        metrics |= {f"eval/{split}/{k}": v for k, v in evaluation.summary(run.suite.name, episodes).items()}
    return metrics


def train(
    config: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False, stop_after: int | None = None
) -> pathlib.Path:
    """Runs (or resumes) a training run in ``out_dir``; returns the exported policy directory.

    ``stop_after`` ends the process's work after that many updates (the run can be resumed).
    """
    out = pathlib.Path(out_dir)
    saved = out / "config.json"
    if resume:
        if not saved.is_file():
            raise FileNotFoundError(f"nothing to resume in {out}: no config.json")
        from orsd_jax.config import from_json

        config = from_json(saved.read_text())
    elif (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        raise FileExistsError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    run = Run(config, out)
    c = run.config
    if not resume:  # written once, atomically: a resumed run keeps the record it started with
        partial = saved.with_suffix(".json.tmp")
        partial.write_text(to_json(config))
        os.replace(partial, saved)
    start = 0
    if resume:
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), run.state, run.sharding
        )
        restored = run.checkpoints.restore_latest(abstract)
        if restored is not None:
            start, run.state, _ = restored
            log.info("resumed from checkpoint %d", start)
    metrics_log = MetricsLog(out, truncate_after=start)
    try:
        run.start_services()
        if start:
            run.sampler.push_weights(run.policy(), start)
        for update in progress(range(start, c.updates), "updates", initial=start, total=c.updates):
            if stop_after is not None and update >= stop_after:
                return out / "policy"
            metrics, artefacts = run_update(run, update)
            if artefacts[3]:
                _save_step(out, update + 1, c.advantage, *artefacts)
            if c.eval_every and (update + 1) % c.eval_every == 0 and update + 1 < c.updates:
                metrics |= evaluate(run, update + 1)
            metrics_log.write(update + 1, metrics)
            log.info(update_line(update + 1, c.updates, metrics))
            if (update + 1) % c.checkpoint_every == 0 or update + 1 == c.updates:
                meta = {
                    "update": update + 1,
                    "seed": c.seed,
                    "data_cursor": (update + 1) * c.n_tasks,
                    "verifier_cache": str(out / "verifier_cache"),
                    "config": json.loads(to_json(config)),
                }
                run.checkpoints.save(update + 1, run.state, meta)
        final = evaluate(run, c.updates)
        metrics_log.write(c.updates, final, final=True)
        save_hf(run.policy(), run.tokenizer, out / "policy")
        return out / "policy"
    finally:
        metrics_log.close()
        run.close()
