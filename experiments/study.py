"""A multi-seed study: every method x seed of a grid as a normal run directory, then one report.

    python -m experiments.study --env alfworld --preset cpu-study --methods grpo,gigpo,orsd,orsd-oracle \\
        --seeds 0,1,2 --out runs/study
    python -m experiments.study --preset paper-qwen3-1.7b --methods grpo,orsd --seeds 0,1,2 --out runs/paper --dry-run
    python -m experiments.study --out runs/study --aggregate-only      # the report again, from the records

Runs land in OUT/runs/<method>-seed<seed> (each one can be inspected, resumed and credit-reported on its
own), their console output in OUT/logs/<method>-seed<seed>.log (with the pid of a running one in .pid), the
initial policy's evaluation with each seed in OUT/initial/seed<seed> (a run of 0 updates: the same games and
sampling as that seed's final evaluations), the report in OUT/curves.csv, OUT/curves.png and OUT/final.md. A rerun skips finished runs, resumes killed
ones from their last checkpoint and starts over those that died before their first.

SIGTERM or SIGINT stops the study: its running runs unwind to their last checkpoint and no other
starts; the same command again resumes them.

Every other flag (--n-tasks, --group-size, --lr, --eval-games, --task-types, ...) goes to every run
unchanged: see ``python -m experiments.train_alfworld --help``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from experiments import common
from orsd_jax import estimate, study
from orsd_jax.config import ENVS, METHODS, PRESETS, TrainConfig, from_json, preset, to_json

TRAINERS = {"alfworld": "experiments.train_alfworld", "webshop": "experiments.train_webshop"}
PER_RUN = ("method", "seed", "out", "resume", "dry_run", "updates")  # training flags the study sets itself


@dataclasses.dataclass(frozen=True)
class Outcome:
    run: study.RunSpec
    action: str  # skipped (finished before), started, resumed, refused
    returncode: int  # 0: the run is finished
    seconds: float
    note: str = ""


def _methods(text: str) -> tuple[str, ...]:
    methods = tuple(m for m in text.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}; expected some of {', '.join(METHODS)}")
    return methods


def _seeds(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s)


def study_parser() -> argparse.ArgumentParser:
    # No abbreviations: "--seed 3" must not pass for "--seeds 3"; unknown flags are the runs'.
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--env", choices=ENVS, default="alfworld")
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: the trainer's for --env")
    p.add_argument("--methods", type=_methods, help="comma-separated, e.g. grpo,gigpo,orsd,orsd-oracle")
    p.add_argument("--seeds", type=_seeds, help="comma-separated, e.g. 0,1,2")
    p.add_argument("--updates", type=int, help="default: the preset's")
    p.add_argument("--out", required=True, help="the study's directory")
    p.add_argument("--parallel", type=int, default=1, help="runs at once, each in its own process")
    p.add_argument("--dry-run", action="store_true", help="print the grid's plan and budget; run nothing")
    p.add_argument("--aggregate-only", action="store_true", help="only write the report from the runs' records")
    return p


def run_args(plan: study.StudyPlan, run: study.RunSpec) -> list[str]:
    """The training command line of one run of the grid (the initial policy's: 0 updates of GRPO,
    which only evaluates)."""
    initial = run.method == study.INITIAL
    return [
        "--preset",
        plan.preset,
        "--updates",
        str(0 if initial else plan.updates),
        *plan.overrides,
        "--method",
        "grpo" if initial else run.method,
        "--seed",
        str(run.seed),
        "--out",
        str(run.directory),
    ]


def run_config(plan: study.StudyPlan, run: study.RunSpec) -> TrainConfig:
    """The config the trainer builds from ``run_args`` (and dumps as the run's config.json)."""
    return common.config_from_args(plan.env, common.parser(plan.env, "").parse_args(run_args(plan, run)))


def study_plan(args: argparse.Namespace, overrides: list[str]) -> study.StudyPlan:
    if not (args.methods and args.seeds):
        raise SystemExit("--methods and --seeds are needed to run or plan a study")
    given = vars(common.parser(args.env, "").parse_args(overrides))  # unknown or malformed training flags fail here
    for name in PER_RUN:
        if given[name] not in (None, False):
            raise SystemExit(f"--{name.replace('_', '-')} is set by the study for each run; leave it out")
    name = args.preset or common.parser(args.env, "").get_default("preset")
    updates = preset(name, args.env).updates if args.updates is None else args.updates
    out = pathlib.Path(args.out)
    if list(out.glob("runs/*/config.json")):  # one report covers the directory: one protocol in it
        found = study.discover(out)
        if (found.env, found.preset, found.updates) != (args.env, name, updates):
            raise SystemExit(
                f"{out} holds a study of {found.env}, preset {found.preset}, {found.updates} updates; this one is "
                f"{args.env}, preset {name}, {updates} updates: give it another --out"
            )
    return study.StudyPlan(args.env, name, args.methods, args.seeds, updates, out, tuple(overrides))


def dry_run(plan: study.StudyPlan, configs: dict[study.RunSpec, TrainConfig], parallel: int) -> tuple[str, bool]:
    """The grid's plan: each method's run plan (seeds share it), every run's state and budget, the totals."""
    runs = plan.runs()
    grid = f"{len(plan.methods)} methods x {len(plan.seeds)} seeds = {len(runs)} runs in {plan.out / 'runs'}"
    lines = [f"study: {plan.env}, preset {plan.preset}, {plan.updates} updates, {grid}"]
    fits = True
    for method in plan.methods:
        report, ok = common.plan(next(configs[run] for run in runs if run.method == method))
        fits &= ok
        lines += ["", f"== {method} (every seed: {', '.join(map(str, plan.seeds))}) ==", report]
    header = ("run", "state", "devices", "episodes", "env steps (at most)", "GPU hours")
    lines += ["", "{:<24} {:<9} {:>7} {:>9} {:>20} {:>10}".format(*header)]
    hours, episodes, steps = [], 0, 0
    for run in runs:
        c = configs[run].resolved()
        n = c.updates * c.n_tasks * c.group_size
        model = estimate.PAPER_MODELS.get(c.model.name)
        h = study.gpu_hours(study.run_flops(model, c)) if model else None
        hours.append(h)
        episodes, steps = episodes + n, steps + n * c.rollout.max_steps
        estimated = "-" if h is None else f"{h:.0f}"
        cells = (run.name, study.run_state(run.directory), c.devices or 1, n, n * c.rollout.max_steps, estimated)
        lines.append("{:<24} {:<9} {:>7} {:>9} {:>20} {:>10}".format(*cells))
    devices = max(c.devices or 1 for c in configs.values())
    at_once = devices * min(parallel, len(runs))
    lines += [
        "",
        f"initial policy: evaluated once per seed in {plan.out / 'initial'}, as the runs of that seed evaluate",
        f"total: {len(runs)} runs, {episodes} training episodes, at most {steps} environment steps",
        f"devices: {devices} per run, {at_once} at once with --parallel {parallel}",
    ]
    if None in hours:
        lines.append(f"GPU hours: not estimated (only for {', '.join(estimate.PAPER_MODELS)})")
    else:
        per_run = sum(hours) / len(hours) / devices
        peak = f"{study.UTILIZATION:.0%} of an A100's {study.A100_BF16_FLOPS / 1e12:.0f} TFLOP/s bfloat16 peak"
        bound = "every episode runs all its steps at full prompt and response length"
        total = f"GPU hours: about {sum(hours):.0f} in all, {per_run:.1f} h of wall time per run on {devices} devices"
        lines.append(f"{total} (an upper bound on the work: {bound}; at {peak})")
    return "\n".join(lines), fits


class Processes:
    """The runs' processes in flight. Once the study is asked to stop (SIGTERM or SIGINT), each gets
    SIGTERM, unwinding to its last checkpoint, and no other run starts: the same command resumes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.stopped_by: int | None = None

    def start(self, argv: list[str], log) -> subprocess.Popen | None:
        with self._lock:
            if self.stopped_by is not None:
                return None
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            self._running.add(process)
            return process

    def finished(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(process)

    def stop(self, signum: int, frame=None) -> None:
        with self._lock:
            self.stopped_by = signum
            for process in self._running:
                process.send_signal(signal.SIGTERM)


def execute(plan: study.StudyPlan, run: study.RunSpec, config: TrainConfig, processes: Processes) -> Outcome:
    """One run in its own process, so that a crash or a kill ends that run only."""
    state = study.run_state(run.directory)
    if state != "new":  # a run of another protocol must not be continued, or reported, as this one
        # Read as --resume reads it: fields added to TrainConfig since the run started are at their defaults.
        saved = json.loads(to_json(from_json((run.directory / "config.json").read_text())))
        differences = study.protocol_differences(saved, json.loads(to_json(config)))
        if differences:
            note = f"its config.json differs in {', '.join(differences)}: choose another --out"
            return Outcome(run, "refused", 1, 0.0, note)
    if state == "finished":
        return Outcome(run, "skipped", 0, 0.0)
    if processes.stopped_by is not None:
        return Outcome(run, "not started", 1, 0.0, "the study was stopped")
    if state == "new" and run.directory.exists():
        shutil.rmtree(run.directory)  # killed before its first checkpoint: nothing to resume
    args = ["-m", TRAINERS[plan.env], *run_args(plan, run), *(["--resume"] if state == "resume" else [])]
    logs = plan.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    action = "resumed" if state == "resume" else "started"
    started = time.monotonic()
    with open(logs / f"{run.name}.log", "a") as log:
        log.write(f"$ python {shlex.join(args)}\n")
        log.flush()
        process = processes.start([sys.executable, *args], log)
        if process is None:
            return Outcome(run, "not started", 1, 0.0, "the study was stopped")
        pid = logs / f"{run.name}.pid"
        pid.write_text(f"{process.pid}\n")
        print(f"{run.name}: {action}, log {logs / run.name}.log", flush=True)
        returncode = process.wait()
        processes.finished(process)
        pid.unlink()
    return Outcome(run, action, returncode, time.monotonic() - started)


def run_grid(
    plan: study.StudyPlan, configs: dict[study.RunSpec, TrainConfig], parallel: int, processes: Processes
) -> list[Outcome]:
    outcomes = []
    with concurrent.futures.ThreadPoolExecutor(max(parallel, 1)) as pool:
        futures = [pool.submit(execute, plan, run, configs[run], processes) for run in plan.jobs()]
        for future in concurrent.futures.as_completed(futures):
            o = future.result()
            done = "finished" if o.returncode == 0 else f"FAILED (exit {o.returncode}) {o.note}".rstrip()
            if o.returncode and processes.stopped_by is not None:
                done = "stopped" if o.action != "not started" else "waiting"
            print(f"{o.run.name}: {o.action}, {done}" + (f" after {o.seconds:.0f} s" if o.seconds else ""), flush=True)
            outcomes.append(o)
    return outcomes


def write_report(plan: study.StudyPlan) -> None:
    for path in study.write_report(plan):
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    args, overrides = study_parser().parse_known_args(argv)
    if args.aggregate_only:
        found = study.discover(pathlib.Path(args.out))
        write_report(dataclasses.replace(found, methods=args.methods or found.methods, seeds=args.seeds or found.seeds))
        return
    plan = study_plan(args, overrides)
    configs = {run: run_config(plan, run) for run in plan.jobs()}  # a bad flag fails before anything runs
    if args.dry_run:
        report, fits = dry_run(plan, configs, args.parallel)
        print(report)
        sys.exit(0 if fits else 2)
    processes = Processes()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, processes.stop)
    failed = [o.run.name for o in run_grid(plan, configs, args.parallel, processes) if o.returncode]
    if any(study.read_records(run.directory) for run in plan.jobs()):
        write_report(study.discover(plan.out))  # every method in the directory: ablations beside the main grid
    if processes.stopped_by is not None:
        print(
            f"stopped by {signal.Signals(processes.stopped_by).name}: {len(failed)} of {len(plan.jobs())} runs are "
            "not finished; run the same command again to resume them",
            file=sys.stderr,
        )
        sys.exit(128 + processes.stopped_by)
    if failed:
        sys.exit(
            f"{len(failed)} of {len(plan.jobs())} runs did not finish ({', '.join(failed)}): "
            "run the same command again to resume them"
        )


if __name__ == "__main__":
    main()
