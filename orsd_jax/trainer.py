"""The training loop: it composes the stages and does the I/O.

One update: collect ``n_tasks x G`` episodes (``rollout``) -> (ORSD) write K rubric bundles per
group, verify them, select one (``rubrics``) -> GRPO/GiGPO advantages per step sample
(``advantages``, ``samples``) -> optimizer steps over minibatches (``minibatches``) -> push the new
weights to the sampler. Checkpoints, logs and evaluations happen between updates.

Run directory: ``config.json``, ``metrics.jsonl`` and ``tb/`` (the same scalars), ``checkpoints/``
(Orbax), ``steps/<update>/`` (groups, rubrics and per-token credit of recorded updates,
``credit.save_credit``), ``eval/<update>/`` (tables), ``policy/`` (the final policy as a Hugging
Face directory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import typing
from collections.abc import Sequence

import jax
import numpy as np

from orsd_jax import distributed, evaluation, seeds
from orsd_jax.advantages import rank_targets, returns, step_advantages
from orsd_jax.batch import StepSample, prompt_key, samples_from_json, samples_to_json
from orsd_jax.checkpoints import refused_writes
from orsd_jax.config import TrainConfig, from_json, to_json
from orsd_jax.credit import RecordedMinibatch, save_credit
from orsd_jax.metrics_log import MetricsLog, progress, timed
from orsd_jax.minibatches import train_minibatches, update_steps, with_trainer_logprobs
from orsd_jax.models import CausalLM, save_hf
from orsd_jax.rollout import Group, collect_groups, rollout_metrics, tasks_for_update
from orsd_jax.rubrics import GroupRubric, ParsedBundle, generate_bundles, rubric_metrics, verify_and_select
from orsd_jax.rubrics import memory as rubric_memory
from orsd_jax.rubrics import sources as rubric_sources
from orsd_jax.rubrics.alignment import select_by_gap, trajectory_gaps
from orsd_jax.rubrics.memory import RubricMemory
from orsd_jax.samples import StepKey, step_samples
from orsd_jax.services import Services
from orsd_jax.train_step import TrainState

if typing.TYPE_CHECKING:
    from orsd_jax import chat
    from orsd_jax.rubrics import Verifier
    from orsd_jax.sampling.base import Sampler

log = logging.getLogger("orsd_jax")


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """One update's metrics and what its credit record keeps (``recorded``: empty when the update
    is not recorded)."""

    metrics: dict[str, float]
    groups: tuple[Group, ...]
    returns: tuple[np.ndarray, ...]  # [G] per group: the reward less the invalid-answer penalties
    rubrics: tuple[GroupRubric, ...] | None
    index: tuple[StepKey, ...]
    recorded: tuple[RecordedMinibatch, ...]
    samples: tuple[StepSample, ...]  # the step samples trained on
    memory: RubricMemory  # the rubric memory after the update (unchanged when it is off)


class RubricServices(typing.Protocol):
    """What the rubric stage reads of a run's services (``Services``; the credit probe builds its own)."""

    config: TrainConfig  # resolved
    sampler: Sampler | None  # the writer, with the policy as the rubric source
    verifier: Verifier | None
    tokenizer: typing.Any
    fmt: chat.ChatFormat
    rubric_source: dict  # what a non-policy source reads (``rubric_sources.candidates``)


