"""An in-process sampler: jit-compiled prefill plus a decode loop over a KV cache.

Prompts are right-padded; each row writes its keys at slot = position, so a row's padding
slots are overwritten by its own decoded tokens before any query can see them. Batch size,
prompt length and cache length are rounded up to buckets so a run compiles a bounded number
of programs. The whole decode loop is one ``lax.while_loop`` that stops when every row is done.
Stop strings are applied on the host afterwards (tokens up to the one completing the string
are kept, the text is cut before it or after it with ``include_stop``, as vLLM reports them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orsd_jax import chat
from orsd_jax.models import CausalLM, KVCache, ModelConfig
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

    concurrent_calls = False  # written for one caller: asynchronous episodes take turns on it

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

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams, groups: Sequence[int] | None = None
    ) -> list[Completion]:  # one model in this process: ``groups`` route nothing
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
        spec = DecodeSpec(
            self._config, _bucket(new_tokens, 8), cache_len, params.temperature, params.top_k, params.top_p
        )
        end = _decode(
            self._graphdef,
            spec,
            self._state,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jnp.asarray(budget),
            stop_ids,
            key,
        )
        out_tokens, out_logp, n_out, hit_stop = map(np.asarray, (end.tokens, end.logp, end.count, end.stopped))
        return [
            self._completion(out_tokens[i, : n_out[i]], out_logp[i, : n_out[i]], bool(hit_stop[i]), params)
            for i in range(n)
        ]

    def _completion(
        self, token_ids: np.ndarray, token_logp: np.ndarray, hit_stop_token: bool, params: SamplingParams
    ) -> Completion:
        ids: list[int] = token_ids.tolist()
        logp: list[float] = token_logp.tolist()
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


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What one compiled decode program is for (hashable: part of the jit cache key)."""

    config: ModelConfig
    max_new: int  # output slots
    cache_len: int
    temperature: float
    top_k: int
    top_p: float


@flax.struct.dataclass
class DecodeState:
    """The decode loop's carry."""

    step: jax.Array  # the next output slot
    cache: KVCache
    token: jax.Array  # [B] each row's last token
    tokens: jax.Array  # [B, max_new] emitted tokens (0 after a row is done)
    logp: jax.Array  # [B, max_new] their log-probs
    done: jax.Array  # [B]
    stopped: jax.Array  # [B] a stop token ended the row
    count: jax.Array  # [B] tokens emitted
    key: jax.Array


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode(graphdef, spec: DecodeSpec, state, tokens, lengths, budget, stop_ids, key) -> DecodeState:
    """Prefill ``tokens`` ``[B, P]`` (row lengths ``lengths``), then decode until each row has emitted
    ``budget`` tokens or a stop token; the final state holds tokens, log-probs, counts and stops."""
    model = nnx.merge(graphdef, state)
    batch, prompt_len = tokens.shape
    rows = jnp.arange(batch)

    def sample(logits, key):
        raw = jax.nn.log_softmax(logits, axis=-1)
        if spec.temperature == 0:
            token = jnp.argmax(logits, axis=-1)
            return token, raw[rows, token]
        logp = processed_logprobs(logits, spec.temperature, spec.top_k, spec.top_p)
        token = jax.random.categorical(key, logp, axis=-1)
        return token, logp[rows, token]

    cache = KVCache.zeros(spec.config, batch, spec.cache_len)
    positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
    hidden, cache = model.hidden_states(tokens, positions, cache=cache)
    key, sub = jax.random.split(key)
    token, logp = sample(model.logits(hidden[rows, lengths - 1]), sub)
    stopped = jnp.isin(token, stop_ids)
    first = DecodeState(
        step=jnp.asarray(1, jnp.int32),
        cache=cache,
        token=token,
        tokens=jnp.zeros((batch, spec.max_new), jnp.int32).at[:, 0].set(token),
        logp=jnp.zeros((batch, spec.max_new), jnp.float32).at[:, 0].set(logp),
        done=stopped | (budget <= 1),
        stopped=stopped,
        count=jnp.ones((batch,), jnp.int32),
        key=key,
    )

    def cond(s: DecodeState):
        return (s.step < spec.max_new) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        positions = (lengths + s.step - 1)[:, None]
        hidden, cache = model.hidden_states(s.token[:, None], positions, cache=s.cache)
        key, sub = jax.random.split(s.key)
        new, logp = sample(model.logits(hidden[:, 0]), sub)
        active = ~s.done
        count = s.count + active
        hit = active & jnp.isin(new, stop_ids)
        return DecodeState(
            step=s.step + 1,
            cache=cache,
            token=jnp.where(active, new, s.token),
            tokens=s.tokens.at[:, s.step].set(jnp.where(active, new, 0)),
            logp=s.logp.at[:, s.step].set(jnp.where(active, logp, 0.0)),
            done=s.done | hit | (count >= budget),
            stopped=s.stopped | hit,
            count=count,
            key=key,
        )

    return jax.lax.while_loop(cond, body, first)
