"""An in-process sampler: jit-compiled prefill plus a decode loop over a KV cache.

Prompts are right-padded; each row writes its keys at slot = position, so a row's padding
slots are overwritten by its own decoded tokens before any query can see them. Batch size,
prompt length and cache length are rounded up to buckets so a run compiles a bounded number
of programs. The whole decode loop is one ``lax.while_loop`` that stops when every row is done.
Stop strings are applied on the host afterwards (tokens up to the one completing the string
are kept, the text is cut before it or after it with ``include_stop``, as vLLM reports them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax import chat
from orsd_jax.models import CausalLM, KVCache
from orsd_jax.sampling.base import Completion, SamplingError, SamplingParams, validate_prompts


def _bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _batch_bucket(n: int, max_batch: int) -> int:
    return min(max_batch, 1 << max(0, (n - 1).bit_length()))


def processed_logprobs(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Log-probs ``[B, V]`` of the distribution actually sampled from (temperature, top-k, top-p)."""
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        cutoff_index = jnp.sum(cumulative - jax.nn.softmax(sorted_logits, axis=-1) < top_p, axis=-1) - 1
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index[:, None], axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.nn.log_softmax(logits, axis=-1)


class JaxSampler:
    """``Sampler`` running the orsd_jax model in this process."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        *,
        max_model_len: int = 2048,
        max_batch: int = 32,
        length_bucket: int = 64,
        seed: int = 0,
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.length_bucket = length_bucket
        self.weight_version = 0
        self._graphdef, self._state = nnx.split(model)
        self._config = model.config
        self._key = jax.random.key(seed)

    def push_weights(self, model: CausalLM, version: int) -> None:
        graphdef, state = nnx.split(model)
        old = jax.tree.map(lambda x: (x.shape, x.dtype), self._state)
        new = jax.tree.map(lambda x: (x.shape, x.dtype), state)
        if graphdef != self._graphdef or old != new:
            raise SamplingError("pushed weights do not match the served model's structure or shapes")
        if version <= self.weight_version:
            raise SamplingError(f"weight version must increase: have {self.weight_version}, got {version}")
        self._state, self.weight_version = state, version

    def close(self) -> None:
        pass

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        validate_prompts(prompt_token_ids, self.max_model_len, params)
        if params.regex is not None:
            raise SamplingError("JaxSampler samples without constraints; a regex needs the vLLM sampler")
        if params.seed is not None:
            key = jax.random.key(params.seed)
        else:
            self._key, key = jax.random.split(self._key)
        rows = [list(p) for p in prompt_token_ids for _ in range(params.n)]
        out: list[Completion] = []
        for start in range(0, len(rows), self.max_batch):
            key, sub = jax.random.split(key)
            out += self._generate_batch(rows[start : start + self.max_batch], params, sub)
        return out

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams, key) -> list[Completion]:
        n = len(rows)
        batch = _batch_bucket(n, self.max_batch)
        prompt_len = _bucket(max(map(len, rows)), self.length_bucket)
        new_tokens = min(params.max_new_tokens, self.max_model_len - min(map(len, rows)))
        cache_len = min(
            _bucket(prompt_len + new_tokens, self.length_bucket), _bucket(self.max_model_len, self.length_bucket)
        )
        tokens = np.zeros((batch, prompt_len), np.int32)
        lengths = np.ones((batch,), np.int32)
        budget = np.zeros((batch,), np.int32)  # new tokens each row may emit (room in the context)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
            lengths[i] = len(row)
            budget[i] = min(params.max_new_tokens, self.max_model_len - len(row))
        stop_ids = jnp.asarray(params.stop_token_ids or (-1,), jnp.int32)
        out_tokens, out_logp, n_out, hit_stop = _decode(
            self._graphdef,
            self._config,
            _bucket(new_tokens, 8),
            params.temperature,
            params.top_k,
            params.top_p,
            self._state,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jnp.asarray(budget),
            stop_ids,
            key,
            cache_len,
        )
        out_tokens, out_logp, n_out, hit_stop = map(np.asarray, (out_tokens, out_logp, n_out, hit_stop))
        return [
            self._completion(out_tokens[i, : n_out[i]], out_logp[i, : n_out[i]], bool(hit_stop[i]), params)
            for i in range(n)
        ]

    def _completion(
        self, ids: np.ndarray, logp: np.ndarray, hit_stop_token: bool, params: SamplingParams
    ) -> Completion:
        ids, logp = ids.tolist(), logp.tolist()
        finish = "stop" if hit_stop_token else "length"
        text = chat.decode(self.tokenizer, ids)
        if params.stop:
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                # Keep tokens up to the one that completes the earliest stop string.
                end = min(i + len(s) for i, s in hits)
                k = next(k for k in range(1, len(ids) + 1) if len(chat.decode(self.tokenizer, ids[:k])) >= end)
                ids, logp, finish = ids[:k], logp[:k], "stop"
                text = text[:end] if params.include_stop else text[: min(i for i, _ in hits)]
        return Completion(tuple(ids), tuple(logp), text, finish, self.weight_version)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 12))
def _decode(
    graphdef, config, max_new, temperature, top_k, top_p, state, tokens, lengths, budget, stop_ids, key, cache_len
):
    """Returns tokens ``[B, max_new]``, their log-probs, counts ``[B]`` and whether a stop token ended the row."""
    model = nnx.merge(graphdef, state)
    batch, prompt_len = tokens.shape
    rows = jnp.arange(batch)

    def sample(logits, key):
        raw = jax.nn.log_softmax(logits, axis=-1)
        if temperature == 0:
            token = jnp.argmax(logits, axis=-1)
            return token, raw[rows, token]
        logp = processed_logprobs(logits, temperature, top_k, top_p)
        token = jax.random.categorical(key, logp, axis=-1)
        return token, logp[rows, token]

    cache = KVCache.zeros(config, batch, cache_len)
    positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
    hidden, cache = model.hidden_states(tokens, positions, cache=cache)
    key, sub = jax.random.split(key)
    token, logp = sample(model.logits(hidden[rows, lengths - 1]), sub)

    out_tokens = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(token)
    out_logp = jnp.zeros((batch, max_new), jnp.float32).at[:, 0].set(logp)
    stopped = jnp.isin(token, stop_ids)
    done = stopped | (budget <= 1)
    count = jnp.ones((batch,), jnp.int32)

    def cond(carry):
        step, done = carry[0], carry[5]
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, cache, token, out_tokens, out_logp, done, stopped, count, key = carry
        positions = (lengths + step - 1)[:, None]
        hidden, cache = model.hidden_states(token[:, None], positions, cache=cache)
        key, sub = jax.random.split(key)
        new, logp = sample(model.logits(hidden[:, 0]), sub)
        active = ~done
        out_tokens = out_tokens.at[:, step].set(jnp.where(active, new, 0))
        out_logp = out_logp.at[:, step].set(jnp.where(active, logp, 0.0))
        count = count + active
        hit = active & jnp.isin(new, stop_ids)
        stopped = stopped | hit
        done = done | hit | (count >= budget)
        return step + 1, cache, jnp.where(active, new, token), out_tokens, out_logp, done, stopped, count, key

    carry = (1, cache, token, out_tokens, out_logp, done, stopped, count, key)
    _, _, _, out_tokens, out_logp, _, stopped, count, _ = jax.lax.while_loop(cond, body, carry)
    return out_tokens, out_logp, count, stopped
