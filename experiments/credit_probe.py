"""Does the rubric carry credit? Play held-out ALFWorld games (or WebShop test goals) with a
policy, label every step with the environment's expert, and measure the log-likelihood gap under
each rubric source.

    python -m experiments.credit_probe                                  # the cpu-demo warm start
    python -m experiments.credit_probe --policy runs/x/policy --games 48 --other-games 24
    python -m experiments.credit_probe --env webshop --policy runs/y/policy --games 50 --within-states 4

Expert labels: a step is expert-consistent iff its action shortens the expert's remaining route by
one (ALFWorld: the engine's planner on the live game; WebShop: the route to the goal product).

Sources: ``oracle`` (the planner's plan, or the WebShop goal, as criteria), ``policy`` (the policy's own rubric: K
bundles written from the group, verified by the frozen policy on the same vLLM server, the best
rank-correlated one kept: the trainer's rubric stage of ``orsd``), ``shuffled`` (another task's
oracle bundle) and ``neutral`` (text of the oracle's shape about nothing). Opt-in, the policy's
rubric under an ablation's rubric stage (``config.ABLATIONS``): ``policy-gap-alignment``,
``policy-memory-examples``, ``policy-memory-candidate``. The policy sources take the groups
``--groups-per-update`` at a time as successive updates, so a memory fills as it would over a
run's updates (on a frozen policy); each writes its candidates and selections to
OUT/rubrics-<source>.json, and its memory to OUT/memory-<source>.json. Writes OUT/probe.md (the table),
OUT/probe.csv (one row per step and source), OUT/states.csv (the within-state scores),
OUT/probe.json (settings and the summary) and OUT/probe.png (gap distributions).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import os
import pathlib
import pickle
import time
import typing
from collections.abc import Callable, Sequence

import numpy as np

if typing.TYPE_CHECKING:  # the probe's imports are lazy: its --help and --summarise-only load no model
    from orsd_jax.chat import ChatFormat
    from orsd_jax.config import TrainConfig
    from orsd_jax.models import CausalLM
    from orsd_jax.rollout import Group
    from orsd_jax.rubrics import GroupRubric, Verifier
    from orsd_jax.rubrics.memory import RubricMemory
    from orsd_jax.sampling import Sampler

# A policy source -> the method whose rubric stage writes it.
POLICY_SOURCES = {
    "policy": "orsd",
    "policy-gap-alignment": "orsd-gap-alignment",
    "policy-memory-examples": "orsd-memory-examples",
    "policy-memory-candidate": "orsd-memory-candidate",
}
SOURCES = ("oracle", *POLICY_SOURCES, "shuffled", "neutral")
DEFAULT_SOURCES = ("oracle", "policy", "shuffled", "neutral")


@dataclasses.dataclass(frozen=True)
class ProbeEnv:
    """What the probe needs of an environment: its held-out tasks, how to play them, their oracle
    bundles and the states probed action by action."""

    tasks: list
    make_env: Callable  # picklable, for spawned workers
    build_prompt: Callable
    rollout: object  # RolloutConfig
    oracle: Callable  # task -> criteria
    states: Callable  # (groups, per_game) -> [(group, step, candidate actions, the expert's action)]


def _alfworld(args, rollout) -> ProbeEnv:
    from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split
    from orsd_jax.rubrics.oracle import alfworld_oracle

    root = default_games("easy", args.games_seed, 8, args.generated)
    tasks = []
    for task_type, n in ((args.type, args.games), (args.other_type, args.other_games)):
        pool = [t for split in ("valid_seen", "valid_unseen") for t in load_split(root, split, (task_type,))]
        if len(pool) < n:
            raise SystemExit(
                f"{len(pool)} held-out {task_type} games among {args.generated} per split; raise --generated"
            )
        tasks += pool[:n]
    make_env = functools.partial(AlfworldEnv, max_steps=rollout.max_steps)
    return ProbeEnv(tasks, make_env, build_prompt, rollout, alfworld_oracle, _alfworld_states)


def _webshop(args, rollout) -> ProbeEnv:
    from orsd_jax.envs.webshop import WebShopEnv, build_prompt, load_goals
    from orsd_jax.envs.webshop.env import DEFAULT_MAX_STEPS
    from orsd_jax.rubrics import sources

    rollout = dataclasses.replace(rollout, max_steps=DEFAULT_MAX_STEPS, max_prompt_tokens=3072)
    tasks = list(load_goals(args.data_dir, "test"))[: args.games]
    make_env = functools.partial(WebShopEnv, args.data_dir, max_steps=rollout.max_steps)
    return ProbeEnv(
        tasks,
        make_env,
        build_prompt,
        rollout,
        sources.oracle_for("webshop", args.data_dir),
        functools.partial(_webshop_states, make_env),
    )


def _play(args, policy, tokenizer, fmt, probe_env: ProbeEnv):
    """Groups of ``--group-size`` episodes per task, the vLLM sampler and the server it runs on."""
    from orsd_jax import seeds
    from orsd_jax.envs import EnvPool
    from orsd_jax.rollout import collect_groups
    from orsd_jax.sampling.vllm_sampler import VLLMSampler
    from orsd_jax.sampling.vllm_server import ServerOptions

    sampler = VLLMSampler(policy, tokenizer, options=ServerOptions(max_model_len=4096, seed=args.seed))
    groups = []
    per_call = max(1, 16 // args.group_size)
    tasks, rollout = probe_env.tasks, probe_env.rollout
    with EnvPool(probe_env.make_env, per_call * args.group_size) as pool:
        for start in range(0, len(tasks), per_call):
            chunk = tasks[start : start + per_call]
            chunk = chunk + [chunk[-1]] * (per_call - len(chunk))
            played, _ = collect_groups(
                sampler,
                pool,
                chunk,
                args.group_size,
                rollout,
                seeds.derive(args.seed, start),
                tokenizer=tokenizer,
                fmt=fmt,
                build_prompt=probe_env.build_prompt,
            )
            groups += played[: len(tasks) - start]
            print(f"played {len(groups)}/{len(tasks)} groups", flush=True)
    return groups, sampler


@dataclasses.dataclass(frozen=True)
class RubricTools:
    """The rubric stage's services (``trainer.RubricServices``) for the probe: its played policy as
    writer and verifier."""

    config: TrainConfig  # resolved
    sampler: Sampler | None
    verifier: Verifier
    tokenizer: typing.Any
    fmt: ChatFormat
    rubric_source: dict


def staged_rubrics(
    tools: RubricTools, policy: CausalLM | None, groups: Sequence[Group], per_update: int
) -> tuple[list[GroupRubric], RubricMemory, dict[str, float]]:
    """The trainer's rubric stage over ``groups``, ``per_update`` of them at a time as successive
    updates with the rubric memory carried between them: each group's ``GroupRubric``, the memory
    after the last, and the stage's metrics over all groups (memory offers and wins summed).
    ``policy``: the model gap alignment replays."""
    from orsd_jax.rubrics import rubric_metrics
    from orsd_jax.rubrics.memory import RubricMemory
    from orsd_jax.trainer import rubric_stage

    c = tools.config
    memory = RubricMemory(size=c.rubric.memory_size)
    chosen: list[GroupRubric] = []
    counts: dict[str, float] = {}
    aligned = policy if c.rubric.selection == "gap-alignment" else None
    for update, start in enumerate(range(0, len(groups), per_update)):
        metrics: dict[str, float] = {}
        rubrics, memory = rubric_stage(tools, aligned, groups[start : start + per_update], update, metrics, memory)
        chosen += rubrics
        for key in ("rubric/memory/offered", "rubric/memory/wins"):
            if key in metrics:
                counts[key] = counts.get(key, 0.0) + metrics[key]
    return chosen, memory, rubric_metrics(chosen) | counts


def _policy_rubrics(args, sampler, tokenizer, fmt, groups, model, source: str, out: pathlib.Path):
    """The policy's own rubric per group under ``source``'s rubric stage (None where it gives
    none), and the stage's metrics. Each group's candidates and selection are written to
    OUT/rubrics-<source>.json, a memory to OUT/memory-<source>.json."""
    from orsd_jax.config import preset
    from orsd_jax.credit import rubric_record
    from orsd_jax.rubrics import EndpointConfig, OpenAIVerifier
    from orsd_jax.rubrics import memory as rubric_memory

    config = dataclasses.replace(preset("cpu-demo"), method=POLICY_SOURCES[source], seed=args.seed).resolved()
    server = sampler.server  # the same frozen weights: the policy is not trained here
    verifier = OpenAIVerifier(
        EndpointConfig(
            base_url=f"{server.url}/v1", model=server.served_model_name, unix_socket=server.unix_socket, mode="logprob"
        )
    )
    tools = RubricTools(config, sampler, verifier, tokenizer, fmt, {})
    chosen, memory, stage = staged_rubrics(tools, model, groups, args.groups_per_update)
    names = game_names([g.task.key for g in groups])
    records = [{"game": names[g.task.key], **rubric_record(r)} for g, r in zip(groups, chosen)]
    (out / f"rubrics-{source}.json").write_text(json.dumps(records, indent=1))
    if config.rubric.uses_memory:
        rubric_memory.save(memory, out / f"memory-{source}.json")
    return [r.criteria for r in chosen], stage


def _alfworld_states(groups, per_game: int):
    """The first ``per_game`` states of each group's first trajectory: (group, step, admissible
    actions, the planner's first command)."""
    from orsd_jax.envs.alfworld.engine import make_engine
    from orsd_jax.envs.alfworld.expert import expert_plan

    engine = make_engine(plan=True)
    out = []
    for g, group in enumerate(groups):
        engine.load(group.task.key)
        state = engine.reset()
        for k, step in enumerate(group.trajectories[0].steps[:per_game]):
            plan = expert_plan(state)
            if plan:
                out.append((g, k, tuple(a for a in state["admissible_commands"] if a != "help"), plan[0]))
            state, _, _ = engine.step(step.action or "")
            if state["won"]:
                break
    return out