def rubric_stage(
    services: RubricServices,
    policy: CausalLM | None,
    groups: Sequence[Group],
    update: int,
    metrics: dict[str, float],
    memory: RubricMemory,
) -> tuple[list[GroupRubric], RubricMemory]:
    """K candidate bundles per group, verified and one selected, and the rubric memory after them;
    the stage's metrics go to ``metrics``. ``policy``: the rollouts' policy, which gap alignment
    replays (None otherwise)."""
    c, verifier = services.config, services.verifier
    assert verifier is not None  # started by Services.start
    bundles: Sequence[Sequence[ParsedBundle]]
    with timed(metrics, "rubric_writing"):
        if c.rubric.source == "policy":
            assert services.sampler is not None
            seed = seeds.derive(c.seed, seeds.RUBRICS, update)
            tokenizer, fmt, m = services.tokenizer, services.fmt, c.rubric.memory_examples
            examples = [memory.examples(g.task.task_type, m) for g in groups] if m else None
            bundles = generate_bundles(
                services.sampler, groups, c.rubric, seed, tokenizer=tokenizer, fmt=fmt, examples=examples
            )
        else:
            bundles = rubric_sources.candidates(c.rubric.source, [g.task for g in groups], **services.rubric_source)
    offered: list[int | None] = [None] * len(groups)
    if c.rubric.memory_candidate:
        bundles, offered = rubric_memory.offer(memory, groups, bundles)
    before = dataclasses.replace(verifier.stats)
    targets = [rank_targets(g, c.rubric.rank_by, c.advantage) for g in groups]
    aligned = c.rubric.selection == "gap-alignment"  # verified as spearman (logged), then chosen by the replay
    mode, rng = "spearman" if aligned else c.rubric.selection, seeds.rng(c.seed, seeds.SELECTION, update)
    with timed(metrics, "verification"):
        rubrics = [
            verify_and_select(verifier, g, b, mode, rng, r, c.rubric.min_correlation)
            for g, b, r in progress(list(zip(groups, bundles, targets)), "verify")
        ]
    verified = list(rubrics)
    if aligned:
        assert policy is not None
        with timed(metrics, "selection_replay"):
            temperature = c.loss.temperature
            for i, (g, r) in enumerate(zip(groups, rubrics)):
                gaps = trajectory_gaps(policy, g, r.bundles, services.fmt, services.tokenizer, temperature=temperature)
                rubrics[i] = dataclasses.replace(r, selection=select_by_gap(gaps, np.asarray(targets[i], float)))
    metrics |= rubric_metrics(rubrics)
    if c.rubric.uses_memory:
        remembered = rubric_memory.remember_selected(memory, groups, verified, rubrics, update + 1)
        metrics |= rubric_memory.memory_metrics(memory, remembered, groups, rubrics, offered, update + 1)
        memory = remembered
    metrics["rubric/update_without_rubric"] = float(not metrics["rubric/groups_with_rubric"])
    for field in dataclasses.fields(verifier.stats):
        change = getattr(verifier.stats, field.name) - getattr(before, field.name)
        metrics[f"verifier/{field.name}"] = float(change)
    return rubrics, memory


def warn_plain_grpo(metrics: dict[str, float], update: int, strict: bool) -> None:
    """An ORSD update that trains without any rubric: a warning with the stage's reasons (metrics
    ``rubric/no_rubric/*``), or with ``strict`` an error. The training loop's, not the stage's: the
    credit probe runs the stage without training."""
    reasons = ", ".join(
        f"{k.removeprefix('rubric/no_rubric/')} {v:.0f}"
        for k, v in metrics.items()
        if k.startswith("rubric/no_rubric/")
    )
    message = f"update {update + 1}: no group got a rubric ({reasons}); this update trains as plain GRPO"
    if strict:
        raise RuntimeError(message + " (--strict)")
    log.warning(message)


@dataclasses.dataclass(frozen=True)
class Played:
    """An update's episodes and their step samples, ready to train on (process 0's work; the
    other processes of a run hold only the samples)."""

    groups: tuple[Group, ...]
    returns: tuple[np.ndarray, ...]  # [G] per group: the reward less the invalid-answer penalties
    rubrics: tuple[GroupRubric, ...] | None
    samples: tuple[StepSample, ...]
    index: tuple[StepKey, ...]
    memory: RubricMemory


def play(
    services: Services, policy: CausalLM | None, update: int, memory: RubricMemory, metrics: dict[str, float]
) -> Played:
    """The update's rollouts, (ORSD) its rubric stage, and advantages per step sample; the stages'
    metrics go to ``metrics``. ``policy``: the rollouts' policy when the rubric stage replays it."""
    c = services.config
    assert services.sampler is not None and services.pool is not None  # started by Services.start
    tasks = tasks_for_update(services.suite.train, c.n_tasks, c.seed, update)
    groups, stats = collect_groups(
        services.sampler,
        services.pool,
        tasks,
        c.group_size,
        c.rollout,
        seeds.derive(c.seed, seeds.ROLLOUT, update),
        tokenizer=services.tokenizer,
        fmt=services.fmt,
        build_prompt=services.suite.build_prompt,
    )
    metrics |= rollout_metrics(groups, stats)
    # The reward less the invalid-answer penalties: what GRPO's advantages normalise.
    group_returns = tuple(returns(g, c.advantage) for g in groups)
    metrics["env/return"] = float(np.mean(np.concatenate(group_returns)))
    rubrics = None
    if c.uses_rubrics:
        rubrics, memory = rubric_stage(services, policy, groups, update, metrics, memory)
        if not metrics["rubric/groups_with_rubric"]:
            warn_plain_grpo(metrics, update, strict=c.strict)
    advantages = step_advantages(groups, c.method, c.advantage)
    samples, index = step_samples(groups, advantages, rubrics, services.fmt, services.tokenizer)
    rubric_tuple = None if rubrics is None else tuple(rubrics)
    return Played(tuple(groups), group_returns, rubric_tuple, tuple(samples), tuple(index), memory)


