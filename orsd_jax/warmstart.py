"""Supervised warm start on expert demonstrations, with the project's own train step.

The loss is the masked token cross-entropy of the answer given the exact RL prompt: a
demonstration is a ``StepSample`` without a rubric, and only its response tokens count. The
same packed batch, jit-compiled sharded step and optimizer as RL are used; the result is a
Hugging Face directory that the RL presets start from.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import pathlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax import chat
from orsd_jax.batch import Batch, BatchShape, StepSample, attention_mask, build_batch
from orsd_jax.demos import Demonstration, alfworld_walkthrough, walkthrough_demos, write_jsonl
from orsd_jax.envs.base import Task, TextEnv
from orsd_jax.loss import response_logprobs
from orsd_jax.metrics_log import console_logging
from orsd_jax.models import CausalLM, cache_dir, load_model, save_hf
from orsd_jax.rollout import PromptBuilder, RolloutConfig
from orsd_jax.rubrics import rubric_insert
from orsd_jax.rubrics.oracle import alfworld_oracle
from orsd_jax.train_step import OptimizerConfig, init_train_state, make_mesh, make_optimizer, make_train_step


@dataclasses.dataclass(frozen=True)
class SupervisedLoss:
    """``-sum log p(answer | prompt)`` over answer tokens, and their count (the token mean is exact
    under micro-batching and data parallelism)."""

    chunk_size: int = 64

    def __call__(self, model: CausalLM, batch: Batch):
        _, logp, _ = response_logprobs(model, batch, chunk_size=self.chunk_size, with_rubric=False)
        mask = batch.response_mask
        correct = jnp.sum((logp > jnp.log(0.5)) * mask)  # tokens the model already puts most mass on
        return -jnp.sum(logp * mask), jnp.sum(mask), {"likely_tokens": correct}, {}

    @staticmethod
    def metrics(sums, token_count):
        return {"likely_token_frac": sums["likely_tokens"] / jnp.maximum(token_count, 1)}


ROW_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """The warm start's supervised fine-tuning (``WarmStartRun`` is the whole warm start)."""

    epochs: int = 2
    batch_size: int = 16  # demonstrations per update (rows of ``pack_tokens``, when packing)
    micro_batches: int = 1
    # > 0: every update is ``batch_size`` rows of this many tokens, filled with the shuffled
    # demonstrations (several a row): one compiled shape for the whole warm start. 0: a row per
    # demonstration, padded to the batch's longest, each new length compiled again.
    pack_tokens: int = 0
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4, weight_decay=0.0)
    seed: int = 0


def demo_sample(demo: Demonstration, fmt: chat.ChatFormat) -> StepSample:
    """A demonstration as a step sample: the prompt without its chat tail, the answer as response."""
    tail = len(fmt.tail)
    if tuple(demo.prompt_ids[-tail:]) != fmt.tail:
        raise ValueError(f"demonstration {demo.game} step {demo.step} was not built with this chat format")
    return StepSample(
        prefix=demo.prompt_ids[:-tail],
        tail=fmt.tail,
        response=demo.answer_ids,
        old_logprobs=(0.0,) * len(demo.answer_ids),
        advantage=0.0,
    )


def with_rubric(demo: Demonstration, insert: str, *, tokenizer, fmt: chat.ChatFormat) -> Demonstration:
    """``demo`` with ``insert`` (a rubric's text) between its user message and the chat tail: the
    tokens ORSD's with-rubric replay reads (``samples.step_samples``)."""
    tail = len(fmt.tail)
    ids = demo.prompt_ids[:-tail] + tuple(chat.encode(tokenizer, insert)) + demo.prompt_ids[-tail:]
    return dataclasses.replace(demo, user_text=demo.user_text + insert, prompt_ids=ids)


