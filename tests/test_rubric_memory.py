"""The rubric memory by hand: updates, means, eviction, the remembered bundle, what the rubric
stage gives and takes from it, and the writer's prompt with its examples."""

import dataclasses

import numpy as np
import pytest
from transformers import AutoTokenizer

from orsd_jax import chat
from orsd_jax.envs.base import Task
from orsd_jax.models import EMBEDDED, resolve
from orsd_jax.rollout import Group
from orsd_jax.rubrics import GroupRubric, ParsedBundle, RubricConfig, Selection, group_prompt
from orsd_jax.rubrics.memory import RubricMemory, memory_metrics, offer, remember_selected
from orsd_jax.rubrics.render import render_group

A = (
    "The agent goes to the desk first.",
    "The agent turns on the desklamp.",
    "The agent takes the book.",
    "The agent never repeats an action.",
    "The agent examines the book under the lamp.",
)
B = (
    "the agent goes to the desk FIRST",  # A[0] again, after case and punctuation
    "Step 2: the agent turns on the desklamp!",  # A[1] again, after a step prefix
    "The agent checks the drawer before the shelf.",
    "The agent uses at most six actions.",
    "The agent looks at the book before leaving.",
)


def table(memory: RubricMemory, key: str) -> list[tuple[str, int, float, float | None, int, int]]:
    return [
        (e.criterion, e.selected, round(e.correlation, 6), e.alignment, e.first_update, e.last_update)
        for e in memory.entries[key]
    ]


def test_updates_merge_repeated_criteria_and_average_their_records():
    memory = RubricMemory().remember("look", A, 0.5, None, update=1)
    assert table(memory, "look") == [(c, 1, 0.5, None, 1, 1) for c in A]
    memory = memory.remember("look", B, 0.9, 0.4, update=3)
    # B's new criteria (0.9) first, then the two it shares with A (mean 0.7, twice selected), then A's rest.
    assert table(memory, "look") == [
        (B[2], 1, 0.9, 0.4, 3, 3),
        (B[3], 1, 0.9, 0.4, 3, 3),
        (B[4], 1, 0.9, 0.4, 3, 3),
        (A[0], 2, 0.7, 0.4, 1, 3),  # the alignment's mean skips the update that had none
        (A[1], 2, 0.7, 0.4, 1, 3),
        (A[2], 1, 0.5, None, 1, 1),
        (A[3], 1, 0.5, None, 1, 1),
        (A[4], 1, 0.5, None, 1, 1),
    ]
    memory = memory.remember("look", A[:2] + B[2:], -0.3, 0.0, update=4)
    # A's unchanged 0.5 records now lead; then A[0] and A[1] (three selections), then B's.
    assert [e.criterion for e in memory.entries["look"]] == [*A[2:], A[0], A[1], *B[2:]]
    assert table(memory, "look")[3] == (A[0], 3, round((0.5 + 0.9 - 0.3) / 3, 6), 0.2, 1, 4)
    assert table(memory, "look")[5] == (B[2], 2, 0.3, 0.2, 3, 4)
    assert "pick" not in memory.entries  # keys are separate
    assert memory.remember("look", A, float("nan"), None, update=5) is memory  # no correlation: not remembered


def test_each_key_keeps_its_best_records_and_evicts_the_weakest():
    memory = RubricMemory(size=6).remember("look", A, 0.2, None, update=1)
    memory = memory.remember("look", B[2:], 0.6, None, update=2)
    kept = [e.criterion for e in memory.entries["look"]]
    assert kept == [*B[2:], *A[:3]]  # 8 known, 6 kept: the last two of A's equal 0.2 records went
    ties = RubricMemory(size=5).remember("look", A, 0.5, None, update=1).remember("look", B[2:], 0.5, None, update=2)
    assert [e.criterion for e in ties.entries["look"]] == [*B[2:], *A[:2]]  # equal records: the newer stay
    with pytest.raises(ValueError, match="cannot hold a bundle"):
        RubricMemory(size=4)