def run_update(
    services: Services, state: TrainState, update: int, memory: RubricMemory
) -> tuple[TrainState, UpdateResult]:
    """One update from ``state`` and the rubric memory: the new state and what the update measured,
    recorded and remembered. Several processes: process 0 plays, every process trains on the
    same step samples (``distributed``); the others' result holds no episodes."""
    c = services.config
    metrics: dict[str, float] = {}
    with timed(metrics, "update"):
        policy = services.policy(state) if c.rubric.selection == "gap-alignment" else None
        played = play(services, policy, update, memory, metrics) if distributed.is_main() else None
        samples = distributed.from_main(
            f"samples/{update}", list(played.samples) if played else None, samples_to_json, samples_from_json
        )
        if played is None:
            played = Played((), (), None, tuple(samples), (), memory)
        rng = seeds.rng(c.seed, seeds.MINIBATCHES, update)
        spec = services.minibatch_spec
        steps = update_steps(samples, c.ppo_epochs, rng, c.minibatch_order, spec)
        with timed(metrics, "train"):
            if c.old_logprobs == "trainer":
                samples = with_trainer_logprobs(services.old_logprobs, state.params, samples, spec)
            record = c.credit_every and (update + 1) % c.credit_every == 0 or update + 1 == c.updates
            trained = train_minibatches(services.train_step, state, samples, steps, spec, record, services.reference)
        without_rubric = ("gap", "rubric_token_frac")  # meaningless without a rubric stage
        for k, v in trained.metrics.items():
            if c.uses_rubrics or not k.startswith(without_rubric):
                metrics[f"loss/{k}"] = v
        counts = trained.counts
        metrics["train/tokens"] = counts["tokens"]
        metrics["train/row_tokens"] = counts["row_tokens"]
        metrics["train/row_fill"] = counts["row_tokens"] / counts["row_slots"]
        metrics["train/step_samples"] = float(len(samples))
        # A row's prompts share their common beginnings (MinibatchSpec.share_prefix, prompt trees).
        metrics["train/prompts"] = float(len({prompt_key(s) for s in samples}))
        metrics["train/tokens_per_s"] = counts["tokens"] / metrics["time/train"]
        metrics["train/row_tokens_per_s"] = counts["row_tokens"] / metrics["time/train"]
        policy = services.policy(trained.state)
        if services.sampler is not None:  # process 0
            with timed(metrics, "weight_push"):
                services.sampler.push_weights(policy, update + 1)
    p = played
    result = UpdateResult(metrics, p.groups, p.returns, p.rubrics, p.index, trained.recorded, tuple(samples), p.memory)
    return trained.state, result


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


def evaluate(services: Services, update: int) -> dict[str, float]:
    """A deterministic sweep over the first ``eval_games`` tasks of each evaluation split, written
    to ``eval/<update>/<split>/``; metrics ``eval/<split>/<name>``."""
    c, suite = services.config, services.suite
    assert services.sampler is not None and services.pool is not None  # started by Services.start
    rollout = dataclasses.replace(c.rollout, temperature=c.eval_temperature)
    metrics: dict[str, float] = {}
    for split, tasks in suite.eval.items():
        episodes = evaluation.sweep(
            services.sampler,
            services.pool,
            tasks[: c.eval_games],
            rollout,
            seed=seeds.derive(c.seed, seeds.EVALUATION),
            tokenizer=services.tokenizer,
            fmt=services.fmt,
            build_prompt=suite.build_prompt,
        )
        title = f"{c.method} after {update} updates, {split}"
        evaluation.write(suite.name, episodes, services.out / "eval" / f"{update:05d}" / split, title)
        metrics |= {f"eval/{split}/{k}": v for k, v in evaluation.summary(suite.name, episodes).items()}
    return metrics


