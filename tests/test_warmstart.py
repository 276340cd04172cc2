"""Warm start: demonstrations see exactly the RL prompts, and the loss counts answer tokens only."""

import dataclasses
import functools
import pathlib
import random
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from orsd_jax import chat, warmstart
from orsd_jax.batch import build_batch
from orsd_jax.config import preset
from orsd_jax.demos import Demonstration, alfworld_walkthrough, demo_answer, record_episode, walkthrough_demos
from orsd_jax.envs import EnvPool
from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split
from orsd_jax.models import EMBEDDED, CausalLM, ModelConfig, resolve
from orsd_jax.rollout import Group, RolloutConfig, Step, Trajectory, collect_groups
from orsd_jax.rubrics import GroupRubric, ParsedBundle, Selection, rubric_insert
from orsd_jax.rubrics.oracle import alfworld_oracle
from orsd_jax.samples import step_samples
from orsd_jax.sampling.jax_sampler import JaxSampler
from orsd_jax.train_step import OptimizerConfig
from orsd_jax.warmstart import (
    FinetuneConfig,
    SupervisedLoss,
    WarmStartRun,
    demo_sample,
    demo_source,
    finetune,
    finetune_plan,
    frozen_states,
    packed_steps,
    place_states,
    shuffled_batches,
    with_rubric,
)

ROLLOUT = RolloutConfig(max_steps=4, max_prompt_tokens=1024, max_response_tokens=24, history_length=2)