def test_the_remembered_bundle_examples_age_and_json():
    memory = RubricMemory().remember("look", A[:4], 0.5, None, update=1)
    assert memory.bundle("look") is None and memory.bundle("pick") is None  # fewer than 5 criteria
    assert memory.examples("look", 2) == A[:2] and memory.examples("pick", 3) == ()
    memory = memory.remember("look", A[1:], 0.8, None, update=3)
    assert memory.bundle("look") == (A[4], A[1], A[2], A[3], A[0])  # best record first: 0.8, 0.65 x 3, 0.5
    assert memory.age("look", (A[0], A[4], "A criterion the memory lacks."), update=5) == pytest.approx((4 + 2 + 0) / 3)
    assert RubricMemory.from_json(memory.to_json()) == memory


TASK = Task("alfworld", "g1", "look", "look at a book under the desklamp")


def rubric(bundles, correlations, index) -> GroupRubric:
    parsed = tuple(ParsedBundle(b, "") for b in bundles)
    return GroupRubric(parsed, np.zeros((len(bundles), 2)), Selection(index, np.asarray(correlations, float), ""))


def test_the_rubric_stage_offers_the_remembered_bundle_and_remembers_what_wins():
    groups = [Group(TASK, ()), Group(dataclasses.replace(TASK, key="g2", task_type="pick"), ())]
    memory = RubricMemory().remember("look", A, 0.5, None, update=1)
    fresh = [(ParsedBundle(B, ""),), (ParsedBundle(B, ""),)]
    candidates, offered = offer(memory, groups, fresh)
    assert offered == [1, None]  # "pick" has no bundle yet
    assert [b.criteria for b in candidates[0]] == [B, memory.bundle("look")] and len(candidates[1]) == 1
    # Spearman selection chose the remembered bundle in group 1; gap alignment then chose it too.
    verified = [rubric([B, A], [0.1, 0.6], 1), rubric([B], [0.4], 0)]
    chosen = [rubric([B, A], [-0.2, 0.3], 1), rubric([B], [0.4], None)]
    after = remember_selected(memory, groups, verified, chosen, update=2)
    assert table(after, "look")[0] == (A[0], 2, 0.55, 0.3, 1, 2) and "pick" not in after.entries
    metrics = memory_metrics(memory, after, groups, chosen, offered, update=2)
    assert metrics == {
        "rubric/memory/offered": 1.0,
        "rubric/memory/wins": 1.0,
        "rubric/memory/age": 1.0,  # every chosen criterion was first selected in update 1
        "rubric/memory/size/look": 5.0,
    }
    # Without gap alignment the chosen selection is the verified one: no alignment is recorded.
    plain = remember_selected(memory, groups[:1], verified[:1], verified[:1], update=2)
    assert table(plain, "look")[0] == (A[0], 2, 0.55, None, 1, 2)


def test_the_writers_prompt_with_examples_is_the_hand_built_one():
    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    fmt = chat.chat_format(tokenizer)
    config = RubricConfig(trajectory_budget_tokens=100)
    attempts = render_group((), config.trajectory_budget_tokens, lambda text: len(chat.encode(tokenizer, text)))
    hand = (
        "Several attempts by an agent at the same task are shown below.\n"
        f"Task: {TASK.description}\n\n{attempts}\n\n"
        "Criteria that separated better attempts at tasks of this kind before:\n"
        f"- {A[0]}\n- {A[1]}\n\n"
        "Compare the 0 attempts and write between 5 and 8 criteria about the process "
        "(which actions were chosen, in what order, what was checked or repeated) that separate "
        "better attempts from worse ones. Each criterion is one sentence that can be answered "
        "yes or no for any attempt. Write them as a numbered list, one per line, and nothing else."
    )
    ids = group_prompt(TASK, (), config, tokenizer=tokenizer, fmt=fmt, examples=A[:2])
    assert ids == chat.prompt_ids(fmt, tokenizer, hand)
    without = group_prompt(TASK, (), config, tokenizer=tokenizer, fmt=fmt)
    assert without == chat.prompt_ids(
        fmt,
        tokenizer,
        hand.replace(
            f"Criteria that separated better attempts at tasks of this kind before:\n- {A[0]}\n- {A[1]}\n\n", ""
        ),
    )


def test_memory_settings_are_checked():
    with pytest.raises(ValueError, match="need rubric source 'policy'"):
        RubricConfig(memory_examples=3, source="oracle")
    with pytest.raises(ValueError, match="memory_size must hold a bundle"):
        RubricConfig(memory_candidate=True, memory_size=3)
    assert RubricConfig(memory_candidate=True, source="oracle").uses_memory and not RubricConfig().uses_memory
