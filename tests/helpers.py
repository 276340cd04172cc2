"""What several test modules share: a tiny random model, step samples near its own log-probs,
the loss configuration they run, full XLA optimisation where it pays, tree comparisons, and the
model's own log-probs of sampled completions (the samplers' oracle)."""

import contextlib
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax.batch import StepSample
from orsd_jax.loss import LossConfig
from orsd_jax.models import CausalLM, ModelConfig

# The environment of a command whose programs no other test compiles: unoptimised, as this process's.
UNOPTIMISED = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


@contextlib.contextmanager
def optimized():
    """XLA's full optimisation for the programs compiled inside, which run long enough to repay it
    (conftest.py turns it off for the tests' own programs). JAX caches a program under the same key
    either way, so the caches are cleared on the way in and out: a module-level jitted function
    (the JAX sampler's decode) compiled unoptimised by an earlier test would run inside otherwise,
    and its float rounding differ from a command's."""
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", True)


CONFIG = ModelConfig(
    "qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)
LOSS = LossConfig(
    coef=0.8,
    clip=0.2,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=3.0,
    kl_coef=0.05,
    entropy_coef=0.01,
    temperature=0.7,
    chunk_size=4,
)


@functools.cache
def tiny_model(config: ModelConfig = CONFIG, seed: int = 0):
    """``(graphdef, params)`` of a random model, drawn with numpy (fast; no per-shape PRNG compiles).

    Weights have std 0.25, large enough for visible gaps (the init scale 0.02 gives near-uniform
    logits); norm scales are near 1.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    rng = np.random.RandomState(seed)

    def draw(path, x):
        is_norm = "norm" in jax.tree_util.keystr(path)
        return jnp.asarray((1.0 if is_norm else 0.0) + rng.normal(0, 0.1 if is_norm else 0.25, x.shape), x.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, params, ids, targets):
    model = nnx.merge(graphdef, params)
    return model.token_logprobs(ids, targets, temperature=LOSS.temperature, with_entropy=True)


def right_padded(sequences, width: int) -> np.ndarray:
    """``[N, width]`` token ids, each sequence followed by zeros (a causal model's values at a
    position do not depend on the padding after it)."""
    ids = np.zeros((len(sequences), width), np.int32)
    for row, sequence in zip(ids, sequences):
        row[: len(sequence)] = sequence
    return ids


def sequence_logprobs(graphdef, params, sequences, prompt_lengths, width, length=32):
    """Log-probs and entropies ``[N, width]`` of each sequence's tokens after its prompt, each sequence
    run alone through a plain causal forward (end padding to ``length`` cannot affect earlier tokens)."""
    ids = right_padded(sequences, length)
    targets = np.concatenate([ids[:, 1:], np.zeros((len(ids), 1), np.int32)], axis=1)
    logp, entropy = _token_logprobs(graphdef, params, jnp.asarray(ids), jnp.asarray(targets))
    rows = np.arange(len(ids))[:, None]
    cols = np.asarray(prompt_lengths)[:, None] - 1 + np.arange(width)
    return logp[rows, cols], entropy[rows, cols]


def make_samples(rubric_rows, seed=0, prompt_of=None):
    """Step samples of random lengths with old/ref log-probs near the model's own (so some ratios
    clip); sample ``i`` takes the prompt (prefix, insert, tail) of sample ``prompt_of[i]`` where
    that is an earlier one."""
    rng = np.random.RandomState(seed)
    parts = []
    for i, has in enumerate(rubric_rows):
        prefix = rng.randint(0, 96, rng.randint(3, 12)).tolist()
        insert = rng.randint(0, 96, rng.randint(2, 7)).tolist() if has else []
        tail = rng.randint(0, 96, rng.randint(1, 4)).tolist()
        if prompt_of is not None and prompt_of[i] < i:
            prefix, insert, tail = parts[prompt_of[i]][:3]
        parts.append((prefix, insert, tail, rng.randint(0, 96, rng.randint(2, 9)).tolist()))
    graphdef, params = tiny_model()
    width = max(len(p[3]) for p in parts)
    logp, _ = sequence_logprobs(
        graphdef, params, [p + t + y for p, _, t, y in parts], [len(p) + len(t) for p, _, t, _ in parts], width
    )
    logp = np.asarray(logp)
    samples = []
    for i, (prefix, insert, tail, response) in enumerate(parts):
        n = len(response)
        samples.append(
            StepSample(
                prefix=prefix,
                insert=insert,
                tail=tail,
                response=response,
                old_logprobs=(logp[i, :n] + 0.3 * rng.randn(n)).tolist(),
                ref_logprobs=(logp[i, :n] + 0.3 * rng.randn(n)).tolist(),
                advantage=float(rng.randn()),
            )
        )
    return samples


RUBRIC_ROWS = (True, False, True, True, False)  # mixed: samples of groups with and without a rubric
# Samples 0, 2, 3 (with a rubric) of one prompt and 1, 4 (without) of another: a group's episodes
# that reached one state by the same steps.
SHARED_PROMPTS = (0, 1, 0, 0, 1)


def max_tree_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def assert_trees_close(a, b, tol=1e-5):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol, err_msg=jax.tree_util.keystr(path))


# Wall-clock figures of a run's metrics.jsonl, which no two runs share.
TIMING = (
    "time/",
    "rollout/generated_tokens_per_s",
    "rollout/env_steps_per_s",
    "train/tokens_per_s",
    "train/row_tokens_per_s",
    "verifier/latency_s",
)


def run_metrics(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def without_timing(record: dict) -> dict:
    """The record less wall-clock figures; NaN (logged as null) compares equal to itself."""
    return {k: float("nan") if v is None else v for k, v in record.items() if not k.startswith(TIMING)}


@contextlib.contextmanager
def one_torch_thread():
    """Decoding one sequence gains nothing from a second thread, and loses several times over
    when the cores are busy (a vLLM server or the other test worker beside it): transformers'
    greedy decoding of 3 x 32 tokens of the embedded model took 20.6 s with torch's threads and 6.2 s
    with one (at `da38bec`, the 2-core Intel Xeon with a study run beside)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


