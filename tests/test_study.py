"""The multi-seed study: its statistics against hand-computed values on fabricated records, the
report, the run states, the grid's dry run, and a tiny grid end to end with one run killed."""

import csv
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

from experiments import study as cli
from orsd_jax import estimate, study
from orsd_jax.config import from_json, preset, to_json

REPO = pathlib.Path(__file__).resolve().parent.parent
SEEDS = (0, 1, 2)


def _write_run(out: pathlib.Path, method: str, seed: int, records: list[dict], **config) -> pathlib.Path:
    directory = out / "runs" / f"{method}-seed{seed}"
    directory.mkdir(parents=True)
    c = dataclasses.replace(preset("tiny"), method=method, seed=seed, updates=3, **config)
    (directory / "config.json").write_text(to_json(c))
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _records(method: str, seed: int) -> list[dict]:
    """3 updates and the final evaluation. Training success 0.1 u + 0.1 s (+0.2 for ORSD); every
    seed answers half its steps validly; final success on valid_seen 0.2 + 0.1 s (+0.3 for ORSD,
    the same gain on every seed); valid_unseen 0, 0, 0.5 for GRPO and 0.5 for every ORSD seed."""
    orsd = method == "orsd"
    train = [
        {
            "update": u,
            "env/success": 0.1 * u + 0.1 * seed + 0.2 * orsd,
            "env/invalid_rate": 0.5,
            "rollout/env_steps": 10.0 + seed,
            "rollout/generated_tokens": 100.0,
            "time/update": 60.0,
            "loss/ref_kl": None,
            **({"rubric/groups_with_rubric": 1.0, "verifier/calls": 4.0} if orsd else {}),
        }
        for u in (1, 2, 3)
    ]
    seen = 0.2 + 0.1 * seed + 0.3 * orsd
    final = {
        "update": 3,
        "final": True,
        "eval/valid_seen/success/All": seen,
        "eval/valid_seen/success/Look": seen,
        "eval/valid_seen/success/Pick": None,
        "eval/valid_seen/valid_step_rate": 0.9,
        "eval/valid_unseen/success/All": 0.5 if orsd or seed == 2 else 0.0,
        "eval/valid_unseen/valid_step_rate": 0.8,
    }
    return [*train, final]


@pytest.fixture
def fabricated(tmp_path) -> study.StudyPlan:
    """2 methods x 3 seeds x 3 updates of records with easy means."""
    for method in ("grpo", "orsd"):
        for seed in SEEDS:
            _write_run(tmp_path, method, seed, _records(method, seed))
    return study.StudyPlan("alfworld", "tiny", ("grpo", "orsd"), SEEDS, 3, tmp_path)


# Statistics.


@pytest.mark.parametrize(
    "values, want",
    [
        ([0.7, 0.7, 0.7], (0.7, 0.7, 0.7)),  # identical seeds: zero width
        ([3.0], (3.0, 3.0, 3.0)),  # one seed: the point
        ([0.2, 0.6], (0.4, 0.2, 0.6)),  # two seeds: each all-one-value resample has probability 1/4
        ([1.0, 2.0, 3.0], (2.0, 1.0, 3.0)),  # three: 1/27 > 2.5%
        # One 10 among ten 0s: resample means are k ~ Binomial(10, 0.1); P(k = 0) = 0.35, so the 2.5th
        # percentile is 0; P(k <= 2) = 0.930 < 0.975 <= P(k <= 3) = 0.987, so the 97.5th is 3.
        ([0.0] * 9 + [10.0], (1.0, 0.0, 3.0)),
    ],
)
def test_bootstrap_interval_against_hand_computed_values(values, want):
    i = study.bootstrap_interval(values)
    assert (i.mean, i.low, i.high) == pytest.approx(want, abs=1e-12)
    assert i.n == len(values)


def test_bootstrap_interval_is_reproducible_and_refuses_nothing():
    values = [0.1, 0.5, 0.2, 0.9, 0.4]
    assert study.bootstrap_interval(values) == study.bootstrap_interval(values)
    with pytest.raises(ValueError, match="no values"):
        study.bootstrap_interval([])


