"""Command line shared by ``train_alfworld`` and ``train_webshop``: presets, flags, dry runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import signal
import sys
import threading

from orsd_jax.batch import LAYOUTS
from orsd_jax.config import METHODS, PRESETS, TrainConfig, VerifierSetup, preset
from orsd_jax.envs.webshop.data import DATA_ENV_VAR, SMALL_FILES
from orsd_jax.metrics_log import console_logging
from orsd_jax.minibatches import ORDERS
from orsd_jax.rubrics.generate import RANK_TARGETS, SELECTIONS
from orsd_jax.rubrics.sources import SOURCES
from orsd_jax.rubrics.verify import DASHSCOPE, EndpointConfig


def task_types(text: str) -> tuple[str, ...]:
    """``--task-types pick,look`` -> ``("pick", "look")`` (names are checked where games load)."""
    return tuple(t for t in text.split(",") if t)


def parser(env: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-demo", choices=sorted(PRESETS))
    p.add_argument("--method", choices=METHODS, help="default: orsd")
    p.add_argument("--out", help="run directory (default: runs/<preset>-<env>-<method>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last good checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the plan (mesh, memory per device, budget) and exit")
    p.add_argument("--model", help="registry name or Hugging Face directory of the initial policy")
    p.add_argument("--updates", type=int)
    p.add_argument("--n-tasks", type=int)
    p.add_argument("--group-size", type=int)
    p.add_argument("--candidates", type=int, help="rubric bundles per group (K)")
    p.add_argument(
        "--min-correlation",
        type=float,
        help="keep a selected rubric only if its Spearman correlation reaches this (default: always, as the paper)",
    )
    p.add_argument(
        "--rubric-source", choices=SOURCES, help="where rubric candidates come from (default: policy, the paper's)"
    )
    p.add_argument("--rubric-file", help="with --rubric-source file: JSON mapping task keys to lists of criteria")
    p.add_argument(
        "--selection",
        choices=SELECTIONS,
        help="how a bundle is chosen (default: spearman, the paper's); "
        "gap-alignment replays every step once more with each candidate (its cost: time/selection_replay)",
    )
    p.add_argument(
        "--rank-by",
        choices=RANK_TARGETS,
        help="what selection rank-correlates a bundle with: outcome rewards (the paper's) or returns (less "
        "invalid-answer penalties; cpu-demo's)",
    )
    p.add_argument(
        "--memory-examples",
        type=int,
        help="rubric memory (beyond the paper): the rubric writer's prompt shows the M best-recorded criteria "
        "of the task's type (default 0: off)",
    )
    p.add_argument(
        "--memory-candidate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rubric memory: the remembered bundle of the task's type joins the K candidates (default: off)",
    )
    p.add_argument("--memory-size", type=int, help="rubric memory: criteria kept per task type (default 16)")
    p.add_argument("--coef", type=float, help="lambda: weight of the rubric correction")
    p.add_argument("--clip", type=float, help="c: the gap is clipped to [-c, c]")
    p.add_argument("--kl-coef", type=float, help="weight of the k3 KL to the initial policy (paper presets: 0.01)")
    p.add_argument("--lr", type=float)
    p.add_argument(
        "--normalize-std",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="divide GRPO advantages by the group's std (default: verl-agent's choice per method and environment)",
    )
    p.add_argument(
        "--warmup-steps", type=int, help="optimizer steps over which the learning rate rises linearly (default: none)"
    )
    p.add_argument("--replay", choices=LAYOUTS, help="the replay's batch layout (default: two-stream, the fastest)")
    p.add_argument(
        "--minibatch-order",
        choices=ORDERS,
        help="shuffled samples, each prompt's samples together so they share its forward, or the update packed "
        "into rows at once and the rows dealt out (one compiled shape; default: the preset's)",
    )
    p.add_argument(
        "--old-logprobs", choices=["sampler", "trainer"], help="the PPO ratio's old log-probs (paper presets: trainer)"
    )
    p.add_argument(
        "--tis-cap", type=float, help="truncated importance sampling at this cap (needs --old-logprobs trainer)"
    )
    p.add_argument("--devices", type=int, help="mesh size")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--sampler", choices=["vllm", "jax"])
    p.add_argument(
        "--sampler-servers", type=int, help="vLLM servers of the policy (groups are spread over them; default 1)"
    )
    p.add_argument(
        "--sampler-urls",
        type=lambda s: tuple(u for u in s.split(",") if u),
        default=(),
        help="attach to these vLLM servers of the policy (comma-separated http://host:port, started with "
        "python -m experiments.serve) instead of starting --sampler-servers; they must read the run directory",
    )
    p.add_argument(
        "--async-episodes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each episode asks for its next answer as soon as its own step is back (default: off, verl-agent's "
        "turn-synchronous loop; greedy decoding plays the same episodes either way)",
    )
    p.add_argument("--verifier", choices=["local-vllm", "local-jax", "dashscope", "openai"])
    p.add_argument("--verifier-url", help="base URL of an OpenAI-compatible endpoint (with --verifier openai)")
    p.add_argument("--verifier-model", help="model name at that endpoint")
    p.add_argument("--verifier-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key")
    p.add_argument("--max-response-tokens", type=int, help="tokens an answer may take (the preset's otherwise)")
    p.add_argument("--eval-games", type=int)
    p.add_argument(
        "--task-types",
        type=task_types,
        help="ALFWorld task types to play, comma-separated (pick,look,clean,heat,cool,pick2)",
    )
    p.add_argument("--train-pool", type=int, help="play only the first N train tasks (a fixed pool; default: all)")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--data-dir", help=f"WebShop data (default ${DATA_ENV_VAR}, else {SHARED_WEBSHOP} beside the checkout)"
    )
    p.add_argument(
        "--strict", action="store_true", default=None, help="stop when an ORSD update gets no rubric in any group"
    )
    p.add_argument(
        "--coordinator",
        help="several JAX processes: host:port of process 0's coordinator (default $JAX_COORDINATOR_ADDRESS)",
    )
    p.add_argument("--processes", type=int, help="several JAX processes: how many (default $JAX_NUM_PROCESSES, else 1)")
    p.add_argument("--process-id", type=int, help="several JAX processes: this one's (default $JAX_PROCESS_ID)")
    p.add_argument(
        "--detect-cluster",
        action="store_true",
        help="several JAX processes: read what is unset from SLURM or Open MPI (JAX's cluster detection)",
    )
    p.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # tests: end the process early
    return p


# Where the project keeps WebShop's files next to a checkout (the tests read them there too).
SHARED_WEBSHOP = pathlib.Path("..", "shared", "webshop")


def default_webshop_data() -> None:
    """``$WEBSHOP_DATA`` set to the shared files beside the checkout when it is unset and they are
    there: configs keep ``data_dir`` None (no path of this machine in config.json or a warm start's
    key), and the environment workers inherit it."""
    shared = pathlib.Path(__file__).resolve().parent.parent / SHARED_WEBSHOP
    if DATA_ENV_VAR not in os.environ and (shared / SMALL_FILES[0]).is_file():
        os.environ[DATA_ENV_VAR] = str(shared.resolve())


def config_from_args(env: str, args: argparse.Namespace) -> TrainConfig:
    c = preset(args.preset, env)
    set_ = lambda obj, **kw: dataclasses.replace(obj, **{k: v for k, v in kw.items() if v is not None})  # noqa: E731
    c = set_(
        c,
        method=args.method,
        updates=args.updates,
        n_tasks=args.n_tasks,
        group_size=args.group_size,
        devices=args.devices,
        fsdp=args.fsdp,
        sampler=args.sampler,
        sampler_servers=args.sampler_servers,
        eval_games=args.eval_games,
        seed=args.seed,
        strict=args.strict,
        replay=args.replay,
        minibatch_order=args.minibatch_order,
        old_logprobs=args.old_logprobs,
    )
    c = set_(
        c,
        model=set_(c.model, name=args.model),
        env=set_(c.env, data_dir=args.data_dir, task_types=args.task_types, train_pool=args.train_pool),
        rollout=set_(c.rollout, asynchronous=args.async_episodes, max_response_tokens=args.max_response_tokens),
    )
    c = set_(
        c,
        rubric=set_(
            c.rubric,
            candidates=args.candidates,
            min_correlation=args.min_correlation,
            source=args.rubric_source,
            source_file=args.rubric_file,
            selection=args.selection,
            rank_by=args.rank_by,
            memory_examples=args.memory_examples,
            memory_candidate=args.memory_candidate,
            memory_size=args.memory_size,
        ),
        loss=set_(c.loss, coef=args.coef, clip=args.clip, tis_cap=args.tis_cap, kl_coef=args.kl_coef),
        advantage=set_(c.advantage, normalize_std=args.normalize_std),
    )
    c = set_(c, optimizer=set_(c.optimizer, learning_rate=args.lr, warmup_steps=args.warmup_steps))
    if args.model:  # an explicit initial policy replaces the preset's warm start
        c = dataclasses.replace(c, model=dataclasses.replace(c.model, warmstart=None, random_shape=None))
    if args.verifier == "dashscope":
        c = dataclasses.replace(c, verifier=VerifierSetup(kind="openai", endpoint=DASHSCOPE))
    elif args.verifier == "openai":
        if not (args.verifier_url and args.verifier_model):
            raise SystemExit("--verifier openai needs --verifier-url and --verifier-model")
        endpoint = EndpointConfig(
            base_url=args.verifier_url, model=args.verifier_model, api_key_env=args.verifier_key_env
        )
        c = dataclasses.replace(c, verifier=VerifierSetup(kind="openai", endpoint=endpoint))
    elif args.verifier:
        c = dataclasses.replace(c, verifier=dataclasses.replace(c.verifier, kind=args.verifier))
    return c


def _device_memory(paper_model: bool) -> tuple[float, str]:
    """GB each device of the plan holds, and what they are: the paper's A100s for its models (a
    plan made anywhere), else this machine's first device (a GPU's limit, or on CPU the host's
    memory shared by its devices)."""
    if paper_model:
        return 80.0, "an A100 80GB"
    import jax

    from orsd_jax.estimate import GB

    device = jax.devices()[0]
    if device.platform == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
        return host / jax.local_device_count(), "this host's memory"
    return (device.memory_stats() or {}).get("bytes_limit", 0) / GB, f"this {device.device_kind}"


def plan(config: TrainConfig, processes: int = 1, sampler_urls: tuple[str, ...] = ()) -> tuple[str, bool]:
    """The dry-run report (for ``processes`` JAX processes and the vLLM servers at ``sampler_urls``)
    and whether the plan fits the devices."""
    from orsd_jax import estimate
    from orsd_jax.models import ModelConfig, resolve

    c = config.resolved()
    if c.model.name in estimate.PAPER_MODELS:
        model = estimate.PAPER_MODELS[c.model.name]
    else:
        model = ModelConfig.from_hf_config(json.loads((resolve(c.model.name) / "config.json").read_text()))
    model = dataclasses.replace(
        model,
        param_dtype=c.model.dtype,
        compute_dtype=c.model.compute_dtype or c.model.dtype,
        remat=c.model.remat,
        frozen_layers=c.model.frozen_layers,
    )
    devices = c.devices or 1
    memory_gb, memory_of = _device_memory(c.model.name in estimate.PAPER_MODELS)
    rubric_tokens = 256 if c.uses_rubrics else 0
    seq_len = c.rollout.max_prompt_tokens + rubric_tokens + 2 * (8 + c.rollout.max_response_tokens)
    e = estimate.estimate(
        model,
        rows=c.minibatch_rows,
        seq_len=seq_len,
        response_len=c.rollout.max_response_tokens,
        devices=devices,
        micro_batches=c.micro_batches,
        fsdp=c.fsdp,
        reference=bool(c.loss.kl_coef),
        device_memory_gb=memory_gb,
    )
    episodes = c.updates * c.n_tasks * c.group_size
    gb = estimate.GB
    lines = [
        f"preset {c.preset}, method {c.method}, environment {c.env.name}, model {c.model.name}",
        f"devices: {devices} ({'FSDP' if c.fsdp else 'replicated'} parameters), mesh ('data',) = ({devices},)",
        f"processes: {processes}"
        + (
            f", {devices // processes} devices each; process 0 runs the sampler, the environments, the rubric "
            "stage and the run's files, every process its rows of each minibatch and its share of the checkpoints"
            if processes > 1
            else ""
        ),
        "sampler: "
        + (
            f"{len(sampler_urls)} attached vLLM server(s) ({', '.join(sampler_urls)})"
            if sampler_urls
            else f"{c.sampler_servers} vLLM server(s) started by the run"
            if c.sampler == "vllm"
            else "in process (JAX)"
        ),
        f"parameters: {e.params / 1e9:.2f} B ({c.model.dtype}), compute {model.compute_dtype}, remat {model.remat}",
        f"minibatch: {c.minibatch_rows} rows x {seq_len} tokens (prompt {c.rollout.max_prompt_tokens}, rubric {rubric_tokens}, "
        f"2 x (tail 8 + response {c.rollout.max_response_tokens})), {c.micro_batches} micro-batches",
        "memory per device (GB): "
        f"params {e.param_bytes / gb:.1f}, reference {e.reference_bytes / gb:.1f}, grads {e.grad_bytes / gb:.1f}, AdamW {e.optimizer_bytes / gb:.1f}, "
        f"accumulator {e.accumulator_bytes / gb:.1f}, gathered {e.gathered_bytes / gb:.1f}, "
        f"activations {e.activation_bytes / gb:.1f} -> total {e.total_bytes / gb:.1f} of {e.device_memory / gb:.0f} "
        f"({memory_of}; {'fits' if e.fits else 'DOES NOT FIT'}, 90% usable)",
        f"interaction budget: {c.updates} updates x {c.n_tasks} tasks x {c.group_size} rollouts = {episodes} episodes, "
        f"at most {episodes * c.rollout.max_steps} environment steps",
    ]
    a = c.advantage
    episodes_per_update = c.n_tasks * c.group_size
    steps = [
        c.ppo_epochs * -(-n // c.minibatch_rows)
        for n in (episodes_per_update, episodes_per_update * c.rollout.max_steps)
    ]
    lines += [
        f"reward: {c.env.reward} ({'10 x success' if c.env.reward == 'success' else '10 x score'}); "
        f"invalid answers ({a.invalid} rule) cost {a.invalid_penalty}",
        f"advantage: {'GiGPO' if c.method == 'gigpo' else 'GRPO'}, {'mean-std' if a.normalize_std else 'mean-only'} "
        f"normalisation over the group's {'step samples' if a.across_steps else 'trajectories'}",
        f"KL to the initial policy: {f'k3, coefficient {c.loss.kl_coef}' if c.loss.kl_coef else 'off'}",
        f"replay: {c.replay} layout; the PPO ratio's old log-probs from the {c.old_logprobs}"
        + (f"; truncated importance sampling at {c.loss.tis_cap}" if c.loss.tis_cap is not None else ""),
        f"mini-batch: {c.minibatch_rows} step samples, {c.ppo_epochs} PPO epoch(s); optimizer steps per update: "
        f"{steps[0]} to {steps[1]} ({episodes_per_update} to {episodes_per_update * c.rollout.max_steps} step samples)",
        f"evaluation: {', '.join(c.eval_splits)}, {c.eval_games} tasks each",
    ]
    if c.uses_rubrics:
        lines.append(
            f"rubric selection: {c.rubric.selection}, rank-correlated with the group's {c.rubric.rank_by}s; "
            f"candidates from the {c.rubric.source} source"
        )
        lines.append(
            f"rubrics: {c.updates * c.n_tasks * (c.rubric.candidates if c.rubric.source == 'policy' else 1)} candidate bundles; verifier "
            f"{c.verifier.kind}{' ' + c.verifier.endpoint.model if c.verifier.endpoint else ''}"
        )
    if not e.fits:
        lines.append("the plan does not fit: use --fsdp, more --devices or more micro-batches")
    return "\n".join(lines), e.fits


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived: the run unwinds (services close, servers and environment workers
    stop) instead of dying mid-update. A BaseException, so no ``except Exception`` holds it up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on(signum: int, frame) -> None:
    raise Stopped(signum)


def _stop_again(unraisable) -> None:
    """``sys.unraisablehook``: a ``Stopped`` raised where Python can only print it is lost, and the
    run would go on training. A signal handled while a garbage-collection callback runs (JAX's
    ``_xla_gc_callback``: a study's SIGTERM to a run, seen in the grid's logs) raises there, so the
    same signal is sent again a moment later, when the callback has returned."""
    if isinstance(unraisable.exc_value, Stopped):
        threading.Timer(0.05, os.kill, (os.getpid(), unraisable.exc_value.signum)).start()
    else:
        sys.__unraisablehook__(unraisable)


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise ``Stopped`` in the main thread, wherever it is."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop_on)
    sys.unraisablehook = _stop_again


def main(env: str, doc: str, argv: list[str] | None = None) -> None:
    args = parser(env, doc).parse_args(argv)  # before any game loads: the planner overwrites sys.argv
    console_logging()
    if env == "webshop":
        default_webshop_data()
    config = config_from_args(env, args)
    from orsd_jax import distributed

    launch = distributed.Launch.from_environment(
        coordinator=args.coordinator, processes=args.processes, process_id=args.process_id
    )
    if args.dry_run:
        processes = launch.processes or 1
        if (config.devices or 1) % processes:
            raise SystemExit(f"--devices {config.devices or 1} do not split over {processes} processes")
        report, fits = plan(config, processes, args.sampler_urls)
        print(report)
        sys.exit(0 if fits else 2)
    distributed.initialize(dataclasses.replace(launch, detect=args.detect_cluster))
    from orsd_jax.trainer import train

    out = pathlib.Path(args.out or f"runs/{config.preset}-{env}-{config.method}")
    from orsd_jax.checkpoints import StorageError

    stop_on_signals()
    try:
        policy = train(config, out, resume=args.resume, stop_after=args.stop_after, sampler_urls=args.sampler_urls)
    except StorageError as error:  # nothing to debug: the disk is full
        # Orbax leaves the asyncio tasks of its other refused writes unretrieved: asyncio would log
        # each one's traceback when it is collected at exit, after this line.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        sys.exit(f"error: {error}")
    except Stopped as stop:  # asked to: nothing to debug either
        print(f"stopped by {stop}: run again with --resume to continue from the last checkpoint", file=sys.stderr)
        sys.exit(128 + stop.signum)
    if not distributed.is_main():
        return
    from orsd_jax.credit import recorded_updates

    if recorded_updates(out):
        from experiments.credit_report import write_report

        write_report(out)
    print(f"\nrun directory: {out.resolve()}")
    for name, path in [
        ("metrics", "metrics.jsonl"),
        ("tensorboard", "tb"),
        ("checkpoints", "checkpoints"),
        ("credit report", "credit_report.html"),
    ]:
        if (out / path).exists():
            print(f"{name:>14}: {(out / path).resolve()}")
    if policy.exists():
        print(f"{'final policy':>14}: {policy.resolve()}")
    updates = sorted((out / "eval").glob("*/"))
    for table in sorted(updates[-1].glob("*/eval.md")) if updates else ():
        print(f"\n{table.read_text()}")
