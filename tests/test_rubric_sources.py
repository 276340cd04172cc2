"""Rubric sources: the oracle, another task's oracle bundle, a neutral text and users' files, in
training (tiny runs on ALFWorld and WebShop) and as the probe uses them."""

import dataclasses
import json

import numpy as np
import pytest

from experiments.common import config_from_args, parser
from orsd_jax.config import preset
from orsd_jax.envs.base import Task
from orsd_jax.rubrics import RubricConfig, parse_bundle, sources
from orsd_jax.rubrics.oracle import alfworld_oracle, webshop_oracle
from orsd_jax.trainer import train

TASKS = [
    Task("alfworld", f"k{i}", "look", d) for i, d in enumerate(["look at a book", "look at a pen", "look at a book"])
]
BUNDLES = [tuple(f"Criterion {k} of task {i} is met" for k in range(5)) for i in range(3)]


def test_shuffled_takes_the_next_different_task():
    # Tasks 0 and 2 share a description: each takes the next group whose task differs.
    assert sources.shuffled(BUNDLES, TASKS) == [BUNDLES[1], BUNDLES[2], BUNDLES[1]]
    with pytest.raises(ValueError, match="two different tasks"):
        sources.shuffled(BUNDLES[:1], TASKS[:1])


def test_neutral_text_keeps_the_shape_and_says_nothing_about_the_task():
    oracle = (
        "Goes to the desk 1 before anything else",
        "Takes the statue 1 from the desk 1",
        "Uses the desklamp 1 while holding the statue 1",
        "Finishes the task in at most 3 actions",
        "Does not repeat an action that had no effect",
    )
    neutral = sources.neutral_like(oracle)
    assert len(neutral) == len(oracle) and parse_bundle("\n".join(f"- {c}" for c in neutral)).valid
    for a, b in zip(neutral, oracle):
        assert abs(len(a) - len(b)) <= 12
    words = {w.lower() for c in oracle for w in c.split()}
    assert not {w.lower() for c in neutral for w in c.split()} & (
        words - {"the", "a", "an", "in", "of", "at", "to", "from", "and", "for"}
    )


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


@pytest.mark.parametrize(
    "env,method", [("alfworld", "orsd-oracle"), ("alfworld", "orsd-shuffled"), ("webshop", "orsd-oracle")]
)
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
    # Every recorded step carries its expert label, for WebShop from an env with the episodes' step limit.
    played = [
        (Task(**g["task"]), [s["action"] or "" for s in t["steps"]]) for g in step["groups"] for t in g["trajectories"]
    ]
    recorded = [[s["expert"] for s in t["steps"]] for g in step["groups"] for t in g["trajectories"]]
    assert all(isinstance(e, bool) for labels in recorded for e in labels)
    if env == "webshop":
        from orsd_jax.envs.webshop import WebShopEnv
        from orsd_jax.envs.webshop.expert import label_episodes

        shop = WebShopEnv(str(webshop_data), max_steps=config.rollout.max_steps)
        assert label_episodes(shop, played) == recorded
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["rubric/bundles"] == 2.0 and metrics[0]["rubric/valid_bundles"] == 2.0


# Credit-aware selection (gap-alignment).


def test_select_by_gap_by_hand():
    from orsd_jax.rubrics.alignment import select_by_gap

    gaps = np.array([[0.1, 0.5, 0.2], [0.3, 0.1, 0.2], [np.nan] * 3])
    chosen = select_by_gap(gaps, np.array([0.0, 10.0, 5.0]))  # ranks 1, 3, 2: bundle 0 agrees exactly
    assert (
        chosen.index == 0
        and chosen.correlations[0] == pytest.approx(1.0)
        and chosen.correlations[1] == pytest.approx(-1.0)
    )
    assert select_by_gap(gaps, np.array([1.0, 1.0, 1.0])).reason == "constant rewards"
    assert select_by_gap(np.full((2, 3), np.nan), np.array([0.0, 1.0, 2.0])).reason == "no valid bundle"


