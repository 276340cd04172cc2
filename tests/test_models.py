"""The decoder against transformers' PyTorch models, checkpoints in and out, bad input."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import one_torch_thread, right_padded
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from orsd_jax import chat
from orsd_jax.batch import PAD, attention_mask
from orsd_jax.models import (
    EMBEDDED,
    CausalLM,
    CheckpointError,
    KVCache,
    ModelConfig,
    UnsupportedModelError,
    load_hf_params,
    load_model,
    load_tokenizer,
    resolve,
    save_hf,
)
from orsd_jax.models.decoder import attend
from orsd_jax.models.registry import embedded_gguf_path

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=3)
CASES = {
    # GQA, untied head, head_dim (24) != hidden / heads (16)
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **TINY,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        ),
    ),
    # GQA, tied embeddings
    "llama": (
        LlamaForCausalLM,
        LlamaConfig(
            **TINY,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1e5,
            rms_norm_eps=1e-5,
        ),
    ),
}


def _logits(torch_model, ids, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return torch_model(torch.tensor(np.asarray(ids)), **kwargs).logits.numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    """A tiny random transformers model saved to disk, and our model loaded from it."""
    cls, config = CASES[request.param]
    torch.manual_seed(0)
    reference = cls(config).eval()
    # Random norms so a norm that is mis-mapped or skipped changes the logits.
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    return reference, directory, load_hf_params(directory)


def test_logits_match_transformers(tiny):
    reference, _, model = tiny
    ids = np.random.RandomState(0).randint(0, 160, (3, 17))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), _logits(reference, ids), atol=1e-4, rtol=0)


def test_explicit_positions_match_transformers(tiny):
    reference, _, model = tiny
    ids = np.random.RandomState(1).randint(0, 160, (2, 9))
    positions = np.arange(9)[None] + np.array([[5], [40]])
    ours = model(jnp.asarray(ids), positions=jnp.asarray(positions))
    theirs = _logits(reference, ids, position_ids=torch.tensor(positions))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)


def test_packed_segments_equal_separate_sequences(tiny):
    _, _, model = tiny
    rng = np.random.RandomState(2)
    a, b = rng.randint(0, 160, 7), rng.randint(0, 160, 5)
    packed = jnp.asarray(np.concatenate([a, b])[None])
    positions = jnp.asarray(np.concatenate([np.arange(7), np.arange(5)])[None])
    segments = jnp.asarray(np.array([1] * 7 + [2] * 5)[None])
    out = np.asarray(model(packed, positions=positions, segment_ids=segments))[0]
    np.testing.assert_allclose(out[:7], np.asarray(model(jnp.asarray(a[None])))[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[7:], np.asarray(model(jnp.asarray(b[None])))[0], atol=1e-5, rtol=0)


def test_kv_cache_decoding_equals_full_forward(tiny):
    _, _, model = tiny
    ids = jnp.asarray(np.random.RandomState(3).randint(0, 160, (2, 12)))
    full = np.asarray(model(ids))
    cache = KVCache.zeros(model.config, 2, 16)
    hidden, cache = model.hidden_states(ids[:, :8], cache=cache)
    steps = [np.asarray(model.logits(hidden))]
    for t in range(8, 12):
        positions = jnp.full((2, 1), t, jnp.int32)
        hidden, cache = model.hidden_states(ids[:, t : t + 1], positions, cache=cache)
        steps.append(np.asarray(model.logits(hidden)))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


def test_save_hf_round_trip(tiny, tmp_path):
    reference, _, model = tiny
    # A small shard limit forces the sharded layout with an index.
    out = save_hf(model, None, tmp_path / "export", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded_torch = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = np.random.RandomState(4).randint(0, 160, (2, 10))
    np.testing.assert_array_equal(_logits(reloaded_torch, ids), _logits(reference, ids))
    reloaded = load_hf_params(out)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(reloaded))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_config_round_trip(tiny):
    reference, _, model = tiny
    assert ModelConfig.from_hf_config(model.config.to_hf_config()) == model.config
    assert ModelConfig.from_hf_config(reference.config) == model.config


def _reference_logprobs(model, ids, positions=None, segments=None):
    logits = model(ids, positions=positions, segment_ids=segments)
    return np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(ids)[..., None], -1)[..., 0]


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_chunked_logprobs_equal_log_softmax(tiny, chunk):
    _, _, model = tiny
    rng = np.random.RandomState(5)
    ids = jnp.asarray(rng.randint(0, 160, (2, 13)))
    segments = jnp.asarray(np.array([[1] * 6 + [2] * 7, [1] * 13]))
    positions = jnp.asarray(np.array([list(range(6)) + list(range(7)), list(range(3, 16))]))
    logp, entropy = model.token_logprobs(ids, ids, positions, segments, chunk_size=chunk, with_entropy=True)
    np.testing.assert_allclose(np.asarray(logp), _reference_logprobs(model, ids, positions, segments), atol=1e-5)
    probs = jax.nn.softmax(model(ids, positions=positions, segment_ids=segments))
    expected_entropy = -np.sum(np.asarray(probs) * np.log(np.asarray(probs) + 1e-30), -1)
    np.testing.assert_allclose(np.asarray(entropy), expected_entropy, atol=1e-4)


def test_chunked_logprob_gradients_equal_full(tiny):
    _, _, model = tiny
    ids = jnp.asarray(np.random.RandomState(6).randint(0, 160, (2, 9)))
    graphdef, params = nnx.split(model)

    def chunked(p):
        return nnx.merge(graphdef, p).token_logprobs(ids, ids, chunk_size=4)[0].sum()

    def full(p):
        return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(nnx.merge(graphdef, p)(ids)), ids[..., None], -1))

    for a, b in zip(
        jax.tree.leaves(jax.jit(jax.grad(chunked))(params)), jax.tree.leaves(jax.jit(jax.grad(full))(params))
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_bfloat16_params_and_compute(tiny):
    _, directory, model = tiny
    half = load_hf_params(directory, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert half.embed[...].dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.RandomState(7).randint(0, 160, (1, 8)))
    out = np.asarray(half(ids))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.asarray(model(ids)), atol=0.1)


# Bad input: one clear error naming the problem.


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_params(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_hf_params(tmp_path)


def test_corrupt_safetensors(tiny, tmp_path):
    _, directory, model = tiny
    out = save_hf(model, None, tmp_path / "m")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt safetensors file .*model.safetensors"):
        load_hf_params(out)


def test_missing_tensor_is_named(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, directory, model = tiny
    out = save_hf(model, None, tmp_path / "m")
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf_params(out)


def test_hub_name_not_cached_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="hf download Qwen/Qwen3-1.7B"):
        load_model("Qwen/Qwen3-1.7B")


# The embedded default: our GGUF import against transformers' own GGUF loading of the same file.


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer = load_model(EMBEDDED)
    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, tokenizer, reference


@pytest.mark.parametrize("saved_as", [None, "Qwen2Tokenizer", "LlamaTokenizer", "no class"])
def test_load_tokenizer_is_autotokenizers_choice(saved_as, tmp_path):
    """The class ``tokenizer_config.json`` names (the embedded one's, Qwen's, Llama's), or none."""
    import transformers

    directory = resolve(EMBEDDED)
    if saved_as is not None:
        cls = getattr(transformers, saved_as, transformers.AutoTokenizer)
        cls.from_pretrained(directory).save_pretrained(tmp_path)
        directory = tmp_path
    if saved_as == "no class":
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        del config["tokenizer_class"]
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, auto = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert type(ours) is type(auto) and (saved_as in (None, "no class") or type(ours).__name__ == saved_as)
    text = "Go to cabinet 1,  then\n\nclick[x-large] <|im_end|>"
    assert ours(text)["input_ids"] == auto(text)["input_ids"] and len(ours) == len(auto)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)