WIDTH = 128  # reference batches are padded to one shape so each jitted function compiles once


@nnx.jit
def _completion_logprobs(model, ids):
    return model.token_logprobs(ids[:, :-1], ids[:, 1:])[0]


def padded(prompts, completions) -> np.ndarray:
    """``[N, WIDTH]``: each prompt followed by its completion's tokens, right-padded."""
    return right_padded([list(p) + list(c.token_ids) for p, c in zip(prompts, completions)], WIDTH)


def completion_rows(values: np.ndarray, prompts, completions) -> list[np.ndarray]:
    """Per completion, the values at the positions that predict its tokens."""
    return [v[len(p) - 1 : len(p) - 1 + len(c.token_ids)] for v, p, c in zip(values, prompts, completions)]


def our_logprobs(model, prompts, completions) -> list[np.ndarray]:
    """The orsd_jax model's log-probs of the completion tokens (temperature 1), one jitted batch."""
    logp = np.asarray(_completion_logprobs(model, jnp.asarray(padded(prompts, completions))))
    return completion_rows(logp, prompts, completions)


def trie_samples():
    """Prompts with common beginnings, as one task's steps have: 1 repeats 0's prompt; 2 leaves 0's
    prefix after three tokens; 3 continues it (without a rubric); 4 has 0's prefix and another
    rubric; 6 shares two tokens with 5 (neither has a rubric)."""
    s = make_samples((True, True, True, False, True, False, False), seed=3)
    p0 = [*s[0].prefix, 5, 6, 7]
    prompts = [
        (p0, s[0].insert, s[0].tail),
        (p0, s[0].insert, s[0].tail),
        (p0[:3] + [40, 41], s[2].insert, s[2].tail),
        (p0 + [50, 51], (), s[3].tail),
        (p0, s[4].insert, s[4].tail),
        (s[5].prefix, (), s[5].tail),
        ([*s[5].prefix[:2], 60], (), s[6].tail),
    ]
    return [dataclasses.replace(x, prefix=p, insert=i, tail=t) for x, (p, i, t) in zip(s, prompts)]


def trie_size(samples) -> int:
    """The distinct prefixes of the samples' prefixes (the trie's nodes), counted independently."""
    return len({tuple(s.prefix[: n + 1]) for s in samples for n in range(len(s.prefix))})
