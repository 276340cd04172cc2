"""Rubric sources: the oracle, another task's oracle bundle, a neutral text and users' files, in
training (tiny runs on ALFWorld and WebShop) and as the probe uses them."""

import dataclasses
import json

import pytest

from experiments.common import config_from_args, parser
from orsd_jax.config import preset
from orsd_jax.envs.base import Task
from orsd_jax.rubrics import RubricConfig, parse_bundle
from orsd_jax.rubrics import sources
from orsd_jax.rubrics.oracle import alfworld_oracle, webshop_oracle
from orsd_jax.trainer import train

TASKS = [Task("alfworld", f"k{i}", "look", d) for i, d in enumerate(["look at a book", "look at a pen", "look at a book"])]
BUNDLES = [tuple(f"Criterion {k} of task {i} is met" for k in range(5)) for i in range(3)]


def test_shuffled_takes_the_next_different_task():
    # Tasks 0 and 2 share a description: each takes the next group whose task differs.
    assert sources.shuffled(BUNDLES, TASKS) == [BUNDLES[1], BUNDLES[2], BUNDLES[1]]
    with pytest.raises(ValueError, match="two different tasks"):
        sources.shuffled(BUNDLES[:1], TASKS[:1])


def test_neutral_text_keeps_the_shape_and_says_nothing_about_the_task():
    oracle = ("Goes to the desk 1 before anything else", "Takes the statue 1 from the desk 1",
              "Uses the desklamp 1 while holding the statue 1", "Finishes the task in at most 3 actions",
              "Does not repeat an action that had no effect")  # fmt: skip
    neutral = sources.neutral_like(oracle)
    assert len(neutral) == len(oracle) and parse_bundle("\n".join(f"- {c}" for c in neutral)).valid
    for a, b in zip(neutral, oracle):
        assert abs(len(a) - len(b)) <= 12
    words = {w.lower() for c in oracle for w in c.split()}
    assert not {w.lower() for c in neutral for w in c.split()} & (words - {"the", "a", "an", "in", "of", "at", "to", "from", "and", "for"})


def test_file_source_checks_every_bundle(tmp_path):
    good = tmp_path / "rubrics.json"
    good.write_text(json.dumps({"k0": list(BUNDLES[0])}))
    assert sources.load_file(good) == {"k0": BUNDLES[0]}
    (picked,), (missing,), _ = sources.candidates("file", TASKS, rubrics=sources.load_file(good))
    assert picked.valid and picked.criteria == BUNDLES[0] and not missing.valid and "no rubric" in missing.reason
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"k1": ["too few"]}))
    with pytest.raises(ValueError, match="'k1' is not a valid bundle"):
        sources.load_file(bad)
    with pytest.raises(ValueError, match="go together"):
        RubricConfig(source="file")
    args = parser("alfworld", "").parse_args(["--rubric-source", "file", "--rubric-file", str(good)])
    assert config_from_args("alfworld", args).rubric.source_file == str(good)


@pytest.mark.parametrize("env,method", [("alfworld", "orsd-oracle"), ("alfworld", "orsd-shuffled"), ("webshop", "orsd-oracle")])
def test_training_reads_the_oracle_bundles(env, method, tmp_path, webshop_data):
    config = dataclasses.replace(preset("tiny", env), method=method)
    if env == "webshop":
        config = dataclasses.replace(config, env=dataclasses.replace(config.env, data_dir=str(webshop_data)))
    train(config, tmp_path)
    step = json.loads((tmp_path / "steps" / "00002" / "step.json").read_text())
    tasks = [Task(**g["task"]) for g in step["groups"]]
    oracle = sources.oracle_for(env, webshop_data)
    expected = [oracle(t) for t in tasks]
    if method == "orsd-shuffled":
        expected = sources.shuffled(expected, tasks)
    assert [tuple(r["candidates"][0]["criteria"]) for r in step["rubrics"]] == expected
    if env == "alfworld":
        assert expected[0] == alfworld_oracle(tasks[0]) or method == "orsd-shuffled"
    else:
        from orsd_jax.envs.webshop.world import WorldKey, world_for

        assert expected[0] == webshop_oracle(world_for(WorldKey.make(webshop_data)).goals[int(tasks[0].key)])
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["rubric/bundles"] == 2.0 and metrics[0]["rubric/valid_bundles"] == 2.0