def test_curves_are_means_over_seeds_with_their_intervals(fabricated):
    rows = [row for run in fabricated.runs() for row in study.tidy(run, study.read_records(run.directory))]
    points = {(p.method, p.update): p.interval for p in study.curves(rows, ["env/success"])}
    assert sorted(points) == [(m, u) for m in ("grpo", "orsd") for u in (1, 2, 3)]
    for u in (1, 2, 3):  # seeds at 0.1 u + {0, 0.1, 0.2}: three seeds span [min, max]
        g, o = points["grpo", u], points["orsd", u]
        assert (g.mean, g.low, g.high, g.n) == pytest.approx((0.1 * u + 0.1, 0.1 * u, 0.1 * u + 0.2, 3))
        assert (o.mean, o.low, o.high) == pytest.approx((0.1 * u + 0.3, 0.1 * u + 0.2, 0.1 * u + 0.4))
    valid = study.curves(study.panel_rows(rows, study.PANELS[2]), ["env/invalid_rate"])
    assert {(p.interval.mean, p.interval.low, p.interval.high) for p in valid} == {(0.5, 0.5, 0.5)}
    # A null (the log's NaN) is no observation; ORSD alone logs the rubric stage.
    assert not [r for r in rows if r.metric == "loss/ref_kl"]
    assert {p.method for p in study.curves(rows, ["rubric/groups_with_rubric"])} == {"orsd"}


def test_paired_differences_remove_the_seed_to_seed_spread(fabricated):
    finals = {run: study.final_record(study.read_records(run.directory)) for run in fabricated.runs()}
    values = {run: f["eval/valid_seen/success/All"] for run, f in finals.items()}
    unpaired = study.by_method(values)["orsd"]
    assert (unpaired.mean, unpaired.low, unpaired.high) == pytest.approx((0.6, 0.5, 0.7))
    ((method, paired),) = study.paired_differences(values).items()
    assert method == "orsd" and (paired.mean, paired.low, paired.high, paired.n) == pytest.approx((0.3, 0.3, 0.3, 3))
    # Seeds without a baseline run are not paired.
    del values[next(run for run in values if run.method == "grpo" and run.seed == 2)]
    assert study.paired_differences(values)["orsd"].n == 2


def test_rubric_stage_against_hand_counts():
    """Two tasks an update: 2 groups with a rubric and half the groups mixed leave at least 1 without a
    mixed outcome; an update without a correlation is left out of its mean; GRPO has no stage."""
    records = [
        {"update": 1, "rubric/groups_with_rubric": 2.0, "env/mixed_groups": 0.5, "rubric/chosen_correlation": -0.4},
        {"update": 2, "rubric/groups_with_rubric": 0.0, "env/mixed_groups": 0.0, "rubric/chosen_correlation": None},
        {
            "update": 3,
            "rubric/groups_with_rubric": 1.0,
            "env/mixed_groups": 1.0,
            "rubric/chosen_correlation": 0.6,
            "rubric/memory/offered": 2.0,
            "rubric/memory/wins": 1.0,
        },
        {"final": True, "rubric/groups_with_rubric": 2.0},
    ]
    assert study.rubric_stage(records, n_tasks=2) == study.RubricStage(
        groups=6,
        with_rubric=3.0,
        unmixed_with_rubric=1,
        correlation=pytest.approx(0.1),
        negative_updates=1,
        correlated_updates=2,
        memory_offered=2.0,
        memory_wins=1.0,
    )
    assert study.rubric_stage([{"update": 1, "env/success": 0.5}], n_tasks=2) is None


def test_budget_sums_the_training_updates(fabricated):
    run = fabricated.runs()[-1]  # orsd, seed 2
    assert study.budget(study.read_records(run.directory), episodes_per_update=4) == study.Budget(
        updates=3,
        episodes=12,
        env_steps=36.0,
        generated_tokens=300.0,
        verifier_calls=12.0,
        update_seconds=180.0,
        highest_invalid_rate=0.5,
    )
    # The highest invalid share: the final evaluation's record and unlogged updates left out.
    records = [
        {"update": 1, "env/invalid_rate": 0.25},
        {"update": 2, "env/invalid_rate": None},
        {"update": 3, "env/invalid_rate": 0.75},
        {"update": 3, "final": True, "env/invalid_rate": 0.9},
    ]
    assert study.budget(records, episodes_per_update=4).highest_invalid_rate == 0.75
    assert study.budget([{"update": 1}], episodes_per_update=4).highest_invalid_rate is None


