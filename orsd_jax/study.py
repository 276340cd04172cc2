"""A multi-seed study: the grid of runs, their state on disk, and what the study reports from their
``metrics.jsonl`` (learning curves with bootstrap bands, the final evaluation, the interaction budget).

Nothing here trains; ``experiments.study`` runs the grid. The statistics are over seeds: a run's
value at an update is one observation, a method's interval is the percentile bootstrap of the mean
of its seeds' values (with a fixed RNG, so a regenerated report has the same numbers).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from orsd_jax import metrics_log
from orsd_jax.config import ABLATIONS, METHODS, TrainConfig
from orsd_jax.estimate import forward_flops, train_flops
from orsd_jax.models import ModelConfig

RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
LEVEL = 0.95
BASELINE = "grpo"  # paired differences are to this method, seed by seed
ORSD = "orsd"  # and ORSD's ablations' to ORSD too: what each switch changes, seed by seed
# The initial policy, as a pseudo-method: a run of 0 updates per seed, whose final evaluation is the
# trained runs' at that seed on the same games with the same sampling (their common starting point).
INITIAL = "initial"
# Where the paper's GPU hours come from: its 4 x A100 (dense bfloat16 peak) at an assumed fraction of
# the peak over rollouts, training and evaluation together (decoding is memory-bound, so the fraction is low).
A100_BF16_FLOPS = 312e12
UTILIZATION = 0.25


@dataclasses.dataclass(frozen=True)
class RunSpec:
    method: str
    seed: int
    directory: pathlib.Path

    @property
    def name(self) -> str:
        return f"{self.method}-seed{self.seed}"


@dataclasses.dataclass(frozen=True)
class StudyPlan:
    env: str
    preset: str
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    updates: int
    out: pathlib.Path
    overrides: tuple[str, ...] = ()  # training flags passed to every run (``--lr 1e-5``, ...)

    def __post_init__(self):
        if not self.methods or not self.seeds:
            raise ValueError("a study needs at least one method and one seed")

    def _trained(self, seed: int) -> tuple[RunSpec, ...]:
        return tuple(RunSpec(m, seed, self.out / "runs" / f"{m}-seed{seed}") for m in self.methods)

    def _initial(self, seed: int) -> RunSpec:
        return RunSpec(INITIAL, seed, self.out / "initial" / f"seed{seed}")

    def runs(self) -> tuple[RunSpec, ...]:
        """The trained runs, seed by seed: a grid stopped halfway has every method at the seeds it finished."""
        return tuple(run for s in self.seeds for run in self._trained(s))

    def initial_runs(self) -> tuple[RunSpec, ...]:
        return tuple(self._initial(s) for s in self.seeds)

    def jobs(self) -> tuple[RunSpec, ...]:
        """What the grid runs, seed by seed: the initial policy's evaluation, then every method."""
        return tuple(run for s in self.seeds for run in (self._initial(s), *self._trained(s)))


@dataclasses.dataclass(frozen=True)
class Row:
    """One tidy observation: a run's value of a metric at an update."""

    method: str
    seed: int
    update: int
    metric: str
    value: float


@dataclasses.dataclass(frozen=True)
class Interval:
    """The mean over ``n`` seeds and its percentile-bootstrap interval."""

    mean: float
    low: float
    high: float
    n: int


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    method: str
    metric: str
    update: int
    interval: Interval


@dataclasses.dataclass(frozen=True)
class Budget:
    """A run's interaction, summed over its training updates (evaluation not included), and the
    highest share of invalid answers an update had."""

    updates: int
    episodes: int
    env_steps: float  # rollout/env_steps
    generated_tokens: float  # rollout/generated_tokens: the policy's tokens in the environment
    verifier_calls: float  # verifier/calls (requests, retries included)
    update_seconds: float  # time/update: rollouts, rubric stage, training and weight push
    highest_invalid_rate: float | None  # env/invalid_rate, the maximum over updates (None: not logged)