def finetune(
    model: CausalLM,
    demos: Sequence[Demonstration],
    config: FinetuneConfig,
    *,
    fmt: chat.ChatFormat,
    log: Callable[[int, dict[str, float]], None] = lambda step, metrics: None,
) -> CausalLM:
    """The model after ``config.epochs`` passes over ``demos`` in shuffled mini-batches. With frozen
    layers their output is computed once, before the first epoch, and every update runs the
    trainable layers only."""
    samples = [demo_sample(d, fmt) for d in demos]
    mesh = make_mesh()
    optimizer = make_optimizer(config.optimizer, frozen_layers=model.config.frozen_layers)
    graphdef, state, sharding = init_train_state(model, optimizer, mesh)
    step = make_train_step(SupervisedLoss(), optimizer, graphdef, sharding)
    plan = finetune_plan(samples, config, devices=mesh.size, frozen=model.config.frozen_layers > 0)
    frozen = frozen_states(graphdef, state.params, plan.frozen_pass, len(samples)) if plan.frozen_pass else None
    updates = 0
    for epoch, batches in enumerate(plan.epochs):
        for indices, batch in batches:
            started = time.perf_counter()
            if frozen is not None:
                batch = dataclasses.replace(batch, frozen=place_states(batch, [frozen[i] for i in indices]))
            state, metrics, _ = step(state, batch, config.micro_batches)
            values = {k: float(v) for k, v in jax.device_get(metrics).items() if not k.startswith("sum/")}
            updates += 1
            log(updates, values | {"epoch": epoch, "seconds": time.perf_counter() - started})
    return nnx.merge(graphdef, state.params)


IndexedBatch = tuple[list[int], Batch]  # the input samples a batch holds, in its input order


@dataclasses.dataclass(frozen=True)
class FinetunePlan:
    """The batches of a fine-tune: the frozen layers' pass (empty without frozen layers) and every
    epoch's updates."""

    frozen_pass: list[IndexedBatch]
    epochs: list[list[IndexedBatch]]


def row_multiple(config: FinetuneConfig, devices: int) -> int:
    """What a fine-tune's batches pad their row count to: a multiple of 8 (and of the devices x
    micro-batches), so a short last batch of a kind costs its own rows, for at most a few more
    compiled shapes per prompt-length bucket."""
    return math.lcm(devices * config.micro_batches, ROW_MULTIPLE)