@pytest.fixture(scope="module")
def setup():
    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    shape = preset("tiny").model.random_shape  # the tiny preset's random model
    config = ModelConfig(**shape, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    tasks = load_split(default_games("easy", 0, 200, 50), "train")
    return tokenizer, chat.chat_format(tokenizer), CausalLM(config, nnx.Rngs(0)), tasks


def test_demonstration_prompts_are_the_rollout_prompts(setup):
    """Replaying a real rollout's actions through the demonstration recorder rebuilds every prompt byte for byte."""
    tokenizer, fmt, model, tasks = setup
    sampler = JaxSampler(model, tokenizer, max_model_len=1100, seed=0)
    pool = EnvPool(functools.partial(AlfworldEnv, max_steps=ROLLOUT.max_steps), 2, n_workers=1)
    try:
        (group,), _ = collect_groups(
            sampler, pool, tasks[:1], 2, ROLLOUT, seed=3, tokenizer=tokenizer, fmt=fmt, build_prompt=build_prompt
        )
    finally:
        pool.close()
    env = AlfworldEnv(max_steps=ROLLOUT.max_steps)
    try:
        for traj in group.trajectories:
            assert len(traj.steps) >= 2  # history enters the later prompts
            records = record_episode(
                env,
                traj.task,
                [s.action or "" for s in traj.steps],
                ROLLOUT,
                build_prompt,
                tokenizer=tokenizer,
                fmt=fmt,
            )
            assert [r[0] for r in records] == [s.user_text for s in traj.steps]
            assert [tuple(r[1]) for r in records] == [s.prompt_ids for s in traj.steps]
            assert [r[3] for r in records] == [s.observation for s in traj.steps]
        # And a walkthrough demonstration's prompt at step k is the rollout prompt after its first k actions.
        demos = walkthrough_demos(
            env, tasks[1:2], alfworld_walkthrough, ROLLOUT, build_prompt, tokenizer=tokenizer, fmt=fmt
        )
        plan = alfworld_walkthrough(tasks[1])
        records = record_episode(env, tasks[1], plan[: len(demos)], ROLLOUT, build_prompt, tokenizer=tokenizer, fmt=fmt)
        assert [d.prompt_ids for d in demos] == [tuple(r[1]) for r in records]
    finally:
        env.close()


@pytest.mark.parametrize("goals, search, history", [("all", "title", 2), ("first-hit", "instruction", 1)])
def test_webshop_demonstrations_are_the_rollout_prompts(setup, webshop_data, goals, search, history):
    """WebShop as ALFWorld above: a real rollout's prompts rebuilt byte for byte by the recorder, and
    the oracle's demonstrations are the rollout prompts after the oracle's first k commands (the
    title oracle on every goal, and the one that searches the goal's words on the goals it finds first)."""
    from orsd_jax.envs import webshop

    tokenizer, fmt, model, _ = setup
    rollout = dataclasses.replace(ROLLOUT, max_steps=6, history_length=history)
    make_env = functools.partial(webshop.WebShopEnv, str(webshop_data), max_steps=rollout.max_steps)
    run = WarmStartRun(
        env="webshop", data_dir=str(webshop_data), demo_games=2, rollout=rollout, goals=goals, search=search
    )
    source = demo_source(run)
    assert len(source.tasks) == 2 and all(t.env == "webshop" for t in source.tasks)
    task = source.tasks[0]
    sampler = JaxSampler(model, tokenizer, max_model_len=1100, seed=0)
    with EnvPool(make_env, 2, n_workers=1) as pool:
        (group,), _ = collect_groups(
            sampler, pool, [task], 2, rollout, seed=3, tokenizer=tokenizer, fmt=fmt, build_prompt=webshop.build_prompt
        )
    shop = make_env()
    for traj in group.trajectories:
        played = [s.action or "" for s in traj.steps]
        records = record_episode(shop, task, played, rollout, webshop.build_prompt, tokenizer=tokenizer, fmt=fmt)
        assert [tuple(r[1]) for r in records] == [s.prompt_ids for s in traj.steps]
    demos = walkthrough_demos(
        source.env,
        [task],
        source.walkthrough,
        rollout,
        source.build_prompt,
        tokenizer=tokenizer,
        fmt=fmt,
        reasoning=False,
    )
    commands = webshop.oracle_episode(shop, task, search)[0]
    records = record_episode(shop, task, commands, rollout, webshop.build_prompt, tokenizer=tokenizer, fmt=fmt)
    assert [d.prompt_ids for d in demos] == [tuple(r[1]) for r in records] and len(demos) == len(commands) >= 3
    assert [d.answer for d in demos] == [f"<think></think><action>{c}</action>" for c in commands]
    query = task.description if search == "instruction" else shop.goal.name
    assert commands[0] == f"search[{' '.join(query.split())}]" and commands[-1] == "click[buy now]"


def test_rubric_demonstrations_are_the_with_rubric_replay_prompts(setup):
    """A rubric-reading demonstration's prompt is, token for token, what ORSD's with-rubric replay reads
    for the same step under the same (oracle) rubric: prefix, rubric insert, chat tail."""
    tokenizer, fmt, _, tasks = setup
    env = AlfworldEnv(max_steps=ROLLOUT.max_steps)
    try:
        demos = walkthrough_demos(
            env, tasks[2:3], alfworld_walkthrough, ROLLOUT, build_prompt, tokenizer=tokenizer, fmt=fmt
        )
    finally:
        env.close()
    criteria = alfworld_oracle(tasks[2])
    steps = tuple(
        Step(
            d.user_text,
            d.prompt_ids,
            d.answer_ids,
            (0.0,) * len(d.answer_ids),
            d.answer,
            "",
            None,
            True,
            True,
            0.0,
            False,
            0,
        )
        for d in demos
    )
    group = Group(tasks[2], (Trajectory(tasks[2], steps, False, 0.0),))
    chosen = GroupRubric((ParsedBundle(criteria, ""),), np.zeros((1, 1)), Selection(0, np.zeros(1), ""))
    samples, _ = step_samples([group], [[np.zeros(len(steps))]], [chosen], fmt, tokenizer)
    insert = rubric_insert(criteria)
    read = [with_rubric(d, insert, tokenizer=tokenizer, fmt=fmt) for d in demos]
    assert [r.prompt_ids for r in read] == [tuple(s.prefix) + tuple(s.insert) + tuple(s.tail) for s in samples]
    assert all(r.answer_ids == d.answer_ids and r.user_text == d.user_text + insert for r, d in zip(read, demos))
    assert "1. Goes to the" in insert and all(len(r.prompt_ids) > len(d.prompt_ids) for r, d in zip(read, demos))


def test_demonstrations_do_not_depend_on_where_the_games_are(setup, tmp_path):
    """The same games under another directory (another cache) give the same detours and prompts."""
    tokenizer, fmt, _, tasks = setup
    root = pathlib.Path(default_games("easy", 0, 200, 50))
    shutil.copytree(root, tmp_path / "copy")
    moved = load_split(tmp_path / "copy", "train")[:3]
    assert [t.key for t in moved] != [t.key for t in tasks[:3]]
    env = AlfworldEnv(max_steps=ROLLOUT.max_steps)
    try:
        a, b = (
            walkthrough_demos(
                env, ts, alfworld_walkthrough, ROLLOUT, build_prompt, tokenizer=tokenizer, fmt=fmt, max_detours=2
            )
            for ts in (tasks[:3], moved)
        )
    finally:
        env.close()
    assert [(d.step, d.prompt_ids, d.answer) for d in a] == [(d.step, d.prompt_ids, d.answer) for d in b]


def test_supervised_loss_counts_answer_tokens_only(setup):
    """By hand: -sum over answer tokens of log softmax(logits)[next token], from a plain forward."""
    tokenizer, fmt, model, _ = setup
    prompt = chat.prompt_ids(fmt, tokenizer, "You are in a room. Your task is to: look at a book.")
    answer = chat.encode(tokenizer, "<think></think><action>go to desk 1</action>") + [fmt.stop_token_ids[0]]
    demo = Demonstration("g", 0, "", tuple(prompt), "", tuple(answer))
    batch = build_batch([demo_sample(demo, fmt)], seq_multiple=16, response_multiple=8, batch_multiple=2)
    loss_sum, count, _, _ = SupervisedLoss(chunk_size=4)(model, batch)
    ids = jnp.asarray([prompt + answer], jnp.int32)
    logp = jax.nn.log_softmax(model(ids)[0], axis=-1)
    targets = np.asarray(prompt + answer)[1:]
    per_token = np.asarray(logp[np.arange(len(targets)), targets])  # log p(token t+1 | tokens <= t)
    answer_terms = per_token[len(prompt) - 1 :]
    assert float(count) == len(answer)
    np.testing.assert_allclose(float(loss_sum), -answer_terms.sum(), rtol=1e-5)
    assert abs(-per_token.sum() - float(loss_sum)) > 1.0  # the prompt's tokens would have changed it
    # The gradient is that of the answer terms alone: the prompt's own next-token terms get none.
    graphdef, params = nnx.split(model)

    def supervised(p):
        return SupervisedLoss(chunk_size=4)(nnx.merge(graphdef, p), batch)[0]

    def answer_only(p):
        lp = jax.nn.log_softmax(nnx.merge(graphdef, p)(ids)[0], axis=-1)[jnp.arange(len(targets)), targets]
        return -jnp.sum(lp[len(prompt) - 1 :])

    grads = [jax.jit(jax.grad(f))(params) for f in (supervised, answer_only)]  # eager calls: 1.5x the time
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def _demo_samples(fmt, tokenizer, texts):
    samples = []
    for k, text in enumerate(texts):
        prompt = chat.prompt_ids(fmt, tokenizer, text)
        answer = chat.encode(tokenizer, f"<think></think><action>go to desk {k}</action>") + [fmt.stop_token_ids[0]]
        samples.append(demo_sample(Demonstration("g", k, "", tuple(prompt), "", tuple(answer)), fmt))
    return samples


TEXTS = ["You are in a room.", "You see a drawer 1 and a desk 1. Your task is to: look at a book.", "Nothing happens."]


def test_frozen_states_computed_once_give_the_same_loss_and_gradients(setup):
    """The warm start's cached frozen-layer states (per sample, placed into a batch of one sample a row
    or of packed rows) give the loss and gradients of the full forward."""
    tokenizer, fmt, model, _ = setup
    config = dataclasses.replace(model.config, frozen_layers=1)
    frozen_model = CausalLM(config, nnx.Rngs(1))
    samples = _demo_samples(fmt, tokenizer, TEXTS)
    lengths = [len(s.prefix) + len(s.tail) + len(s.response) for s in samples]
    graphdef, params = nnx.split(frozen_model)
    once = [([2, 0], build_batch([samples[2], samples[0]], pack=True)), ([1], build_batch([samples[1]]))]
    states = frozen_states(graphdef, params, once, len(samples))  # a packed row, then one alone
    assert [s.shape for s in states] == [(n, config.hidden_size) for n in lengths]
    # The same states from one prompt tree (their common beginning once): each sample's path in it.
    tree = build_batch(samples, pack=True, share_prefix=True, rows=[[0, 1, 2]])
    assert int(np.sum(np.asarray(tree.reach) >= 0)) < sum(lengths)
    for a, b in zip(frozen_states(graphdef, params, [([0, 1, 2], tree)], len(samples)), states):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    def loss(p, b):
        return SupervisedLoss(chunk_size=4)(nnx.merge(graphdef, p), b)[0]

    loss_and_grads = jax.jit(jax.value_and_grad(loss))  # eager calls: 2.4x the time
    order = [1, 2, 0]
    unpacked = build_batch([samples[i] for i in order], batch_multiple=4)  # padding rows
    packed = build_batch([samples[i] for i in order], pack=True, row_tokens=256, rows=[[2], [0, 1]], slots=3)
    losses = []
    for batch in (unpacked, packed):
        cached = batch.replace(frozen=place_states(batch, [states[i] for i in order]))
        (got, grads), (want, want_grads) = loss_and_grads(params, cached), loss_and_grads(params, batch)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
        assert not any(np.any(np.asarray(g)[0]) for g in jax.tree.leaves(grads["layers"]))  # the frozen layer
        losses.append(float(want))
    # Packed rows score each answer as its own row does: the loss sums add up.
    np.testing.assert_allclose(*losses, rtol=1e-5)


def test_packed_steps_fill_rows_in_order(setup):
    """By hand: rows of 10 tokens, 2 rows an update; each sample goes into the first row with room."""
    lengths = [6, 5, 4, 3, 7, 2, 9]
    assert packed_steps(lengths, range(7), rows=2, tokens=10) == [[[0, 2], [1, 3]], [[4, 5], [6]]]
    with pytest.raises(ValueError, match="1 samples are longer than the 8 tokens"):
        packed_steps(lengths, range(7), rows=2, tokens=8)


def test_packed_warm_start_updates_have_one_shape(setup, tmp_path):
    """``FinetuneConfig.pack_tokens``: every update of every epoch is the same shape of batch, and
    every demonstration is trained on once an epoch."""
    tokenizer, fmt, model, _ = setup
    demos = [
        Demonstration("g", k, "", tuple(chat.prompt_ids(fmt, tokenizer, t * (k + 1))), "", (5, 6, 7)[: 1 + k % 3])
        for k, t in enumerate(TEXTS * 3)
    ]
    shapes, trained = [], []
    config = FinetuneConfig(epochs=2, batch_size=2, pack_tokens=256, optimizer=OptimizerConfig(learning_rate=1e-3))
    original = warmstart.make_train_step

    def recording(*args, **kwargs):  # the real step, its batches noted on the way in
        step = original(*args, **kwargs)

        def wrapped(state, batch, micro_batches):
            shapes.append(jax.tree.map(np.shape, batch))
            trained.append(int(np.sum(batch.response_mask)))
            return step(state, batch, micro_batches)

        return wrapped

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warmstart, "make_train_step", recording)
        finetune(model, demos, config, fmt=fmt)
    assert len(shapes) >= 4 and all(s == shapes[0] for s in shapes)
    assert sum(trained) == 2 * sum(len(d.answer_ids) for d in demos)