@dataclasses.dataclass(frozen=True)
class RubricStage:
    """A run's rubric stage, over its training updates (``rubric_stage``)."""

    groups: int  # the groups played: tasks an update x updates
    with_rubric: float  # rubric/groups_with_rubric
    # At least this many got a rubric without a mixed outcome: an update's groups with a rubric less
    # its mixed groups (env/mixed_groups x tasks), where positive; the log does not pair them group by group.
    unmixed_with_rubric: int
    correlation: float | None  # rubric/chosen_correlation, mean over the updates that logged one
    negative_updates: int  # of those, the updates whose chosen correlation was below 0
    correlated_updates: int
    memory_offered: float  # rubric/memory/offered: groups whose candidates included the remembered bundle
    memory_wins: float  # rubric/memory/wins: of those, the groups where it was selected


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    metric: str
    complement: bool = False  # plot 1 - value: the log has the invalid-answer rate, the panel shows valid answers
    x: str = "update"


PANELS = (
    Panel("training success", "env/success"),
    Panel("return (reward less invalid-answer penalties)", "env/return"),
    Panel("valid answers", "env/invalid_rate", complement=True),
    Panel("groups with a rubric", "rubric/groups_with_rubric"),
)
# With a fixed pool: each game against itself a pass later (``pass_success``), far less noisy than an
# update's two games.
PASS_PANEL = Panel("training success per pass over the pool", "pass/success", x="pass")


# Runs on disk.


def read_records(directory: pathlib.Path) -> tuple[dict, ...]:
    """The run's ``metrics.jsonl``, one dict per line (empty when the run has logged nothing)."""
    return tuple(metrics_log.read_records(directory / "metrics.jsonl"))


def final_record(records: Sequence[dict]) -> dict | None:
    """The final evaluation, which the trainer logs (``"final": true``) once every update is done."""
    return next((r for r in records if r.get("final")), None)


def has_checkpoint(directory: pathlib.Path) -> bool:
    """Orbax renames a checkpoint into ``checkpoints/<update>`` only when it is complete."""
    checkpoints = directory / "checkpoints"
    return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


def run_state(directory: pathlib.Path) -> str:
    """``finished`` (a final record), ``resume`` (config.json and a complete checkpoint) or ``new``
    (nothing there, or partial files without a checkpoint: the run starts over)."""
    if final_record(read_records(directory)) is not None:
        return "finished"
    if (directory / "config.json").is_file() and has_checkpoint(directory):
        return "resume"
    return "new"


def config_differences(saved: Mapping, planned: Mapping, prefix: str = "") -> tuple[str, ...]:
    """Dotted names of the fields in which two config.json dicts differ."""
    out: list[str] = []
    for key in sorted(set(saved) | set(planned)):
        a, b = saved.get(key), planned.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(prefix + key)
    return tuple(out)


# TrainConfig fields that change how a run computes its updates, not what: the replay's layouts and
# rows of several samples give the same losses and gradients (tests/test_loss.py,
# tests/test_train_step.py). A run resumed, or a grid continued, under other values keeps its protocol.
EXECUTION_FIELDS = ("replay", "pack_rows", "row_tokens")


def protocol_differences(saved: Mapping, planned: Mapping) -> tuple[str, ...]:
    """``config_differences`` less ``EXECUTION_FIELDS``: what makes two runs different experiments."""
    return tuple(name for name in config_differences(saved, planned) if name not in EXECUTION_FIELDS)


def discover(out: pathlib.Path) -> StudyPlan:
    """The plan of the runs already in ``out/runs`` (their config.json), for regenerating the report."""
    configs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/config.json"))]
    if not configs:
        raise FileNotFoundError(f"no runs in {out / 'runs'}")
    protocols = {(c["env"]["name"], c["preset"], c["updates"]) for c in configs}
    if len(protocols) > 1:
        raise ValueError(f"the runs in {out / 'runs'} differ in (env, preset, updates): {sorted(protocols)}")
    [(env, preset, updates)] = protocols
    methods = tuple(m for m in METHODS if m in {c["method"] for c in configs})
    initial = [json.loads(p.read_text())["seed"] for p in (out / "initial").glob("*/config.json")]
    seeds = tuple(sorted({c["seed"] for c in configs} | set(initial)))  # the initial policy's evaluations too
    return StudyPlan(env, preset, methods, seeds, updates, out)


# Statistics.


def bootstrap_interval(values: Sequence[float], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Interval:
    """The mean of ``values`` (one per seed) and the percentile bootstrap ``LEVEL`` interval of it.

    With one value the interval is the point; with two or three, the endpoints are the smallest and
    largest values (each resample of all-smallest has probability >= 1/27 > 2.5%)."""
    x = np.asarray(values, dtype=np.float64)  # [n]
    if not x.size:
        raise ValueError("no values to aggregate")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)  # [resamples]
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(x.mean()), float(low), float(high), int(x.size))


