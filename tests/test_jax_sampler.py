"""JaxSampler against transformers' generate and the model's own log-probs."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import CONFIG, one_torch_thread, our_logprobs
from transformers import AutoModelForCausalLM

from orsd_jax import chat
from orsd_jax.models import EMBEDDED, CausalLM, ModelConfig, load_model, resolve
from orsd_jax.sampling import SamplingError, SamplingParams
from orsd_jax.sampling.jax_sampler import JaxSampler, processed_logprobs

PROMPTS = [
    "Write a short story about a cat who learns to fly.",
    "Explain in detail why the sky is blue.",
    "List ten animals and describe each one.",
]


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer = load_model(EMBEDDED)
    fmt = chat.chat_format(tokenizer)
    prompts = [chat.prompt_ids(fmt, tokenizer, text) for text in PROMPTS]
    return model, tokenizer, fmt, prompts


def test_greedy_matches_transformers_generate(embedded):
    model, tokenizer, fmt, prompts = embedded
    reference = AutoModelForCausalLM.from_pretrained(resolve(EMBEDDED), dtype=torch.float32).eval()
    sampler = JaxSampler(model, tokenizer, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=fmt.stop_token_ids)
    # Prompts of different lengths in one right-padded batch, each against transformers' generate of
    # that prompt alone (a second batch, of one, would only compile the same program again).
    outputs = sampler.generate(prompts, params)
    for prompt, out, ours in zip(prompts, outputs, our_logprobs(model, prompts, outputs)):
        with one_torch_thread():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :]
        assert list(out.token_ids) == expected.tolist()
        assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if expected[-1] in fmt.stop_token_ids else "length")
        np.testing.assert_allclose(out.logprobs, ours, atol=1e-3)


@pytest.fixture(scope="module")
def tiny():
    config = dataclasses.replace(CONFIG, vocab_size=64)
    return CausalLM(config, nnx.Rngs(0))


class _Tokenizer:
    """Enough of a tokenizer for decoding: token i is the character chr(97 + i % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_sampled_logprobs_are_the_models_at_temperature_one(tiny):
    sampler = JaxSampler(tiny, _Tokenizer(), max_model_len=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    outputs = sampler.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=0, n=3))
    assert len(outputs) == 6 and all(len(o.token_ids) == 12 for o in outputs)
    for out, ours in zip(outputs, our_logprobs(tiny, [p for p in prompts for _ in range(3)], outputs)):
        np.testing.assert_allclose(out.logprobs, ours, atol=1e-5)


def test_temperature_scales_logprobs(tiny):
    sampler = JaxSampler(tiny, _Tokenizer(), max_model_len=64)
    out = sampler.generate([[3, 1, 4]], SamplingParams(temperature=0.5, max_new_tokens=6, seed=1))[0]
    ids = [3, 1, 4] + list(out.token_ids)
    logp, _ = tiny.token_logprobs(jnp.asarray([ids[:-1]]), jnp.asarray([ids[1:]]), temperature=0.5)
    np.testing.assert_allclose(out.logprobs, np.asarray(logp)[0, 2:], atol=1e-5)


def test_seeds_reproduce_and_differ(tiny):
    sampler = JaxSampler(tiny, _Tokenizer(), max_model_len=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7, n=4)
    a, b = sampler.generate([[1, 2]], params), sampler.generate([[1, 2]], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({o.token_ids for o in a}) > 1  # the n samples differ from each other


def test_top_k_one_is_greedy(tiny):
    sampler = JaxSampler(tiny, _Tokenizer(), max_model_len=64)
    greedy = sampler.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=10))[0]
    top1 = sampler.generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, seed=3))[0]
    assert greedy.token_ids == top1.token_ids
    np.testing.assert_allclose(top1.logprobs, 0.0, atol=1e-6)  # all mass on the one kept token


def test_processed_logprobs_by_hand():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top_k = np.exp(np.asarray(processed_logprobs(logits, 1.0, 2, 1.0)))[0]
    np.testing.assert_allclose(top_k, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], atol=1e-6)
    # top_p 0.8: the smallest prefix with mass >= 0.8 is {0.5, 0.2, 0.15}.
    top_p = np.exp(np.asarray(processed_logprobs(logits, 1.0, -1, 0.8)))[0]
    np.testing.assert_allclose(top_p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], atol=1e-6)
    temp = np.exp(np.asarray(processed_logprobs(logits, 0.5, -1, 1.0)))[0]
    p2 = np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(temp, p2 / p2.sum(), atol=1e-6)


def test_stop_tokens_and_strings(tiny):
    sampler = JaxSampler(tiny, _Tokenizer(), max_model_len=64)
    free = sampler.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=20))[0]
    stop_token = free.token_ids[4]
    first = free.token_ids.index(stop_token)
    stopped = sampler.generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(stop_token,))
    )[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    stop_string = free.text[5:7]
    cut = sampler.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=20, stop=(stop_string,)))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop_string)]
    assert cut.token_ids == free.token_ids[: free.text.index(stop_string) + 2]
    kept = sampler.generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=20, stop=(stop_string,), include_stop=True)
    )[0]
    assert kept.text == free.text[: free.text.index(stop_string) + 2] and kept.token_ids == cut.token_ids


def test_context_limit_clamps_new_tokens(tiny):
    sampler = JaxSampler(tiny, _Tokenizer(), max_model_len=16)
    outs = sampler.generate([[1] * 12, [2] * 3], SamplingParams(temperature=0.0, max_new_tokens=10))
    assert [len(o.token_ids) for o in outs] == [4, 10]
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([[]], SamplingParams(), "prompt 0 is empty"),
        ([[1] * 64], SamplingParams(), "no room"),
        ([], SamplingParams(), "no prompts"),
        ([[1]], SamplingParams(temperature=-1), "temperature"),
        ([[1]], SamplingParams(top_p=0), "top_p"),
        ([[1]], SamplingParams(top_k=0), "top_k"),
        ([[1]], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([[1]], SamplingParams(n=0), "n must"),
        ([[1]], SamplingParams(regex="1\\. .+"), "needs the vLLM sampler"),
    ],
)
def test_bad_requests(tiny, prompts, params, message):
    with pytest.raises(SamplingError, match=message):
        JaxSampler(tiny, _Tokenizer(), max_model_len=64).generate(prompts, params)


def test_push_weights(tiny):
    sampler = JaxSampler(tiny, _Tokenizer(), max_model_len=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = sampler.generate([[1, 2, 3]], params)[0]
    other = CausalLM(tiny.config, nnx.Rngs(1))
    sampler.push_weights(other, 1)
    after = sampler.generate([[1, 2, 3]], params)[0]
    assert after.token_ids != before.token_ids and after.weight_version == 1
    sampler.push_weights(tiny, 2)
    assert sampler.generate([[1, 2, 3]], params)[0].token_ids == before.token_ids
    with pytest.raises(SamplingError, match="must increase"):
        sampler.push_weights(tiny, 2)
    wrong = CausalLM(ModelConfig(**{**tiny.config.__dict__, "intermediate_size": 48}), nnx.Rngs(0))
    with pytest.raises(SamplingError, match="shapes"):
        sampler.push_weights(wrong, 3)
    assert sampler.generate([[1, 2, 3]], params)[0].token_ids == before.token_ids