# The report.


def test_report_files_from_fabricated_records(fabricated):
    csv_path, png_path, md_path = study.write_report(fabricated)
    rows = list(csv.DictReader(csv_path.open()))
    assert list(rows[0]) == ["method", "seed", "update", "metric", "value"]
    # Per run: 3 updates x (5 metrics, 7 for ORSD; the null left out) and 5 non-null final metrics.
    assert len(rows) == 3 * (3 * 5 + 5) + 3 * (3 * 7 + 5)
    assert {"method": "grpo", "seed": "0", "update": "1", "metric": "env/success", "value": "0.1"} in rows
    assert png_path.stat().st_size > 10_000
    md = md_path.read_text()
    assert "| grpo | 3 | 30.0 [20.0, 40.0] | 16.7 [0.0, 50.0] |" in md  # success: valid_seen, valid_unseen
    assert "| orsd | 3 | 60.0 [50.0, 70.0] | 50.0 [50.0, 50.0] |" in md
    assert "| grpo | 3 | 90.0 [90.0, 90.0] | 80.0 [80.0, 80.0] |" in md  # valid answers
    assert "## valid_seen: success per task type (%)" in md and "| method | seeds | All | Look |" in md
    assert "## valid_unseen: success per task type" not in md  # "All" only
    assert "| orsd | 3 | 30.0 [30.0, 30.0] | 33.3 [0.0, 50.0] |" in md  # paired to GRPO, seed by seed
    # budget: updates, episodes, steps, tokens, calls, min, highest invalid share
    assert "| orsd-seed2 | 3 | 12 | 36 | 300 | 12 | 3.0 | 50.0 |" in md
    assert "| grpo-seed0 | 3 | 12 | 30 | 300 | 0 | 3.0 | 50.0 |" in md
    # rubric stage: 1 group of 2 an update with a rubric, no mixed outcome logged, no correlation, no memory
    assert "| orsd-seed2 | 3 of 6 | at least 3 | - | 0 of 0 | - |" in md and "| grpo-seed0 | 3 of" not in md
    assert "without a final evaluation" not in md
    assert "per pass over the pool" not in md  # no pool: every update draws other games


def test_training_success_per_pass_over_a_pool(tmp_path):
    """With a pool of 2 games and 2 tasks an update, each update is a pass over the pool."""
    pool = dataclasses.replace(preset("tiny").env, train_pool=2)
    for method in ("grpo", "orsd"):
        for seed in SEEDS:
            _write_run(tmp_path, method, seed, _records(method, seed), env=pool)
    _, png, md_path = study.write_report(study.StudyPlan("alfworld", "tiny", ("grpo", "orsd"), SEEDS, 3, tmp_path))
    md = md_path.read_text()
    assert "| method | seeds | pass 1 | pass 2 | pass 3 | last - first |" in md
    assert Image.open(png).size[0] == round(4.2 * 120 * (len(study.PANELS) + 1))  # the panel per pass too
    # Training success 0.1 u + 0.1 s (+0.2 for ORSD): each seed gains 0.2 from pass 1 to pass 3.
    assert "| grpo | 3 | 20.0 [10.0, 30.0] | 30.0 [20.0, 40.0] | 40.0 [30.0, 50.0] | 20.0 [20.0, 20.0] |" in md
    assert "| orsd | 3 | 40.0 [30.0, 50.0] | 50.0 [40.0, 60.0] | 60.0 [50.0, 70.0] | 20.0 [20.0, 20.0] |" in md
    assert "| orsd | 3 | 20.0 [20.0, 20.0] | 20.0 [20.0, 20.0] | 20.0 [20.0, 20.0] | 0.0 [0.0, 0.0] |" in md  # paired


def test_pass_rows_put_the_pass_where_the_update_goes():
    run = study.RunSpec("orsd", 2, pathlib.Path("r"))
    rows = study.pass_rows({run: {"pass 1": 0.25, "pass 2": 0.5, "last - first": 0.25}})
    assert rows == [study.Row("orsd", 2, 1, "pass/success", 0.25), study.Row("orsd", 2, 2, "pass/success", 0.5)]