def test_trajectory_gaps_equal_the_training_batch():
    """Each trajectory's mean gap under a candidate, against the loss's own packed batch per step."""
    from flax import nnx
    from helpers import CONFIG
    from transformers import AutoTokenizer

    from orsd_jax import chat
    from orsd_jax.batch import StepSample, build_batch
    from orsd_jax.loss import response_logprobs
    from orsd_jax.models import EMBEDDED, CausalLM, resolve
    from orsd_jax.rollout import Group, Step, Trajectory
    from orsd_jax.rubrics import ParsedBundle, rubric_insert
    from orsd_jax.rubrics.alignment import trajectory_gaps

    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    fmt = chat.chat_format(tokenizer)
    model = CausalLM(dataclasses.replace(CONFIG, architecture="llama", vocab_size=len(tokenizer)), nnx.Rngs(0))
    task = TASKS[0]

    def step(text, answer):
        ids = tuple(tokenizer.encode(answer, add_special_tokens=False))
        return Step(
            text,
            tuple(chat.prompt_ids(fmt, tokenizer, text)),
            ids,
            (0.0,) * len(ids),
            answer,
            "o",
            "look",
            True,
            True,
            0.0,
            False,
            0,
        )

    trajectories = [
        Trajectory(
            task,
            (
                step("You are in a room.", "<think></think><action>look</action>"),
                step("You see a desk 1.", "<think></think><action>go to desk 1</action>"),
            ),
            True,
            1.0,
        ),
        Trajectory(task, (step("You are in a room.", "<think></think><action>inventory</action>"),), False, 0.0),
    ]
    bundles = [ParsedBundle(BUNDLES[0], ""), ParsedBundle((), "no list"), ParsedBundle(BUNDLES[1], "")]
    gaps = trajectory_gaps(model, Group(task, tuple(trajectories)), bundles, fmt, tokenizer, temperature=0.7)
    assert np.isnan(gaps[1]).all()
    tail = len(fmt.tail)
    for k in (0, 2):
        insert = chat.encode(tokenizer, rubric_insert(BUNDLES[k // 2]))
        for t, traj in enumerate(trajectories):
            per_step = []
            for s in traj.steps:
                batch = build_batch(
                    [
                        StepSample(
                            s.prompt_ids[:-tail], s.prompt_ids[-tail:], s.response_ids, s.logprobs, 0.0, insert=insert
                        )
                    ]
                )
                with_rubric, without, _ = response_logprobs(model, batch, temperature=0.7)
                n = len(s.response_ids)
                per_step.append(float(np.mean(np.asarray(with_rubric)[0, :n] - np.asarray(without)[0, :n])))
            assert gaps[k, t] == pytest.approx(np.mean(per_step), abs=1e-5)


def test_gap_alignment_selection_in_training(tmp_path):
    train(dataclasses.replace(preset("tiny"), method="orsd-gap-alignment"), tmp_path)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["time/selection_replay"] > 0 for m in metrics[:2])
    step = json.loads((tmp_path / "steps" / "00002" / "step.json").read_text())
    for r in step["rubrics"]:  # the chosen candidate has the best defined gap correlation
        defined = [(c, k) for k, c in enumerate(r["correlations"]) if c is not None]
        assert r["chosen"] is None or r["chosen"] == max(defined)[1]
    with pytest.raises(ValueError, match="unknown selection"):
        RubricConfig(selection="best")


def test_an_update_without_any_rubric_warns_and_strict_stops(tmp_path, caplog):
    """A file with no rubric for any task: every group gets none, so the update is plain GRPO."""
    import logging

    empty = tmp_path / "none.json"
    empty.write_text("{}")
    config = dataclasses.replace(
        preset("tiny"),
        updates=1,
        rubric=dataclasses.replace(preset("tiny").rubric, source="file", source_file=str(empty)),
    )
    with caplog.at_level(logging.WARNING, logger="orsd_jax"):
        train(config, tmp_path / "run")
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][:1]
    assert record["rubric/update_without_rubric"] == 1.0 and record["rubric/groups_with_rubric"] == 0.0
    assert any("trains as plain GRPO" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="no group got a rubric.*--strict"):
        train(dataclasses.replace(config, strict=True), tmp_path / "strict")