def test_a_runs_process_does_not_import_torch(tmp_path):
    """The trainer's modules, a tokenizer and a metrics line load no torch (2 s at each start;
    only the vLLM server, its own process, needs it)."""
    script = (
        "import sys, experiments.train_alfworld, orsd_jax.services, orsd_jax.trainer\n"
        "from orsd_jax.models import EMBEDDED, load_tokenizer, resolve\n"
        "from orsd_jax.metrics_log import MetricsLog\n"
        "load_tokenizer(resolve(EMBEDDED))\n"
        f"MetricsLog({str(tmp_path)!r}).write(1, {{'loss': 0.5}})\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


def test_embedded_config(embedded):
    model, tokenizer, _ = embedded
    c = model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert c.tie_word_embeddings and c.vocab_size == 49152 and c.rope_theta == 1e5
    assert tokenizer.decode([c.eos_token_id]) == "<|im_end|>"


def test_embedded_matches_transformers_gguf_loading(embedded):
    model, tokenizer, reference = embedded
    fmt = chat.chat_format(tokenizer)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits."]
    rows = [chat.prompt_ids(fmt, tokenizer, text) for text in prompts]
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(right_padded(rows, max(map(len, rows))))))
    for logits, ids in zip(ours, rows):
        with one_torch_thread():
            np.testing.assert_allclose(logits[: len(ids)], _logits(reference, [ids])[0], atol=1e-3, rtol=0)
    # Greedy continuation of 32 tokens, ours with the KV cache (jitted: prefill, then one token a step).
    ids = chat.prompt_ids(fmt, tokenizer, "Write a short story about a cat who learns to fly.")
    with one_torch_thread():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, positions, cache):
        m = nnx.merge(graphdef, state)
        hidden, cache = m.hidden_states(tokens, positions, cache=cache)
        return jnp.argmax(m.logits(hidden[:, -1]), axis=-1), cache

    cache = KVCache.zeros(model.config, 1, len(ids) + 32)
    token, cache = step(state, jnp.asarray([ids]), jnp.arange(len(ids))[None], cache)
    out = [int(token[0])]
    while len(out) < 32 and out[-1] not in chat.stop_token_ids(tokenizer):
        token, cache = step(state, token[:, None], jnp.asarray([[len(ids) + len(out) - 1]]), cache)
        out.append(int(token[0]))
    assert len(expected) == 32 and out == expected