def test_passes_are_complete_passes_of_a_pool_the_updates_divide():
    records = _records("grpo", 0)  # 3 updates: training success 0.1, 0.2, 0.3
    config = json.loads(
        to_json(dataclasses.replace(preset("tiny"), env=dataclasses.replace(preset("tiny").env, train_pool=4)))
    )
    assert study.pass_success(records, config) == pytest.approx({"pass 1": 0.15})  # updates 1-2; 3 alone is no pass
    config["env"]["train_pool"] = 3  # 2 tasks an update do not divide 3 games into passes
    assert study.pass_success(records, config) == {}
    config["env"]["train_pool"] = None
    assert study.pass_success(records, config) == {}


def test_the_initial_policy_is_a_row_and_a_baseline(fabricated):
    """With the initial policy evaluated per seed (valid_seen 0.1 s), the tables gain its row and the
    methods' paired differences to it."""
    for seed in SEEDS:
        run = fabricated.out / "initial" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(
            to_json(dataclasses.replace(preset("tiny"), method="grpo", seed=seed, updates=0))
        )
        final = {
            "update": 0,
            "final": True,
            "eval/valid_seen/success/All": 0.1 * seed,
            "eval/valid_unseen/success/All": 0.0,
        }
        (run / "metrics.jsonl").write_text(json.dumps(final) + "\n")
    md = study.write_report(fabricated)[2].read_text()
    assert "| initial | 3 | 10.0 [0.0, 20.0] | 0.0 [0.0, 0.0] |" in md  # success: valid_seen, valid_unseen
    paired = md.split("## Paired difference to the initial policy")[1].split("##")[0]
    # valid_seen: GRPO 0.2 + 0.1 s, ORSD 0.5 + 0.1 s, each against the initial 0.1 s of its seed.
    assert "| grpo | 3 | 20.0 [20.0, 20.0] | 16.7 [0.0, 50.0] |" in paired
    assert "| orsd | 3 | 50.0 [50.0, 50.0] | 50.0 [50.0, 50.0] |" in paired
    assert "| initial-seed" not in md  # no training budget: 0 updates


def test_the_study_found_in_a_directory_has_the_initial_policys_seeds_too(fabricated):
    run = fabricated.out / "initial" / "seed3"  # evaluated before any trained run of seed 3 finished
    run.mkdir(parents=True)
    (run / "config.json").write_text(to_json(dataclasses.replace(preset("tiny"), method="grpo", seed=3, updates=0)))
    assert study.discover(fabricated.out) == dataclasses.replace(fabricated, seeds=(0, 1, 2, 3))


def test_report_names_runs_without_a_final_evaluation(fabricated):
    unfinished = fabricated.runs()[0].directory / "metrics.jsonl"
    unfinished.write_text("".join(line + "\n" for line in unfinished.read_text().splitlines()[:-1]))
    md = study.write_report(fabricated)[2].read_text()
    assert "Runs without a final evaluation (left out): grpo-seed0." in md
    assert "| grpo | 2 | 35.0 [30.0, 40.0] |" in md and "| orsd | 2 | 30.0 [30.0, 30.0] |" in md


def test_aggregate_only_finds_the_runs_and_rewrites_the_report(fabricated, capsys):
    assert study.discover(fabricated.out) == fabricated
    cli.main(["--out", str(fabricated.out), "--aggregate-only"])
    assert "final.md" in capsys.readouterr().out and (fabricated.out / "curves.png").is_file()
    cli.main(["--out", str(fabricated.out), "--aggregate-only", "--methods", "orsd"])
    assert "| grpo |" not in (fabricated.out / "final.md").read_text()