def finetune_plan(samples: Sequence[StepSample], config: FinetuneConfig, *, devices: int, frozen: bool) -> FinetunePlan:
    """The batches ``finetune`` runs, from the samples' lengths and ``config`` alone (shuffled with
    ``config.seed``), for ``devices`` data-parallel devices; ``benchmarks/warmstart.py`` counts
    their FLOPs."""
    rng = random.Random(config.seed)
    orders = [shuffled_batches(len(samples), len(samples), rng)[0] for _ in range(config.epochs)]
    multiple = row_multiple(config, devices)
    lengths = [len(s.prefix) + len(s.tail) + len(s.response) for s in samples]
    if config.pack_tokens:
        if config.batch_size % (devices * config.micro_batches):
            raise ValueError(f"batch_size {config.batch_size} rows do not split over {devices} devices x micro-batches")
        plans = [packed_steps(lengths, order, config.batch_size, config.pack_tokens) for order in orders]
        rows = [row for plan in plans for step in plan for row in step]
        shape = BatchShape(
            rows=config.batch_size,
            tokens=config.pack_tokens,
            stream=0,
            stream_rows=0,
            slots=max(len(row) for row in rows),
            response=max(len(s.response) for s in samples),
            head=max(sum(len(samples[i].response) for i in row) for row in rows),
        )
        make = functools.partial(packed_batch, samples, shape=shape)
        epochs = [[make(rows) for rows in plan] for plan in plans]
    else:
        by_size = [
            order[s : s + config.batch_size] for order in orders for s in range(0, len(order), config.batch_size)
        ]
        steps = [(indices, build_batch([samples[i] for i in indices], batch_multiple=multiple)) for indices in by_size]
        per_epoch = -(-len(samples) // config.batch_size)
        epochs = [steps[e * per_epoch : (e + 1) * per_epoch] for e in range(config.epochs)]
    if not frozen:
        return FinetunePlan([], epochs)
    # A row per sample, by length, so that few are padded far, even when the updates pack
    # several a row: attention over a whole packed row costs the square of its length, and the
    # frozen layers' pass over WebShop's packed rows took 17 minutes against 5 this way
    # (docs/results/warmstart.md). A segment's states do not depend on the row it shares.
    by_length = sorted(range(len(samples)), key=lengths.__getitem__)  # the tail is the same for all
    chunks = [by_length[s : s + config.batch_size] for s in range(0, len(samples), config.batch_size)]
    once = [(c, build_batch([samples[i] for i in c], batch_multiple=multiple)) for c in chunks]
    return FinetunePlan(once, epochs)


def packed_steps(lengths: Sequence[int], order: Sequence[int], rows: int, tokens: int) -> list[list[list[int]]]:
    """The samples of ``order`` as updates of at most ``rows`` rows of ``tokens`` tokens: each sample
    goes into the first row of the current update with room for its ``lengths[i]`` tokens, or a new
    row; when the update has ``rows`` rows and none has room, the next update begins."""
    too_long = [i for i in order if lengths[i] > tokens]
    if too_long:
        raise ValueError(f"{len(too_long)} samples are longer than the {tokens} tokens of a packed row")
    steps: list[list[list[int]]] = [[]]
    free: list[int] = []
    for i in order:
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None and len(free) == rows:
            steps.append([])
            free = []
        if row is None:
            steps[-1].append([])
            free.append(tokens)
            row = len(free) - 1
        steps[-1][row].append(i)
        free[row] -= lengths[i]
    return steps


def packed_batch(samples: Sequence[StepSample], step: Sequence[Sequence[int]], **options) -> IndexedBatch:
    """The samples of ``step``'s rows (indices into ``samples``) as one batch of those rows
    (``build_batch(pack=True, rows=...)`` with ``options``: an update of ``packed_steps`` in the
    ``shape`` every update has, or prompt trees with ``share_prefix``)."""
    indices = [i for row in step for i in row]
    at = {i: n for n, i in enumerate(indices)}
    batch = build_batch(
        [samples[i] for i in indices], pack=True, rows=[[at[i] for i in row] for row in step], **options
    )
    return indices, batch


def shuffled_batches(n: int, batch_size: int, rng: random.Random) -> list[list[int]]:
    """``range(n)`` shuffled, in batches of ``batch_size`` (the last may be short). Not sorted by
    length: that would batch the first steps of every episode together, the late steps together."""
    order = list(range(n))
    rng.shuffle(order)
    return [order[s : s + batch_size] for s in range(0, n, batch_size)]


def frozen_states(graphdef, params, batches: Sequence[IndexedBatch], n: int) -> list[np.ndarray]:
    """Each of the ``n`` samples' ``CausalLM.frozen_states``, ``float[T_i, D]`` (``T_i``: its tokens),
    from ``batches`` that hold every sample once (an epoch's: ``(sample indices, batch)`` pairs).

    Frozen weights give the same states in every epoch, and a segment's states do not depend on
    the row it shares: computing them once leaves each update the trainable layers only (memory:
    one ``D``-vector per demonstration token).
    """

    @jax.jit
    def run(params, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, params)
        return model.frozen_states(batch.tokens, batch.positions, mask=attention_mask(batch.reach))

    out: list[np.ndarray] = [np.empty(0)] * n
    for indices, batch in batches:
        states = np.asarray(run(params, batch))
        for (row, where), i in zip(_columns(batch), indices):
            out[i] = states[row, where]
    return out


def _columns(batch: Batch) -> list[tuple[int, np.ndarray]]:
    """Per input sample of ``batch``, in input order: its row and the columns of its tokens there,
    in order: the ancestors of its last response token in the row's tree, itself included (any
    layout; a sample's branch after its prefix is contiguous)."""
    reach, index = np.asarray(batch.reach), np.asarray(batch.without_index)
    lengths = np.asarray(batch.response_mask).sum(axis=1).astype(int)
    k, columns = len(index) // len(reach), np.arange(reach.shape[1])
    out = []
    for j in batch.sample_slots():
        row, last = int(j // k), index[j, lengths[j] - 1] + 1  # the column after the one predicting it
        out.append((row, np.flatnonzero((columns <= last) & (last <= reach[row]))))
    return out


def place_states(batch: Batch, states: Sequence[np.ndarray]) -> np.ndarray:
    """``[R, T, D]`` of ``batch`` from its input samples' ``[T_i, D]`` states, zeros elsewhere
    (padding: masked out of every loss)."""
    out = np.zeros((*batch.tokens.shape, states[0].shape[-1]), states[0].dtype)
    for (row, where), values in zip(_columns(batch), states):
        out[row, where] = values
    return out


# Part of the cache key: bump it when the same settings would give other demonstrations or batches.
# 3: the first games of a split are of every type (load_split interleaves them); 4: no rubric
# demonstrations, so batches are one shuffle of all demonstrations.
DEMO_VERSION = 4


@dataclasses.dataclass(frozen=True)
class WarmStartRun:
    """Everything that decides a warm start's output (its hash names the cache entry)."""

    model: str = "smollm2-135m-instruct"
    difficulty: str = "easy"
    games_seed: int = 0
    train_games: int = 200  # generated train split size (demonstrations use the first ``demo_games``)
    eval_games: int = 50  # generated valid_seen / valid_unseen sizes
    task_types: tuple[str, ...] = ()  # ALFWorld task types demonstrated (empty: all)
    demo_games: int = 120
    max_detours: int = 2
    reasoning: bool = False
    frozen_layers: int = 0
    rollout: RolloutConfig = RolloutConfig()
    train: FinetuneConfig = FinetuneConfig()
    # The first N demonstrated games are demonstrated once more with their oracle rubric in the
    # prompt, where ORSD inserts a selected rubric, and without detours (the rubric's plan is
    # followed): a policy that has seen a rubric can learn to read one (docs/results/probe.md).
    rubric_games: int = 0
    env: str = "alfworld"  # or "webshop": the oracle's purchases of train goals (``task_types``: categories)
    data_dir: str | None = None  # WebShop's files (default: $WEBSHOP_DATA)
    goals: str = "all"  # WebShop's goal set (envs.webshop.world.GOAL_SETS)
    search: str = "title"  # what WebShop's oracle searches (envs.webshop.oracle.SEARCHES): "instruction" is copyable

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        for name, default in _LATER_FIELDS.items():  # warm starts cached before they existed keep their key
            *parents, leaf = name.split(".")
            where = functools.reduce(lambda d, k: d[k], parents, fields)
            if where[leaf] == default:
                del where[leaf]
        text = json.dumps({"version": DEMO_VERSION, **fields}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# Fields added after DEMO_VERSION 4, with their defaults: they enter the cache key only when set.
_LATER_FIELDS = {
    "rubric_games": 0,
    "env": "alfworld",
    "data_dir": None,
    "goals": "all",
    "search": "title",
    "train.pack_tokens": 0,
}


@dataclasses.dataclass(frozen=True)
class DemoSource:
    """Where demonstrations come from: the tasks, an env to replay them in, the expert's commands
    per task, the RL prompt builder and each task's oracle rubric."""

    tasks: Sequence[Task]
    env: TextEnv
    walkthrough: Callable[[Task], Sequence[str]]
    build_prompt: PromptBuilder
    oracle: Callable[[Task], tuple[str, ...]]


def demo_source(run: WarmStartRun) -> DemoSource:
    if run.env == "alfworld":
        from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split

        root = default_games(run.difficulty, run.games_seed, run.train_games, run.eval_games)
        tasks = load_split(root, "train", run.task_types)[: run.demo_games]
        env = AlfworldEnv(max_steps=run.rollout.max_steps)
        return DemoSource(tasks, env, alfworld_walkthrough, build_prompt, alfworld_oracle)
    from orsd_jax.envs import webshop
    from orsd_jax.rubrics.sources import oracle_for

    goals = webshop.load_goals(run.data_dir, "train", categories=run.task_types, goals=run.goals)
    shop = webshop.WebShopEnv(run.data_dir, max_steps=run.rollout.max_steps)
    # The goals the oracle wins (about 95%): a lost purchase is not a demonstration. Each goal is
    # played once; its commands are the walkthrough the recorder replays.
    episodes = ((t, *webshop.oracle_episode(shop, t, run.search)) for t in goals)
    won = list(itertools.islice(((t, commands) for t, commands, last in episodes if last.won), run.demo_games))
    commands = {t.key: c for t, c in won}
    return DemoSource(
        [t for t, _ in won],
        shop,
        lambda task: commands[task.key],
        webshop.build_prompt,
        oracle_for("webshop", run.data_dir),
    )


def demonstrations(run: WarmStartRun, tokenizer, fmt: chat.ChatFormat) -> list[Demonstration]:
    """``run``'s demonstrations, recorded on exactly the RL prompts: every demonstrated game, then
    the first ``run.rubric_games`` again with their oracle rubric."""
    source = demo_source(run)
    tasks, env = source.tasks, source.env
    record = functools.partial(
        walkthrough_demos,
        env,
        walkthrough=source.walkthrough,
        config=run.rollout,
        build_prompt=source.build_prompt,
        tokenizer=tokenizer,
        fmt=fmt,
        reasoning=run.reasoning,
    )
    demos = record(tasks, max_detours=run.max_detours, seed=run.games_seed)
    if run.rubric_games:
        inserts = {t.key: rubric_insert(source.oracle(t)) for t in tasks[: run.rubric_games]}
        demos += [
            with_rubric(d, inserts[d.game], tokenizer=tokenizer, fmt=fmt) for d in record(tasks[: run.rubric_games])
        ]
    env.close()
    return demos


def run_warmstart(run: WarmStartRun, out_dir: str | os.PathLike, log: Callable[[str], None] = print) -> pathlib.Path:
    """Demonstrations, fine-tuning and export: ``out_dir/policy`` (a Hugging Face directory),
    ``out_dir/demos.jsonl`` and ``out_dir/warmstart.json`` (settings, timings, loss curve)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, tokenizer = load_model(run.model, frozen_layers=run.frozen_layers)
    fmt = chat.chat_format(tokenizer)
    demos = demonstrations(run, tokenizer, fmt)
    write_jsonl(demos, out / "demos.jsonl")
    demo_seconds = time.perf_counter() - started
    log(
        f"{len(demos)} demonstrations from {len({d.game for d in demos})} games ({demo_seconds:.0f} s) -> {out / 'demos.jsonl'}"
    )
    curve: list[dict[str, float]] = []

    def log_step(step: int, metrics: dict[str, float]) -> None:
        curve.append({"update": step, **metrics})
        log(
            f"warm start, optimizer step {step}: loss {metrics['loss']:.3f}, likely tokens {metrics['likely_token_frac']:.2f}, {metrics['seconds']:.1f} s"
        )

    trained = finetune(model, demos, run.train, fmt=fmt, log=log_step)
    train_seconds = time.perf_counter() - started - demo_seconds
    save_hf(trained, tokenizer, out / "policy")
    summary = {
        "run": dataclasses.asdict(run),
        "demonstrations": len(demos),
        "demo_seconds": demo_seconds,
        "train_seconds": train_seconds,
        "tokens_trained": sum(len(d.prompt_ids) + len(d.answer_ids) for d in demos) * run.train.epochs,
        "curve": curve,
    }
    (out / "warmstart.json").write_text(json.dumps(summary, indent=2, default=str))
    log(f"fine-tuned in {train_seconds:.0f} s -> {out / 'policy'}")
    return out / "policy"


def cached_warmstart(run: WarmStartRun, log: Callable[[str], None] = print) -> pathlib.Path:
    """``run``'s policy directory, computed once into the cache (``$ORSD_JAX_CACHE/warmstart/<hash>``).

    The computation runs in a child process, so its train state, cached states and compiled steps
    are gone before the caller starts its own model and servers: in one process the cpu-demo
    trainer held 10 GB in its first RL update and, beside two vLLM servers, ran a 24 GiB machine
    out of memory.
    """
    key = run.key()
    target = cache_dir() / "warmstart" / key
    if (target / "policy" / "config.json").is_file():
        return target / "policy"
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}.", dir=target.parent))
    try:
        log(f"warm start {key}: computed once, in a child process, then cached")
        child = multiprocessing.get_context("spawn").Process(target=_logged_warmstart, args=(run, scratch))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"the warm start failed (exit code {child.exitcode}); its log is above")
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)  # atomic: a crash leaves no half entry
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target / "policy"


def _logged_warmstart(run: WarmStartRun, out_dir: pathlib.Path) -> None:
    console_logging()
    run_warmstart(run, out_dir, logging.getLogger(__name__).info)
