"""The rubric stage end to end on real parts: the embedded model plays 2 generated ALFWorld tasks
x 4 trajectories through a real vLLM server, writes rubric bundles about them, and the same
(frozen) weights served by vLLM verify every criterion on every trajectory through the real
``openai`` client; the selection is checked against ``scipy.stats.spearmanr``."""

import dataclasses
import functools
import re

import numpy as np
import psutil
import pytest
import scipy.stats
from transformers import AutoTokenizer

from orsd_jax import chat
from orsd_jax.envs import EnvPool
from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split
from orsd_jax.models import EMBEDDED, resolve
from orsd_jax.rollout import RolloutConfig, collect_groups
from orsd_jax.rubrics import (
    EndpointConfig,
    OpenAIVerifier,
    ParsedBundle,
    RubricConfig,
    bundle_regex,
    generate_bundles,
    verify_and_select,
)
from orsd_jax.sampling.vllm_sampler import VLLMSampler
from orsd_jax.sampling.vllm_server import ServerOptions, VLLMServer

TASKS, G = 2, 4
ROLLOUT = RolloutConfig(max_steps=4, max_prompt_tokens=1024, max_response_tokens=48)
RUBRIC = RubricConfig(
    candidates=2, trajectory_budget_tokens=120, max_new_tokens=200, constrained=True, criterion_chars=80
)
# Written by hand and verified beside the model's own bundles, so the verifier always has work
# even when the untrained model writes no parseable bundle.
HAND = ParsedBundle(
    (
        "The agent goes to a receptacle named in the task.",
        "The agent takes the object named in the task.",
        "The agent never repeats the same action twice in a row.",
        "Every action is one of the admissible commands.",
        "The agent puts the object in or on the target receptacle.",
    ),
    "",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # Without dev mode, as the trainer's verifier server runs (this test pushes no weights).
    server = VLLMServer(resolve(EMBEDDED), ServerOptions(max_model_len=4096, dev_mode=False), log_path=log)
    yield server
    server.close()


def test_groups_bundles_satisfaction_and_selection(server, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    fmt = chat.chat_format(tokenizer)
    sampler = VLLMSampler(server, tokenizer, scratch_dir=tmp_path / "weights")
    tasks = load_split(default_games("easy", 0, 200, 50), "train")[:TASKS]
    pool = EnvPool(functools.partial(AlfworldEnv, max_steps=ROLLOUT.max_steps), TASKS * G, n_workers=2)
    try:
        groups, stats = collect_groups(
            sampler, pool, tasks, G, ROLLOUT, seed=0, tokenizer=tokenizer, fmt=fmt, build_prompt=build_prompt
        )
    finally:
        pool.close()
    assert [g.task.key for g in groups] == [t.key for t in tasks]
    assert all(len(g.trajectories) == G for g in groups)
    assert stats.env_steps == sum(len(t.steps) for g in groups for t in g.trajectories) > 0
    assert stats.generated_tokens == sum(len(s.response_ids) for g in groups for t in g.trajectories for s in t.steps)

    answers = []  # what the server returned to generate_bundles, to check against the grammar

    class Recording:
        max_model_len = sampler.max_model_len

        def generate(self, prompts, params):
            answers.extend(sampler.generate(prompts, params))
            return answers[-len(prompts) * params.n :]

    written = generate_bundles(Recording(), groups, RUBRIC, seed=0, tokenizer=tokenizer, fmt=fmt)
    # The grammar reaches the server: every finished answer is a numbered list of 5-8 lines.
    finished = [a.text for a in answers if a.finish_reason == "stop"]
    grammar = bundle_regex(RUBRIC.criterion_chars)
    assert finished and all(re.fullmatch(grammar, text) for text in finished), [a.text for a in answers]
    assert [len(b) for b in written] == [RUBRIC.candidates] * TASKS
    bundles = [(*b, HAND) for b in written]
    for bundle in (b for group in bundles for b in group):  # each either 5-8 criteria or a stated reason
        assert (bundle.valid and 5 <= len(bundle.criteria) <= 8) or (not bundle.valid and bundle.reason)

    verifier = OpenAIVerifier(
        EndpointConfig(
            base_url=f"{server.url}/v1",
            model="policy",
            unix_socket=server.unix_socket,
            mode="logprob",
            concurrency=8,
            cache_dir=str(tmp_path / "cache"),
        )
    )
    rng = np.random.default_rng(0)
    for group, group_bundles in zip(groups, bundles):
        result = verify_and_select(verifier, group, group_bundles, "spearman", rng)
        assert result.satisfaction.shape == (RUBRIC.candidates + 1, G)
        for b, bundle in enumerate(group_bundles):
            row = result.satisfaction[b]
            # A valid bundle is scored on every trajectory (probabilities in [0, 1]); an invalid one is not.
            assert np.all((row >= 0) & (row <= 1)) if bundle.valid else np.all(np.isnan(row)), (b, row)
            rewards = np.asarray(group.rewards, float)
            if bundle.valid and np.ptp(row) > 0 and np.ptp(rewards) > 0:
                assert result.selection.correlations[b] == pytest.approx(scipy.stats.spearmanr(row, rewards)[0])
        if result.selection.index is None:
            assert result.selection.reason  # constant rewards, no valid bundle, ...
        else:
            chosen = result.selection.correlations[result.selection.index]
            assert chosen == np.nanmax(result.selection.correlations)
    assert verifier.stats.failures == 0 and verifier.stats.calls > 0
    # The verifier's server, like the sampler's (tests/test_vllm_sampler.py), listens on no TCP port.
    api = psutil.Process(server.pid)
    assert not [c for c in api.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    sampler.close()


def test_asynchronous_episodes_are_the_synchronous_ones_when_greedy(server, tmp_path):
    """Each episode on its own (environments stepping while others generate) plays what the
    turn-synchronous loop plays, token for token, where decoding is deterministic."""
    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    fmt = chat.chat_format(tokenizer)
    sampler = VLLMSampler(server, tokenizer, scratch_dir=tmp_path / "weights")
    tasks = load_split(default_games("easy", 0, 200, 50), "train")[TASKS : 2 * TASKS]
    greedy = dataclasses.replace(ROLLOUT, temperature=0.0)
    g = 2  # greedy: a group's episodes play alike; two check that they keep their order
    pool = EnvPool(functools.partial(AlfworldEnv, max_steps=ROLLOUT.max_steps), TASKS * g, n_workers=2)
    try:
        played = [
            collect_groups(
                sampler,
                pool,
                tasks,
                g,
                dataclasses.replace(greedy, asynchronous=asynchronous),
                seed=0,
                tokenizer=tokenizer,
                fmt=fmt,
                build_prompt=build_prompt,
            )
            for asynchronous in (False, True)
        ]
    finally:
        pool.close()
        sampler.close()
    (by_turns, turn_stats), (on_their_own, own_stats) = played

    def record(groups):
        return [
            (t.won, [(s.prompt_ids, s.response_ids, s.action, s.reward) for s in t.steps])
            for g in groups
            for t in g.trajectories
        ]

    assert record(by_turns) == record(on_their_own)
    for a, b in zip(by_turns, on_their_own):
        for s, u in (pair for x, y in zip(a.trajectories, b.trajectories) for pair in zip(x.steps, y.steps)):
            np.testing.assert_allclose(s.logprobs, u.logprobs, atol=1e-4)
    assert (turn_stats.env_steps, turn_stats.generated_tokens) == (own_stats.env_steps, own_stats.generated_tokens)
    assert turn_stats.overlap_seconds == 0.0 < own_stats.overlap_seconds  # environments stepped during generation