def test_ablations_are_paired_with_orsd_in_one_report_of_the_directory(fabricated):
    """An ablation run later into the same directory (valid_seen: ORSD's, +10 points on seeds 1 and 2)
    joins the report, paired with GRPO like every method and with ORSD like its ablations."""
    for seed in SEEDS:
        records = _records("orsd", seed)
        records[-1] = records[-1] | {"eval/valid_seen/success/All": 0.5 + 0.1 * seed + 0.1 * (seed > 0)}
        _write_run(fabricated.out, "orsd-memory-candidate", seed, records)
    plan = study.discover(fabricated.out)
    assert plan.methods == ("grpo", "orsd", "orsd-memory-candidate")
    md = study.write_report(plan)[2].read_text()
    to_orsd = md.split("## Paired difference to orsd ")[1].split("##")[0]
    assert "| orsd-memory-candidate | 3 | 6.7 [0.0, 10.0] | 0.0 [0.0, 0.0] |" in to_orsd  # valid_seen, valid_unseen
    assert "| grpo |" not in to_orsd
    to_grpo = md.split("## Paired difference to grpo ")[1].split("##")[0]
    assert (
        "| orsd | 3 | 30.0 [30.0, 30.0] |" in to_grpo and "| orsd-memory-candidate | 3 | 36.7 [30.0, 40.0] |" in to_grpo
    )
    with pytest.raises(SystemExit, match="holds a study of alfworld, preset tiny, 3 updates"):
        cli.main(["--preset", "tiny", "--updates", "5", "--methods", "orsd", "--seeds", "0", "--out", str(plan.out)])


# Runs on disk and the grid.


def test_run_state_reads_the_final_record_and_complete_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert study.run_state(run) == "new"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text(json.dumps({"update": 1}) + "\n")
    assert study.run_state(run) == "new"  # killed before its first checkpoint
    (run / "checkpoints" / "1.orbax-checkpoint-tmp-5").mkdir(parents=True)
    assert study.run_state(run) == "new"  # a checkpoint Orbax had not renamed into place
    (run / "checkpoints" / "1").mkdir()
    assert study.run_state(run) == "resume"
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"update": 1, "final": True}) + "\n")
    assert study.run_state(run) == "finished"


def test_config_differences_name_nested_fields():
    saved = {"a": 1, "b": {"c": 2, "d": 3}}
    assert study.config_differences(saved, saved) == ()
    assert study.config_differences(saved, {"a": 1, "b": {"c": 2, "d": 4}, "e": 5}) == ("b.d", "e")


def test_the_grid_skips_finished_runs_and_refuses_another_protocols(fabricated):
    plan = dataclasses.replace(fabricated, overrides=("--eval-games", "2"))  # tiny's own
    run = plan.runs()[0]
    config = cli.run_config(plan, run)
    assert config.method == run.method and config.seed == run.seed and config.updates == 3
    assert cli.execute(plan, run, config, cli.Processes()) == cli.Outcome(run, "skipped", 0, 0.0)
    older = json.loads((run.directory / "config.json").read_text())  # written before env.goals existed
    del older["env"]["goals"]
    (run.directory / "config.json").write_text(json.dumps(older))
    assert cli.execute(plan, run, config, cli.Processes()) == cli.Outcome(run, "skipped", 0, 0.0)
    # Rows packed otherwise (the same loss): the same protocol, still finished.
    repacked = dataclasses.replace(config, pack_rows=not config.pack_rows, row_tokens=config.row_tokens + 512)
    assert cli.execute(plan, run, repacked, cli.Processes()) == cli.Outcome(run, "skipped", 0, 0.0)
    other = cli.run_config(dataclasses.replace(plan, overrides=("--lr", "0.5")), run)
    outcome = cli.execute(plan, run, other, cli.Processes())
    assert (outcome.action, outcome.returncode) == ("refused", 1) and "optimizer.learning_rate" in outcome.note
    assert not (plan.out / "logs").exists()  # nothing started