def test_chat_prompt_ids_match_template_and_share_prefix(embedded):
    _, tokenizer, _ = embedded
    fmt = chat.chat_format(tokenizer)
    text = "You are in a room. Your task is to: put a mug on the desk."
    without = chat.prompt_ids(fmt, tokenizer, text)
    with_insert = chat.prompt_ids(fmt, tokenizer, text, insert="\n\nCriteria: 1. be quick")
    template = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    template = template["input_ids"] if isinstance(template, dict) or hasattr(template, "keys") else template
    assert without == list(template)
    shared = len(without) - len(fmt.tail)
    assert with_insert[:shared] == without[:shared] and with_insert[-len(fmt.tail) :] == list(fmt.tail)
    assert tokenizer.decode(with_insert).endswith("be quick<|im_end|>\n<|im_start|>assistant\n")
    assert fmt.stop_token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_frozen_layers_get_no_gradient_and_leave_the_rest_unchanged(tiny):
    _, _, model = tiny
    ids = jnp.asarray(np.random.RandomState(8).randint(0, 160, (2, 9)))
    frozen = CausalLM(dataclasses.replace(model.config, frozen_layers=2), nnx.Rngs(0))
    nnx.update(frozen, nnx.state(model))

    def grads(m):  # jitted, as in training
        graphdef, params = nnx.split(m)
        return jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p).token_logprobs(ids, ids)[0].sum()))(params)

    full, part = grads(model), grads(frozen)
    for (path, g_full), (_, g_part) in zip(nnx.to_flat_state(full), nnx.to_flat_state(part)):
        g_full, g_part = np.asarray(g_full[...]), np.asarray(g_part[...])
        if path[0] == "layers":
            np.testing.assert_array_equal(g_part[:2], 0)
            np.testing.assert_allclose(g_part[2:], g_full[2:], atol=1e-6, rtol=1e-5)
        elif path[0] == "embed":  # untied: reachable only through the frozen layers; tied: the head's share
            assert (np.abs(g_part).max() > 0) == model.config.tie_word_embeddings
        else:
            np.testing.assert_allclose(g_part, g_full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t", [8, 13, 64])
def test_query_blocks_equal_dense_attention(t):
    """Blocks of queries that skip later keys give dense attention's output under any causal mask:
    here packed tree masks (a shared prefix and two branches). Padding queries see no key, and
    their output, never read, differs."""
    rng = np.random.RandomState(t)
    q, k, v = (jnp.asarray(rng.randn(2, t, *shape).astype(np.float32)) for shape in ((6, 8), (2, 8), (2, 8)))
    cut, end = t // 3, t - 2  # prefix [0, cut), branch 1 [cut, end - (end - cut) // 2), branch 2 after it, padding last
    middle = cut + (end - cut) // 2
    reach = np.full((2, t), PAD)
    reach[:, :cut], reach[:, cut:middle], reach[:, middle:end] = end - 1, middle - 1, end - 1
    mask = attention_mask(jnp.asarray(reach))
    dense = attend(q, k, v, mask)
    blocked = attend(q, k, v, mask, causal=True)
    np.testing.assert_allclose(np.asarray(blocked)[:, :end], np.asarray(dense)[:, :end], atol=1e-5, rtol=0)