@pytest.mark.parametrize("pack_tokens", [0, 256])
def test_finetune_plan_holds_every_demonstration_once_per_pass(setup, pack_tokens):
    """The frozen layers' pass holds each sample once, in rows by length; every epoch's updates hold
    each once, with its tokens where its segment is."""
    tokenizer, fmt, _, _ = setup
    samples = [
        demo_sample(Demonstration("g", k, "", tuple(chat.prompt_ids(fmt, tokenizer, t * (k + 1))), "", (5, 6)), fmt)
        for k, t in enumerate(TEXTS * 3)
    ]
    config = FinetuneConfig(epochs=2, batch_size=4, pack_tokens=pack_tokens)
    plan = finetune_plan(samples, config, devices=1, frozen=True)
    assert sorted(i for indices, _ in plan.frozen_pass for i in indices) == list(range(len(samples)))
    widths = [b.tokens.shape[1] for _, b in plan.frozen_pass]
    assert widths == sorted(widths)
    assert len(plan.epochs) == 2
    for epoch in plan.epochs:
        assert sorted(i for indices, _ in epoch for i in indices) == list(range(len(samples)))
        for indices, batch in epoch:
            assert int(np.sum(batch.response_mask)) == 2 * len(indices)
    assert finetune_plan(samples, config, devices=1, frozen=False).frozen_pass == []