def tidy(run: RunSpec, records: Iterable[dict]) -> tuple[Row, ...]:
    """Every numeric metric of every record (null, the log's NaN, is left out)."""
    return tuple(
        Row(run.method, run.seed, r["update"], k, float(v))
        for r in records
        for k, v in r.items()
        if k not in ("update", "final") and isinstance(v, (int, float)) and not isinstance(v, bool)
    )


def curves(rows: Iterable[Row], metrics: Iterable[str]) -> tuple[CurvePoint, ...]:
    """Per method, metric and update: the mean over the seeds that logged it, with its interval."""
    wanted = set(metrics)
    values: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    for r in rows:
        if r.metric in wanted:
            values[r.method, r.metric, r.update].append(r.value)
    return tuple(CurvePoint(m, k, u, bootstrap_interval(v)) for (m, k, u), v in sorted(values.items()))


def by_method(values: Mapping[RunSpec, float]) -> dict[str, Interval]:
    """A per-run value (e.g. a final evaluation metric) aggregated over each method's seeds."""
    grouped: dict[str, list[float]] = collections.defaultdict(list)
    for run, v in values.items():
        grouped[run.method].append(v)
    return {m: bootstrap_interval(v) for m, v in grouped.items()}


def paired_differences(values: Mapping[RunSpec, float], baseline: str = BASELINE) -> dict[str, Interval]:
    """Per method, ``value - baseline's value`` of the same seed, over the seeds both have."""
    base = {run.seed: v for run, v in values.items() if run.method == baseline}
    grouped: dict[str, list[float]] = collections.defaultdict(list)
    for run, v in values.items():
        if run.method != baseline and run.seed in base:
            grouped[run.method].append(v - base[run.seed])
    return {m: bootstrap_interval(d) for m, d in grouped.items()}


def budget(records: Sequence[dict], episodes_per_update: int) -> Budget:
    train = [r for r in records if not r.get("final")]
    keys = ("rollout/env_steps", "rollout/generated_tokens", "verifier/calls", "time/update")
    steps, tokens, calls, seconds = (float(sum(r.get(k) or 0.0 for r in train)) for k in keys)
    invalid = [r["env/invalid_rate"] for r in train if r.get("env/invalid_rate") is not None]
    highest = max(invalid) if invalid else None
    return Budget(len(train), len(train) * episodes_per_update, steps, tokens, calls, seconds, highest)


def rubric_stage(records: Sequence[dict], n_tasks: int) -> RubricStage | None:
    """The rubric stage's record of a run (``n_tasks``: groups an update); None for a run without one."""
    train = [r for r in records if not r.get("final") and r.get("rubric/groups_with_rubric") is not None]
    if not train:
        return None
    correlations = [r["rubric/chosen_correlation"] for r in train if r.get("rubric/chosen_correlation") is not None]
    return RubricStage(
        groups=len(train) * n_tasks,
        with_rubric=sum(r["rubric/groups_with_rubric"] for r in train),
        unmixed_with_rubric=sum(
            max(0, round(r["rubric/groups_with_rubric"] - n_tasks * (r.get("env/mixed_groups") or 0.0))) for r in train
        ),
        correlation=float(np.mean(correlations)) if correlations else None,
        negative_updates=sum(c < 0 for c in correlations),
        correlated_updates=len(correlations),
        memory_offered=sum(r.get("rubric/memory/offered") or 0.0 for r in train),
        memory_wins=sum(r.get("rubric/memory/wins") or 0.0 for r in train),
    )