def export_policy(policy: CausalLM, tokenizer, directory: pathlib.Path) -> pathlib.Path:
    """The final policy as a Hugging Face directory (a refused write is a ``StorageError``)."""
    with refused_writes("the final policy", directory):
        return save_hf(policy, tokenizer, directory)


def train(
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    sampler_urls: Sequence[str] = (),
) -> pathlib.Path:
    """Runs (or resumes) a training run in ``out_dir``; returns the exported policy directory.

    ``stop_after`` ends the process's work after that many updates (the run can be resumed).
    ``sampler_urls``: vLLM servers of the policy to attach to instead of starting them (they are
    where the run is deployed, not what it is: not part of the config, a resumed run may name others).
    """
    out = pathlib.Path(out_dir)
    saved = out / "config.json"
    if resume:
        if not saved.is_file():
            raise FileNotFoundError(f"nothing to resume in {out}: no config.json")
        config = from_json(saved.read_text())
    elif (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        raise FileExistsError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    services = Services(config, out, sampler_urls)
    c, state, start = services.config, services.initial_state, 0
    memory = RubricMemory(size=c.rubric.memory_size)
    main = distributed.is_main()  # writes the run's files (distributed.py)
    if not resume and main:  # written once, atomically: a resumed run keeps the record it started with
        partial = saved.with_suffix(".json.tmp")
        with refused_writes(
            "the run's config", saved, "nothing is trained yet: free space there, then start the run again"
        ):
            partial.write_text(to_json(config))
        os.replace(partial, saved)
    if resume:
        shapes = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
        restored = services.checkpoints.restore_latest(jax.tree.map(shapes, state, services.sharding))
        if restored is not None:
            start, state, meta = restored
            memory = RubricMemory.from_json(meta["rubric_memory"]) if "rubric_memory" in meta else memory
            log.info("resumed from checkpoint %d", start)
    metrics_log = MetricsLog(out, truncate_after=start) if main else None
    try:
        services.start()
        if start:
            policy = services.policy(state)
            if services.sampler is not None:
                services.sampler.push_weights(policy, start)
        for update in progress(range(start, c.updates), "updates", initial=start, total=c.updates):
            if stop_after is not None and update >= stop_after:
                return out / "policy"
            state, result = run_update(services, state, update, memory)
            metrics, memory = result.metrics, result.memory
            if metrics_log is not None:
                if c.rubric.uses_memory:
                    rubric_memory.save(memory, out / "rubric_memory.json")
                if result.recorded:
                    r = result
                    with refused_writes(f"the credit record of update {update + 1}", out / "steps"):
                        save_credit(
                            out,
                            update + 1,
                            r.groups,
                            r.returns,
                            r.rubrics,
                            r.index,
                            r.recorded,
                            services.suite.make_env,
                            r.samples,
                        )
                if c.eval_every and (update + 1) % c.eval_every == 0 and update + 1 < c.updates:
                    metrics |= evaluate(services, update + 1)
                metrics_log.write(update + 1, metrics)
                log.info(update_line(update + 1, c.updates, metrics))
            if (update + 1) % c.checkpoint_every == 0 or update + 1 == c.updates:
                meta = {
                    "update": update + 1,
                    "seed": c.seed,
                    "data_cursor": (update + 1) * c.n_tasks,
                    "verifier_cache": str(out / "verifier_cache"),
                    "config": json.loads(to_json(config)),
                    **({"rubric_memory": memory.to_json()} if c.rubric.uses_memory else {}),
                }
                distributed.wait_for_main(f"checkpoint/{update + 1}")
                services.checkpoints.save(update + 1, state, meta)  # Orbax: process 0 writes the meta
        if metrics_log is not None:
            final = evaluate(services, c.updates)
            metrics_log.write(c.updates, final, final=True)
        distributed.wait_for_main("export")
        policy = services.policy(state)
        if not main:
            return out / "policy"
        return export_policy(policy, services.tokenizer, out / "policy")
    finally:
        if metrics_log is not None:
            metrics_log.close()
        services.close()