def test_the_grid_resumes_from_a_checkpoint_and_starts_over_without_one(fabricated, monkeypatch):
    """The trainer module replaced by one that does not exist: each run's process fails at once, after
    the study has prepared its directory and logged its command line."""
    monkeypatch.setitem(cli.TRAINERS, "alfworld", "no_such_trainer_module")
    checkpointed, partial = fabricated.runs()[:2]
    for run in (checkpointed, partial):
        records = study.read_records(run.directory)[:1]  # killed after update 1
        (run.directory / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    (checkpointed.directory / "checkpoints" / "1").mkdir(parents=True)
    for run, action in [(checkpointed, "resumed"), (partial, "started")]:
        outcome = cli.execute(fabricated, run, cli.run_config(fabricated, run), cli.Processes())
        assert (outcome.action, outcome.returncode) == (action, 1)
        log = (fabricated.out / "logs" / f"{run.name}.log").read_text()
        assert log.startswith(f"$ python -m no_such_trainer_module --preset tiny --updates 3 --method {run.method} ")
        assert log.splitlines()[0].endswith(" --resume") == (action == "resumed") and "No module named" in log
    assert (checkpointed.directory / "metrics.jsonl").is_file()
    assert not partial.directory.exists()  # nothing to resume: removed, so the run starts over cleanly
    assert not list((fabricated.out / "logs").glob("*.pid"))


@pytest.mark.parametrize("flag", [["--seed", "3"], ["--method", "grpo"], ["--resume"]])
def test_per_run_flags_are_the_studys(flag, tmp_path):
    with pytest.raises(SystemExit, match="set by the study"):
        cli.main(["--preset", "tiny", "--methods", "grpo", "--seeds", "0", "--out", str(tmp_path), *flag])


def test_dry_run_plans_a_paper_grid_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "study"
    with pytest.raises(SystemExit) as exit_:
        cli.main(
            [
                "--preset",
                "paper-qwen3-1.7b",
                "--methods",
                "grpo,orsd",
                "--seeds",
                "0,1,2",
                "--out",
                str(out),
                "--dry-run",
            ]
        )
    text = capsys.readouterr().out
    assert exit_.value.code == 0, text
    assert "study: alfworld, preset paper-qwen3-1.7b, 300 updates, 2 methods x 3 seeds = 6 runs" in text
    for method in ("grpo", "orsd"):  # each method's own plan, from experiments.common.plan
        assert f"preset paper-qwen3-1.7b, method {method}, environment alfworld, model Qwen/Qwen3-1.7B" in text
    assert text.count("interaction budget: 300 updates x 8 tasks x 8 rollouts = 19200 episodes") == 2
    assert "rubrics: 9600 candidate bundles" in text  # ORSD's rubric stage, in its plan only
    runs = [line.split() for line in text.splitlines() if line.startswith(("grpo-seed", "orsd-seed"))]
    want = [[f"{m}-seed{s}", "new", "4", "19200", "960000"] for s in SEEDS for m in ("grpo", "orsd")]  # seed by seed
    assert [r[:5] for r in runs] == want
    hours = {r[0].split("-")[0]: float(r[5]) for r in runs}
    assert 0 < hours["grpo"] < hours["orsd"]  # the with-rubric pass and the rubric writing cost more
    assert "total: 6 runs, 115200 training episodes, at most 5760000 environment steps" in text
    assert "devices: 4 per run, 4 at once with --parallel 1" in text and "GPU hours: about" in text
    assert not out.exists()


def test_the_cpu_study_preset_is_the_calibration_that_learned():
    """The preset runs the recorded command of calibration attempt 7 (docs/results/study.md), with the
    study's own evaluation, length and credit records."""
    recorded = (REPO / "docs/results/study/calibration/grpo-pool8-2x8-lr2e-4/config.json").read_text()
    saved = json.loads(to_json(from_json(recorded)))  # fields added since then at their defaults
    planned = json.loads(to_json(dataclasses.replace(preset("cpu-study"), method="grpo")))
    assert study.protocol_differences(saved, planned) == (
        "credit_every",
        "env.eval_games",
        "eval_games",
        "preset",
        "updates",
    )


def test_gpu_hours_scale_with_the_work():
    c = preset("paper-qwen3-1.7b")
    one = study.run_flops(estimate.QWEN3_1_7B, c)
    # Twice the layers, twice the work less the (unchanged) LM head's share.
    deeper = dataclasses.replace(estimate.QWEN3_1_7B, num_layers=2 * estimate.QWEN3_1_7B.num_layers)
    assert 1.7 * one < study.run_flops(deeper, c) < 2 * one
    assert study.run_flops(estimate.QWEN3_1_7B, dataclasses.replace(c, updates=600)) == pytest.approx(2 * one, rel=0.01)
    assert study.run_flops(estimate.QWEN3_1_7B, dataclasses.replace(c, method="orsd")) > study.run_flops(
        estimate.QWEN3_1_7B, dataclasses.replace(c, method="grpo")
    )  # the with-rubric stream and the writing
    assert study.gpu_hours(study.A100_BF16_FLOPS * study.UTILIZATION * 3600) == pytest.approx(1.0)


# A tiny grid end to end.


def _updates(run: pathlib.Path) -> list[tuple[int, bool]]:
    return [(r["update"], bool(r.get("final"))) for r in study.read_records(run)]


@pytest.mark.slow
def test_tiny_grid_survives_a_killed_run_and_resumes_it(tmp_path):
    """2 methods x 2 seeds x 2 updates and the initial policy's evaluation per seed, four at once; one
    run's process is SIGKILLed after its first checkpoint; the study finishes the others; the same
    command again resumes the killed one, is stopped by SIGTERM while it runs, and a third time
    finishes it."""
    out = tmp_path / "study"
    grid = ["--preset", "tiny", "--methods", "grpo,orsd", "--seeds", "0,1", "--updates", "2", "--parallel", "4"]
    command = [sys.executable, "-m", "experiments.study", *grid, "--eval-games", "1", "--out", str(out)]
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = out / "runs" / "grpo-seed0"
    deadline = time.time() + 600
    while not (victim / "checkpoints" / "1").is_dir():  # Orbax renames a checkpoint into place when complete
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.time() < deadline, "no first checkpoint within 10 minutes"
        time.sleep(0.1)
    os.kill(int((out / "logs" / "grpo-seed0.pid").read_text()), signal.SIGKILL)
    output, _ = first.communicate(timeout=900)
    assert first.returncode == 1, output[-3000:]
    assert "grpo-seed0: started, FAILED (exit -9)" in output and "1 of 6 runs did not finish (grpo-seed0)" in output
    killed = study.read_records(victim)
    assert [u for u, final in _updates(victim) if final] == [] and killed[0]["update"] == 1
    plan = study.StudyPlan("alfworld", "tiny", ("grpo", "orsd"), (0, 1), 2, out)
    others = [r for r in plan.jobs() if r.directory != victim]
    assert [study.run_state(r.directory) for r in others] == ["finished"] * 5

    # SIGTERM to the study while the resumed run is in flight: the run unwinds, nothing else starts.
    second = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert second.stdout is not None
    seen = []
    for line in iter(second.stdout.readline, ""):
        seen.append(line)
        if line.startswith("grpo-seed0: resumed"):
            break
    run_pid = int((out / "logs" / "grpo-seed0.pid").read_text())
    second.send_signal(signal.SIGTERM)
    output = "".join(seen) + second.communicate(timeout=300)[0]
    assert second.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "grpo-seed0: resumed, stopped" in output and "run the same command again to resume them" in output
    assert study.run_state(victim) == "resume" and not list((out / "logs").glob("*.pid"))
    with pytest.raises(ProcessLookupError):
        os.kill(run_pid, 0)

    third = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert third.returncode == 0, (third.stdout + third.stderr)[-3000:]
    assert "grpo-seed0: resumed, finished" in third.stdout
    assert all(f"{r.name}: skipped, finished" in third.stdout for r in others)
    for run in (victim, *(r.directory for r in plan.runs() if r.directory != victim)):
        assert _updates(run) == [(1, False), (2, False), (2, True)], run.name
    for run in plan.initial_runs():  # an evaluation at update 0, with that seed's runs' sampling
        assert _updates(run.directory) == [(0, True)] and study.read_records(run.directory)[0]["update"] == 0
    assert study.read_records(victim)[0] == killed[0]  # continued from its checkpoint, not started over
    assert not list((out / "logs").glob("*.pid"))
    rows = list(csv.DictReader((out / "curves.csv").open()))
    assert {(r["method"], r["seed"]) for r in rows} == {(m, s) for m in ("grpo", "orsd", "initial") for s in ("0", "1")}
    assert {r["update"] for r in rows if r["metric"] == "env/success"} == {"1", "2"}
    md = (out / "final.md").read_text()
    assert "| grpo | 2 |" in md and "| orsd | 2 |" in md and "| initial | 2 |" in md
    assert "## Paired difference to grpo" in md and "## Paired difference to the initial policy" in md