def test_shuffled_batches_cover_every_index_once():
    rng = random.Random(0)
    first, second = shuffled_batches(53, 8, rng), shuffled_batches(53, 8, rng)
    for batches in (first, second):
        assert sorted(i for b in batches for i in b) == list(range(53))
        assert [len(b) for b in batches] == [8] * 6 + [5]
    assert first != second


def test_demonstration_reasons_by_hand():
    """The think block names why: an ALFWorld command after the restated task; each kind of WebShop
    click (a product id has ten letters and digits, at least one a digit) without it, and on the
    product page the goal's options and the one after the previous click."""
    task = "put a clean apple in fridge"
    assert demo_answer(task, "open drawer 1", reasoning=False) == "<think></think><action>open drawer 1</action>"
    assert demo_answer(task, "open drawer 1") == (
        f"<think>My task is to {task}. The drawer 1 is closed; I open it to see inside.</think>"
        "<action>open drawer 1</action>"
    )
    shop = (
        'Find me pillows with printing technology with color: multicolor, and size: 28" x 28", '
        "and price lower than 30.00 dollars"
    )
    options = 'The task asks for color: multicolor, and size: 28" x 28".'
    expected = [  # (previous command, command, why)
        (None, "search[find me pillows]", "I search for the task's own words."),
        ("search[find me pillows]", "click[b0743jkhbv]", "The product b0743jkhbv matches the task, so I open it."),
        ("click[b0743jkhbv]", "click[next >]", "The product the task describes is not on this page."),
        ("click[b0743jkhbv]", "click[multicolor]", f"{options} I choose multicolor first."),
        ("click[multicolor]", 'click[28" x 28"]', f'{options} I chose multicolor last, so next I choose 28" x 28".'),
        ('click[28" x 28"]', "click[buy now]", f'{options} I chose 28" x 28" last, the last of them, so I buy it.'),
        ("click[b0743jkhbv]", "click[buy now]", "This product has what the task asks for, so I buy it."),
    ]
    for previous, command, why in expected:
        assert demo_answer(shop, command, previous=previous) == f"<think>{why}</think><action>{command}</action>"
    no_options = "Find me dual band streaming media players with quad core, and price lower than 360.00 dollars"
    assert demo_answer(no_options, "click[buy now]", previous="click[b09lskqf8c]") == (
        "<think>This product has what the task asks for, so I buy it.</think><action>click[buy now]</action>"
    )