def _webshop_states(make_env, groups, per_game: int):
    """As ``_alfworld_states``, with the first step of the route to the goal product as the expert's
    action. The search box is one candidate, searching the goal's title (the route's own search);
    a state with a single candidate is skipped."""
    from orsd_jax.envs.webshop import parse_command
    from orsd_jax.envs.webshop.expert import expert_route
    from orsd_jax.envs.webshop.pages import SEARCH_PLACEHOLDER
    from orsd_jax.envs.webshop.search import search_argument

    env = make_env()
    out = []
    try:
        for g, group in enumerate(groups):
            current = env.reset(group.task)
            for k, step in enumerate(group.trajectories[0].steps[:per_game]):
                route = expert_route(env, current)
                actions = tuple(a for a in current.admissible_actions if a != SEARCH_PLACEHOLDER)
                if SEARCH_PLACEHOLDER in current.admissible_actions:
                    actions = (f"search[{search_argument(env.goal.name)}]", *actions)
                expert = next((a for a in actions if route and parse_command(a) == parse_command(route[0])), None)
                if expert is not None and len(actions) > 1:
                    out.append((g, k, actions, expert))
                current = env.step(step.action or "")
                if current.done:
                    break
    finally:
        env.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", help="Hugging Face directory (default: the cpu-demo warm start, cached)")
    p.add_argument(
        "--rubric-games",
        type=int,
        help="without --policy: the cpu-demo warm start with this many games also demonstrated with their "
        "oracle rubric in the prompt (default: the preset's)",
    )
    p.add_argument("--env", default="alfworld", choices=["alfworld", "webshop"])
    p.add_argument("--data-dir", help="WebShop: the official files (default: $WEBSHOP_DATA, else ../shared/webshop)")
    p.add_argument("--type", default="look", help="ALFWorld: the task type the policy was trained on")
    p.add_argument("--games", type=int, default=48, help="ALFWorld: games of --type; WebShop: test goals")
    p.add_argument("--other-type", default="pick", help="ALFWorld")
    p.add_argument("--other-games", type=int, default=24, help="ALFWorld")
    p.add_argument("--generated", type=int, default=200, help="ALFWorld: generated games per held-out split")
    p.add_argument("--games-seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--sources", default=",".join(DEFAULT_SOURCES), help=f"some of {', '.join(SOURCES)}")
    p.add_argument(
        "--groups-per-update",
        type=int,
        help="policy sources: groups per rubric stage, the memory's update (default: cpu-demo's tasks per update)",
    )
    p.add_argument("--within-states", type=int, default=1, help="states probed per game, from the first trajectory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/probe")
    p.add_argument(
        "--summarise-only", action="store_true", help="write the records again from OUT's scores, replaying nothing"
    )
    args = p.parse_args(argv)  # before any game loads: the planner overwrites sys.argv
    if args.summarise_only:
        return summarise_again(pathlib.Path(args.out))
    sources = tuple(s for s in args.sources.split(",") if s)
    if unknown := set(sources) - set(SOURCES):
        raise SystemExit(f"unknown sources {sorted(unknown)}; expected some of {SOURCES}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from orsd_jax import chat
    from orsd_jax.advantages import returns, step_advantages
    from orsd_jax.config import preset
    from orsd_jax.credit import expert_labels, token_pieces
    from orsd_jax.demos import demo_answer
    from orsd_jax.metrics_log import console_logging
    from orsd_jax.models import EMBEDDED, load_model, resolve
    from orsd_jax.probe import ProbeState, ProbeStep, branch_logprobs, token_classes
    from orsd_jax.rubrics import rubric_insert
    from orsd_jax.rubrics import sources as rubric_sources

    console_logging()
    demo = preset("cpu-demo").resolved()
    args.groups_per_update = args.groups_per_update or demo.n_tasks
    if args.policy:
        policy = resolve(args.policy)
    elif args.env == "webshop":  # no WebShop warm start yet: the embedded model as it ships
        policy = resolve(EMBEDDED)
    else:
        from orsd_jax.warmstart import cached_warmstart

        run = demo.model.warmstart
        if args.rubric_games is not None:
            run = dataclasses.replace(run, rubric_games=args.rubric_games)
        policy = cached_warmstart(run)
    probe_env = (_alfworld if args.env == "alfworld" else _webshop)(args, demo.rollout)
    model, tokenizer = load_model(policy)
    fmt = chat.chat_format(tokenizer)
    timings, started = {}, time.perf_counter()
    groups, sampler = _play(args, policy, tokenizer, fmt, probe_env)
    timings["play"] = time.perf_counter() - started
    try:
        started = time.perf_counter()
        stage, policy_criteria = {}, {}
        for source in [s for s in sources if s in POLICY_SOURCES]:
            policy_criteria[source], stage[source] = _policy_rubrics(
                args, sampler, tokenizer, fmt, groups, model, source, out
            )
            timings[f"rubrics_{source}"] = time.perf_counter() - started
            started = time.perf_counter()
    finally:
        sampler.close()
    started = time.perf_counter()
    labels = expert_labels(groups, probe_env.make_env)
    states = probe_env.states(groups, args.within_states)
    timings["labels"] = time.perf_counter() - started

    oracle = [probe_env.oracle(g.task) for g in groups]
    rubrics = {
        "oracle": oracle,
        **policy_criteria,
        "shuffled": rubric_sources.shuffled(oracle, [g.task for g in groups]),
        "neutral": [rubric_sources.neutral_like(c) for c in oracle],
    }
    inserts = {s: [tuple(chat.encode(tokenizer, rubric_insert(c))) if c else None for c in rubrics[s]] for s in sources}
    advantages = step_advantages(groups, "grpo", demo.advantage)
    tail = list(fmt.tail)
    options = dict(temperature=demo.loss.temperature, chunk_size=demo.loss.chunk_size)

    # Every step: one row, one branch per source with a rubric plus the branch without.
    started = time.perf_counter()
    index, rows = [], []
    for g, group in enumerate(groups):
        for t, traj in enumerate(group.trajectories):
            for k, step in enumerate(traj.steps):
                have = [s for s in sources if inserts[s][g] is not None]
                prefix = list(step.prompt_ids[: -len(tail)])
                branches = [(list(inserts[s][g]) + tail, list(step.response_ids)) for s in have]
                rows.append((prefix, branches + [(tail, list(step.response_ids))]))
                index.append((g, t, k, have))
    scored = branch_logprobs(model, rows, rows_per_call=4, branch_multiple=len(sources) + 1, **options)
    steps = []
    for (g, t, k, have), logp in zip(index, scored):
        group, traj = groups[g], groups[g].trajectories[t]
        step = traj.steps[k]
        steps.append(
            ProbeStep(
                game=group.task.key,
                task_type=group.task.task_type,
                trajectory=t,
                step=k,
                expert=labels[g][t][k],
                valid=step.valid,
                won=traj.won,
                ret=float(returns(group, demo.advantage)[t]),
                advantage=float(advantages[g][t][k]),
                classes=token_classes(token_pieces(tokenizer, step.response_ids)),
                gaps={s: logp[i] - logp[-1] for i, s in enumerate(have)},
            )
        )
    timings["score_steps"] = time.perf_counter() - started

    # Probed states: every admissible action as the policy's answer form, with and without each rubric.
    started = time.perf_counter()
    probed = []
    for g, k, actions, expert in states:
        group = groups[g]
        prefix = list(group.trajectories[0].steps[k].prompt_ids[: -len(tail)])
        answers = [
            (tail, chat.encode(tokenizer, demo_answer(group.task.description, a, reasoning=False))) for a in actions
        ]
        have = [s for s in sources if inserts[s][g] is not None]
        rows = [(prefix, answers)] + [(prefix + list(inserts[s][g]), answers) for s in have]
        sums = [
            np.array([float(x.sum()) for x in row])
            for row in branch_logprobs(model, rows, rows_per_call=1, branch_multiple=8, **options)
        ]
        probed.append(
            ProbeState(
                group.task.key, actions, np.array([a == expert for a in actions]), sums[0], dict(zip(have, sums[1:]))
            )
        )
    timings["score_states"] = time.perf_counter() - started

    counts = {
        "games": len(groups),
        "episodes": sum(len(g.trajectories) for g in groups),
        "won": sum(t.won for g in groups for t in g.trajectories),
    }
    scored = {"steps": steps, "states": probed, "stage": stage, "timings": timings}
    with open(out / "scored.pkl", "wb") as f:  # the scores, to summarise again without replaying
        pickle.dump(scored, f)
    settings = vars(args) | {"policy": pathlib.Path(policy).name, "coef": demo.loss.coef, "clip": demo.loss.clip}
    _report(out, settings, scored, counts)


def _report(out: pathlib.Path, settings: dict, scored: dict, counts: dict) -> None:
    """The probe's records in ``out`` from its scores (``scored.pkl``'s), settings and the played
    games, episodes and wins (``counts``)."""
    from orsd_jax.probe import summarise

    sources = tuple(s for s in settings["sources"].split(",") if s)
    paired = {s: "policy" for s in POLICY_SOURCES if s != "policy" and s in sources and "policy" in sources}
    options = dict(coef=settings["coef"], clip=settings["clip"], seed=settings["seed"])
    summary = summarise(scored["steps"], scored["states"], sources, paired=paired, **options)
    _write(out, settings, sources, summary, scored, counts)
    print((out / "probe.md").read_text())


def summarise_again(out: pathlib.Path) -> None:
    """``--summarise-only``: the records again from OUT/scored.pkl and OUT/probe.json's settings."""
    with open(out / "scored.pkl", "rb") as f:
        scored = pickle.load(f)
    info = json.loads((out / "probe.json").read_text())
    _report(out, info["settings"], scored, {k: info[k] for k in ("games", "episodes", "won")})


def game_names(keys) -> dict[str, str]:
    """Task keys as the records name them: ALFWorld's game files relative to their common
    directory (a key is a path on this machine), WebShop's goal indices as they are."""
    keys = sorted(set(keys))
    if not all(pathlib.Path(k).is_absolute() for k in keys):
        return {k: k for k in keys}
    root = pathlib.Path(os.path.commonpath(keys))
    root = root.parent if root in {pathlib.Path(k) for k in keys} else root
    return {k: str(pathlib.Path(k).relative_to(root)) for k in keys}


def _write(out, settings, sources, summary, scored, counts):
    from orsd_jax.probe import ACTION, FORMAT, summarise

    steps, states = scored["steps"], scored["states"]
    names = game_names([s.game for s in steps] + [st.game for st in states])

    with open(out / "probe.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "game",
                "task_type",
                "trajectory",
                "step",
                "expert",
                "valid",
                "won",
                "return",
                "advantage",
                "source",
                "gap_step",
                "gap_action",
                "gap_format",
                "tokens",
            ]
        )
        for s in steps:
            for source, gap in s.gaps.items():
                action, fmt_ = gap[s.classes == ACTION], gap[s.classes == FORMAT]
                writer.writerow(
                    [
                        names[s.game],
                        s.task_type,
                        s.trajectory,
                        s.step,
                        int(s.expert),
                        int(s.valid),
                        int(s.won),
                        s.ret,
                        f"{s.advantage:.6f}",
                        source,
                        f"{gap.mean():.6f}",
                        f"{action.mean():.6f}" if len(action) else "",
                        f"{fmt_.mean():.6f}" if len(fmt_) else "",
                        len(gap),
                    ]
                )
    with open(out / "states.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["game", "action", "expert", "logp_without", *[f"logp_{s}" for s in sources]])
        for st in states:
            for i, a in enumerate(st.actions):
                extra = [f"{st.with_rubric[s][i]:.6f}" if s in st.with_rubric else "" for s in sources]
                writer.writerow([names[st.game], a, int(st.expert[i]), f"{st.without[i]:.6f}", *extra])
    by_type = {}
    for t in sorted({s.task_type for s in steps}):
        by_type[t] = summarise(
            [s for s in steps if s.task_type == t],
            [],
            sources,
            coef=settings["coef"],
            clip=settings["clip"],
            n_boot=500,
        )
    info = {
        "settings": settings,
        "summary": summary,
        "by_type": by_type,
        "rubric_stage": scored["stage"],
        "timings_s": scored["timings"],
        **counts,
    }
    (out / "probe.json").write_text(json.dumps(info, indent=2, default=float))
    (out / "probe.md").write_text(_markdown(summary, by_type, info))
    _plot(out / "probe.png", steps, sources)


def _fmt(row, key, digits=2):
    value = row.get(key)
    return "" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.{digits}f}"


