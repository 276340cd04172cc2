"""The credit probe's policy sources run the trainer's rubric stage over the played groups a few at a
time, as successive updates: a memory filled by one update's selections is offered in the next,
and the memory after them is the one the selections give by hand. The verifier is a small random
model in this process; the candidates are given per task, as the oracle source gives them."""

import dataclasses

import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from experiments.credit_probe import RubricTools, staged_rubrics
from orsd_jax import chat
from orsd_jax.config import preset
from orsd_jax.envs.base import Task
from orsd_jax.models import EMBEDDED, CausalLM, ModelConfig, resolve
from orsd_jax.rollout import Group, Step, Trajectory
from orsd_jax.rubrics import LocalModelVerifier
from orsd_jax.rubrics.memory import RubricMemory, remember_selected

BUNDLES = {
    "g0": (
        "The agent goes to the desk first.",
        "The agent turns on the desklamp.",
        "The agent takes the book.",
        "The agent never repeats an action.",
        "The agent examines the book under the lamp.",
    ),
    "g1": (
        "The agent checks the drawer before the shelf.",
        "The agent uses at most six actions.",
        "The agent looks at the book before leaving.",
        "The agent goes to the desk first.",
        "The agent reads the task before acting.",
    ),
}


def _group(key: str, rewards: tuple[float, ...]) -> Group:
    task = Task("alfworld", key, "look", "look at a book under the desklamp")
    trajectories = tuple(
        Trajectory(
            task,
            tuple(
                Step(
                    "obs", (), (), (), f"go to desk {k}", "You see a desk.", f"go to desk {k}", True, True, r, False, 0
                )
                for k in range(1 + i)
            ),
            r > 0,
            float(r > 0),
        )
        for i, r in enumerate(rewards)
    )
    return Group(task, trajectories)


def test_policy_sources_carry_the_memory_from_update_to_update():
    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    shape = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    verifier_model = CausalLM(ModelConfig("qwen3", vocab_size=len(tokenizer), **shape), nnx.Rngs(0))
    config = dataclasses.replace(preset("cpu-demo"), method="orsd-memory-candidate").resolved()
    config = dataclasses.replace(config, rubric=dataclasses.replace(config.rubric, source="oracle"))
    oracle = {"oracle": lambda task: BUNDLES[task.key[:2]]}
    tools = RubricTools(
        config, None, LocalModelVerifier(verifier_model, tokenizer), tokenizer, chat.chat_format(tokenizer), oracle
    )
    groups = [_group(f"g{k % 2}-{k}", (10.0, 0.0, 10.0 * (k % 2))) for k in range(4)]

    chosen, memory, stage = staged_rubrics(tools, None, groups, per_update=2)

    # Update 1 had no memory: one candidate per group. Update 2 offered update 1's remembered bundle.
    assert [len(r.bundles) for r in chosen] == [1, 1, 2, 2]
    first = remember_selected(RubricMemory(size=config.rubric.memory_size), groups[:2], chosen[:2], chosen[:2], 1)
    assert first.entries  # a random verifier's satisfaction differs between episodes: a correlation is defined
    assert all(r.bundles[1].criteria == first.bundle("look") for r in chosen[2:])
    assert memory == remember_selected(first, groups[2:], chosen[2:], chosen[2:], 2)
    wins = sum(r.selection.index == 1 for r in chosen[2:])
    assert (stage["rubric/memory/offered"], stage["rubric/memory/wins"]) == (2.0, float(wins))
    assert stage["rubric/groups_with_rubric"] == sum(r.selection.index is not None for r in chosen)
    assert np.isfinite(chosen[0].satisfaction).all()