def pass_success(records: Sequence[dict], config: Mapping) -> dict[str, float]:
    """Training success per pass over a fixed pool of games (``env.train_pool`` tasks, ``n_tasks`` an
    update: every game once a pass), and ``last - first``: each game's success against its own a few
    passes earlier. Only complete passes count; without a pool (each update draws other games), or a
    pool an update does not divide, there are no passes: empty."""
    pool, n_tasks = config["env"].get("train_pool"), config["n_tasks"]
    if not pool or pool % n_tasks:
        return {}
    length = pool // n_tasks
    passes: dict[int, list[float]] = collections.defaultdict(list)
    for r in records:
        if not r.get("final") and r.get("env/success") is not None:
            passes[(r["update"] - 1) // length + 1].append(r["env/success"])
    means = {p: float(np.mean(v)) for p, v in sorted(passes.items()) if len(v) == length}
    if not means:
        return {}
    out = {f"pass {p}": v for p, v in means.items()}
    if len(means) > 1:
        out["last - first"] = means[max(means)] - means[min(means)]
    return out


def run_flops(model: ModelConfig, config: TrainConfig) -> float:
    """An upper bound on a run's dense work, from ``orsd_jax.estimate``'s FLOP counts for ``model``:
    every episode runs ``max_steps`` steps at the full prompt and response lengths; a rollout step
    costs a forward over them, training ``estimate.train_flops`` per PPO epoch, the KL's reference,
    the trainer's old log-probs and ORSD's with-rubric stream a forward each; rubric writing
    (policy source) and evaluation sweeps as forwards. A remote verifier is not counted."""
    c = config.resolved()
    r = c.rollout
    model = dataclasses.replace(model, remat=c.model.remat, frozen_layers=c.model.frozen_layers)
    tokens, y = r.max_prompt_tokens + r.max_response_tokens, r.max_response_tokens
    samples = c.n_tasks * c.group_size * r.max_steps  # step samples per update
    forwards = 1 + bool(c.loss.kl_coef) + (c.old_logprobs == "trainer")  # rollout, reference, old log-probs
    per_update = forwards * forward_flops(model, samples, tokens, y) + c.ppo_epochs * train_flops(
        model, samples, tokens, y
    )
    if c.uses_rubrics:
        rubric = c.rubric.max_new_tokens  # the with-rubric stream: the rubric, then the response
        per_update += c.ppo_epochs * forward_flops(model, samples, rubric + y, y, keys=tokens + rubric)
        if c.rubric.source == "policy":
            writing = c.rubric.max_prompt_tokens + c.rubric.max_new_tokens
            per_update += forward_flops(model, c.n_tasks * c.rubric.candidates, writing, c.rubric.max_new_tokens)
    evaluations = (c.updates - 1) // c.eval_every + 1 if c.eval_every else 1
    episodes = evaluations * len(c.eval_splits) * c.eval_games
    return c.updates * per_update + forward_flops(model, episodes * r.max_steps, tokens, y)


def gpu_hours(flops: float, peak: float = A100_BF16_FLOPS, utilization: float = UTILIZATION) -> float:
    return flops / (peak * utilization) / 3600


# The report.


def write_curves_csv(rows: Iterable[Row], path: pathlib.Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([field.name for field in dataclasses.fields(Row)])
        writer.writerows(dataclasses.astuple(r) for r in rows)


def panel_rows(rows: Iterable[Row], panel: Panel) -> list[Row]:
    """The rows a panel plots, as it plots them."""
    mine = [r for r in rows if r.metric == panel.metric]
    return [dataclasses.replace(r, value=1 - r.value) for r in mine] if panel.complement else mine


def pass_rows(passes: Mapping[RunSpec, Mapping[str, float]]) -> list[Row]:
    """``pass_success`` values as rows of ``PASS_PANEL``'s metric, the pass number in ``update``."""
    return [
        Row(run.method, run.seed, int(k.removeprefix("pass ")), PASS_PANEL.metric, v)
        for run, p in passes.items()
        for k, v in p.items()
        if k.startswith("pass ")
    ]


def plot_curves(
    rows: Sequence[Row], methods: Sequence[str], path: pathlib.Path, title: str, passes: Sequence[Row] = ()
) -> None:
    """One panel per ``PANELS`` entry (and ``PASS_PANEL`` with ``passes``, its rows): each method's
    mean over seeds, its bootstrap band shaded."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, nothing shown
    from matplotlib.ticker import MaxNLocator

    panels = PANELS + ((PASS_PANEL,) if passes else ())
    fig = Figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    for ax, panel in zip(fig.subplots(1, len(panels)), panels):
        points = curves(panel_rows([*rows, *passes], panel), [panel.metric])
        for i, method in enumerate(methods):
            mine = [p for p in points if p.method == method]
            if mine:  # a method may not log the metric (groups with a rubric: ORSD only)
                x = [p.update for p in mine]
                ax.plot(x, [p.interval.mean for p in mine], color=f"C{i}", label=method, marker=".")
                low, high = [p.interval.low for p in mine], [p.interval.high for p in mine]
                ax.fill_between(x, low, high, color=f"C{i}", alpha=0.2)
        ax.set(title=panel.title, xlabel=panel.x)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.axes[0].legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def _percent(x: float) -> str:
    return f"{round(100 * x, 1) + 0.0:.1f}"  # + 0.0: a difference of equal values prints 0.0, not -0.0


def _cell(i: Interval | None) -> str:
    return "-" if i is None else f"{_percent(i.mean)} [{_percent(i.low)}, {_percent(i.high)}]"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(cells) + " |" for cells in [header, ["---"] + ["---:"] * (len(header) - 1), *rows]]


def eval_splits(finals: Iterable[dict]) -> list[str]:
    """The evaluation splits of the final records (``eval/<split>/...``), in first-seen order."""
    return list(dict.fromkeys(k.split("/")[1] for f in finals for k in f if k.startswith("eval/")))


def method_table(
    per_run: Mapping[RunSpec, Mapping[str, Any]],
    methods: Sequence[str],
    columns: Mapping[str, str],
    paired: str | None = None,
) -> list[str]:
    """Rows: methods; columns: title -> a key of each run's values (its final record, say), each cell
    the mean [interval] over seeds in percent (``paired``: of the difference to that method's run of
    the same seed)."""
    stats = []
    for key in columns.values():
        values = {run: f[key] for run, f in per_run.items() if f.get(key) is not None}
        stats.append(by_method(values) if paired is None else paired_differences(values, paired))
    rows = [
        [m, str(max((s[m].n for s in stats if m in s), default=0)), *(_cell(s.get(m)) for s in stats)]
        for m in methods
        if m != paired
    ]
    return _table(["method", "seeds" if paired is None else "pairs", *columns], rows)


def pairings(methods: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The paired tables: (baseline, the methods compared with it): every method with GRPO, and
    ORSD's ablations with ORSD."""
    out = [(BASELINE, tuple(methods))] if BASELINE in methods and len(methods) > 1 else []
    ablations = tuple(m for m in methods if m in ABLATIONS)
    return out + ([(ORSD, ablations)] if ORSD in methods and ablations else [])


def final_markdown(
    plan: StudyPlan,
    records: Mapping[RunSpec, Sequence[dict]],
    configs: Mapping[RunSpec, dict],
    passes: Mapping[RunSpec, Mapping[str, float]],
) -> str:
    """``final.md``: final evaluation per split and task type, paired differences to the baseline,
    training success per pass over the pool (``passes``: each run's ``pass_success``), and each run's
    interaction budget and time (``configs``: the runs' config.json)."""
    finals = {run: f for run, rs in records.items() if (f := final_record(rs)) is not None}
    splits, seeds = eval_splits(finals.values()), ", ".join(map(str, plan.seeds))
    lines = [
        f"# {plan.env}, preset {plan.preset}, {plan.updates} updates: {', '.join(plan.methods)} x seeds {seeds}",
        "",
        f"Mean over seeds [{LEVEL:.0%} percentile bootstrap interval over seeds, {RESAMPLES} resamples], in percent.",
    ]
    unfinished = [run.name for run in plan.runs() if run not in finals]
    if unfinished:
        lines += ["", f"Runs without a final evaluation (left out): {', '.join(unfinished)}."]
    initial = any(run.method == INITIAL for run in finals)
    names = [*plan.methods, *([INITIAL] if initial else [])]
    if initial:
        lines += ["", f"`{INITIAL}`: the initial policy, evaluated per seed as that seed's runs evaluate theirs."]
    success = {s: f"eval/{s}/success/All" for s in splits}
    valid = {s: f"eval/{s}/valid_step_rate" for s in splits}
    lines += ["", "## Evaluation success (%)", "", *method_table(finals, names, success)]
    lines += ["", "## Valid answers in evaluation (%)", "", *method_table(finals, names, valid)]
    for s in splits:
        prefix = f"eval/{s}/success/"
        logged = [k for f in finals.values() for k, v in f.items() if k.startswith(prefix) and v is not None]
        types = {k.removeprefix(prefix): k for k in dict.fromkeys(logged)}
        if len(types) > 1:  # task types besides "All"
            lines += ["", f"## {s}: success per task type (%)", "", *method_table(finals, names, types)]
    if initial:
        title = "## Paired difference to the initial policy (percentage points, same seed)"
        lines += ["", title, "", *method_table(finals, plan.methods, success, paired=INITIAL)]
    for baseline, methods in pairings(plan.methods):
        title = f"## Paired difference to {baseline} (percentage points, same seed)"
        lines += ["", title, "", *method_table(finals, methods, success, paired=baseline)]
    if passes:
        columns = {k: k for k in dict.fromkeys(k for p in passes.values() for k in p)}
        pool, n_tasks = (configs[next(iter(passes))][k] for k in ("env", "n_tasks"))
        lines += [
            "",
            "## Training success per pass over the pool (%)",
            "",
            f"A pass is {pool['train_pool'] // n_tasks} update(s): each of the pool's {pool['train_pool']} games "
            "played once, in groups; `last - first` is each run's change on the same games (runs still training "
            "included).",
            "",
            *method_table(passes, plan.methods, columns),
        ]
        for baseline, methods in pairings(plan.methods):
            lines += ["", f"Paired difference to {baseline} (percentage points, same seed):", ""]
            lines += method_table(passes, methods, columns, paired=baseline)
    rows = []
    for run, rs in records.items():
        if run.method == INITIAL:  # no training
            continue
        c = configs[run]
        b = budget(rs, c["n_tasks"] * c["group_size"])
        rows.append(
            [
                run.name,
                str(b.updates),
                str(b.episodes),
                f"{b.env_steps:.0f}",
                f"{b.generated_tokens:.0f}",
                f"{b.verifier_calls:.0f}",
                f"{b.update_seconds / 60:.1f}",
                "-" if b.highest_invalid_rate is None else _percent(b.highest_invalid_rate),
            ]
        )
    header = [
        "run",
        "updates",
        "episodes",
        "env steps",
        "generated tokens",
        "verifier calls",
        "update time (min)",
        "highest invalid share (%)",
    ]
    note = (
        "Summed over training updates from metrics.jsonl (rollout/env_steps, rollout/generated_tokens, verifier/calls, "
        "time/update); evaluation and start-up are not included. The highest invalid share is env/invalid_rate's "
        "maximum over the updates."
    )
    lines += ["", "## Interaction budget and time per run", "", note, "", *_table(header, rows)]
    stages = {run: st for run, rs in records.items() if (st := rubric_stage(rs, configs[run]["n_tasks"]))}
    if stages:
        rows = [
            [
                run.name,
                f"{st.with_rubric:.0f} of {st.groups}",
                f"at least {st.unmixed_with_rubric}",
                "-" if st.correlation is None else f"{st.correlation:+.2f}",
                f"{st.negative_updates} of {st.correlated_updates}",
                f"{st.memory_wins:.0f} of {st.memory_offered:.0f}" if st.memory_offered else "-",
            ]
            for run, st in stages.items()
        ]
        header = [
            "run",
            "groups with a rubric",
            "of them without a mixed outcome",
            "chosen correlation, mean over updates",
            "updates with a negative one",
            "remembered bundle selected, of offered",
        ]
        note = (
            "Over training updates from metrics.jsonl: rubric/groups_with_rubric; an update's groups with a rubric "
            "less its mixed groups (env/mixed_groups x tasks) where positive; rubric/chosen_correlation (the selected "
            "bundles' Spearman correlation with the returns, an update's mean); rubric/memory/wins and /offered."
        )
        lines += ["", "## Rubric stage per run", "", note, "", *_table(header, rows)]
    return "\n".join(lines) + "\n"


def write_report(plan: StudyPlan) -> tuple[pathlib.Path, ...]:
    """``curves.csv``, ``curves.png`` and ``final.md`` in ``plan.out`` from the runs' records."""
    records = {run: rs for run in plan.runs() + plan.initial_runs() if (rs := read_records(run.directory))}
    if not records:
        raise FileNotFoundError(f"no run of the study in {plan.out / 'runs'} has logged metrics")
    configs = {run: json.loads((run.directory / "config.json").read_text()) for run in records}
    rows = [row for run, rs in records.items() for row in tidy(run, rs)]
    csv_path, png_path, md_path = plan.out / "curves.csv", plan.out / "curves.png", plan.out / "final.md"
    write_curves_csv(rows, csv_path)
    title = f"{plan.env}, preset {plan.preset}: mean over seeds, {LEVEL:.0%} bootstrap band"
    passes = {run: p for run, rs in records.items() if (p := pass_success(rs, configs[run]))}
    plot_curves(rows, plan.methods, png_path, title, pass_rows(passes))
    md_path.write_text(final_markdown(plan, records, configs, passes))
    return csv_path, png_path, md_path