def _markdown(summary, by_type, info) -> str:
    lines = [
        f"Credit probe: {info['games']} games, {info['episodes']} episodes ({info['won']} won), "
        f"{int(summary[0]['steps'] + summary[0]['steps_without_rubric'])} steps.",
        "",
        "| source | steps | AUC step gap [95%] | AUC action gap [95%] | gap expert | gap other | gap format tokens "
        "| sign flips | gap~outcome (Spearman) | top-1 without / with | within-state AUC |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in summary:
        if not r["steps"]:
            lines.append(f"| {r['source']} | 0 | | | | | | | | | |")
            continue
        top1 = f"{_fmt(r, 'top1_without')} / {_fmt(r, 'top1_with')}" if "top1_with" in r else ""
        lines.append(
            f"| {r['source']} | {int(r['steps'])} | {_fmt(r, 'auc_step')} [{_fmt(r, 'auc_step_lo')}, {_fmt(r, 'auc_step_hi')}] "
            f"| {_fmt(r, 'auc_action')} [{_fmt(r, 'auc_action_lo')}, {_fmt(r, 'auc_action_hi')}] "
            f"| {_fmt(r, 'gap_expert', 3)} | {_fmt(r, 'gap_other', 3)} | {_fmt(r, 'gap_format_tokens', 3)} "
            f"| {_fmt(r, 'sign_flips', 3)} | {_fmt(r, 'gap_outcome_spearman')} | {top1} | {_fmt(r, 'within_state_auc')} |"
        )
    if pairs := [r for r in summary if r.get("paired_steps")]:
        lines += [
            "",
            "On the steps both scored (each source's rubric and the reference's), paired over the same game resamples:",
            "",
            "| source | reference | steps | AUC step gap | reference's AUC | difference [95%] |",
            "|---|---|---:|---:|---:|---|",
        ]
        lines += [
            f"| {r['source']} | {r['paired_with']} | {int(r['paired_steps'])} | {_fmt(r, 'paired_auc')} "
            f"| {_fmt(r, 'paired_auc_reference')} | {_fmt(r, 'paired_auc_diff')} "
            f"[{_fmt(r, 'paired_auc_diff_lo')}, {_fmt(r, 'paired_auc_diff_hi')}] |"
            for r in pairs
        ]
    for task_type, rows in by_type.items():
        lines += [
            "",
            f"{task_type} games only:",
            "",
            "| source | steps | AUC step gap [95%] | AUC action gap [95%] |",
            "|---|---:|---|---|",
        ]
        for r in rows:
            if r["steps"]:
                lines.append(
                    f"| {r['source']} | {int(r['steps'])} | {_fmt(r, 'auc_step')} [{_fmt(r, 'auc_step_lo')}, "
                    f"{_fmt(r, 'auc_step_hi')}] | {_fmt(r, 'auc_action')} [{_fmt(r, 'auc_action_lo')}, {_fmt(r, 'auc_action_hi')}] |"
                )
    for source, stage in info["rubric_stage"].items():
        memory = (
            f"; the remembered bundle offered {stage['rubric/memory/offered']:.0f} times, chosen "
            f"{stage['rubric/memory/wins']:.0f}"
            if "rubric/memory/offered" in stage
            else ""
        )
        lines += [
            "",
            f"Rubrics of {source}: {stage.get('rubric/groups_with_rubric', 0):.0f} of {info['games']} groups got one "
            f"({stage.get('rubric/valid_bundles', 0):.0f} of {stage.get('rubric/bundles', 0):.0f} bundles valid{memory}).",
        ]
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in info["timings_s"].items())]
    return "\n".join(lines) + "\n"


def _plot(path, steps, sources) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sources), figsize=(3.2 * len(sources), 3), sharey=True)
    for ax, source in zip(np.atleast_1d(axes), sources):
        for expert, colour in ((True, "tab:green"), (False, "tab:red")):
            gaps = [float(s.gaps[source].mean()) for s in steps if source in s.gaps and s.expert == expert]
            if gaps:
                ax.hist(gaps, bins=30, alpha=0.5, color=colour, density=True, label="expert" if expert else "other")
        ax.set_title(source)
        ax.set_xlabel("step mean gap")
    np.atleast_1d(axes)[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
