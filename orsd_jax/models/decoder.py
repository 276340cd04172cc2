"""The one causal decoder: Llama (SmolLM2) and Qwen3 dense models in Flax NNX.

Both families share one block: pre-norm RMSNorm, grouped-query attention with rotary position
embeddings, a SwiGLU MLP. Qwen3 adds an RMSNorm over ``head_dim`` on queries and keys before
RoPE, and its ``head_dim`` need not equal ``hidden_size / num_heads``.

Layers are created with ``nnx.vmap`` so every parameter carries a leading ``[L]`` axis, and run
with ``jax.lax.scan``: one compiled layer body whatever the depth, which keeps compile times
short on CPU and lets ``remat`` wrap exactly one layer.

Shapes: B batch, T query length, S key length, D hidden, N query heads, K key/value heads,
H head dim, F MLP width, V vocabulary, L layers (the public methods' ``jaxtyping`` annotations use
them; nothing checks them at run time). The training loss runs the model on a batch's rows:
``orsd_jax.batch`` names them R.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Bool, Float, Float32, Int

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked rows stay NaN-free


class UnsupportedModelError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Not part of the checkpoint: how this process stores and computes.
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False  # recompute each layer in the backward pass instead of storing activations
    frozen_layers: int = 0  # the first N layers (and the embedding) get no gradient: a cheap CPU fine-tune

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: {sorted(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 <= self.frozen_layers <= self.num_layers:
            raise ValueError(f"frozen_layers must be in [0, {self.num_layers}], got {self.frozen_layers}")

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any, **overrides) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict or ``PretrainedConfig``."""
        hf = dict(hf if isinstance(hf, Mapping) else hf.to_dict())
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures {hf.get('architectures')}); "
                f"orsd_jax supports {sorted(ARCHITECTURES)}"
            )
        rope: Mapping[str, Any] = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"unsupported RoPE scaling {rope_type!r}; only plain RoPE is implemented")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if hf.get(flag):
                raise UnsupportedModelError(f"unsupported config option {flag}=True for {model_type}")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported activation {hf['hidden_act']!r}; only silu is implemented")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        fields = dict(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers and vLLM load as it is."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
        }
        if self.architecture == "llama":
            out["mlp_bias"] = False
        else:
            out["use_sliding_window"] = False
        return out


class KVCache(NamedTuple):
    """Keys and values of every layer, written at slot = token position unless ``hidden_states`` is
    given other slots."""

    k: Float[jax.Array, "L B S K H"]
    v: Float[jax.Array, "L B S K H"]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
        dtype = jnp.dtype(config.compute_dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float = 0.02) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in f32 and scale in the input dtype, as the reference implementations do.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * xf.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotates ``x [B, T, heads, H]`` by ``positions [B, T]`` (half-split layout, computed in f32)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


QUERY_BLOCKS = 4


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, causal: bool = False) -> jax.Array:
    """Grouped-query attention: q ``[B, T, N, H]``, k/v ``[B, S, K, H]``, mask ``bool[B, T, S]``.

    ``causal``: keys and queries are the same ``T`` tokens and the mask never lets a token see a
    later one, so each of ``QUERY_BLOCKS`` blocks of queries is scored against the keys up to its
    end only: about 5/8 of the dense ``[T, T]`` work, which dominates a layer at agent prompt
    lengths on CPU (docs/benchmarks.md, "The train step"). A query that sees no key (padding)
    gets a meaningless output either way, not the same one.
    """
    if not causal:
        return _attend(q, k, v, mask)
    blocks = query_blocks(q.shape[1])
    return jnp.concatenate([_attend(q[:, a:e], k[:, :e], v[:, :e], mask[:, a:e, :e]) for a, e in blocks], axis=1)


def query_blocks(t: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the causal attention's query blocks over ``t`` tokens: ``QUERY_BLOCKS``
    of them, or one when ``t`` is too short to split."""
    if t < 2 * QUERY_BLOCKS:
        return [(0, t)]
    size = -(-t // QUERY_BLOCKS)
    return [(start, min(start + size, t)) for start in range(0, t, size)]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * h**-0.5
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, n, kv, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        dtype = jnp.dtype(config.param_dtype)
        self.q = _param(rngs, (d, n, h), dtype)
        self.k = _param(rngs, (d, kv, h), dtype)
        self.v = _param(rngs, (d, kv, h), dtype)
        self.o = _param(rngs, (n, h, d), dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(h, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.config = config

    def __call__(self, x, positions, mask, cache: tuple[jax.Array, jax.Array] | None, slots=None):
        """x ``[B, T, D]`` -> ``(out [B, T, D], (k, v))``: with ``cache`` (k, v ``[B, S, K, H]``) the
        keys are written at ``slots`` (default: their positions) and the updated cache comes back;
        without, this call's own keys and values ``[B, T, K, H]`` (the two-stream replay attends to
        a prefix's)."""
        dt = x.dtype
        q = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x, self.k[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.v[...].astype(dt))
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q, positions, self.config.rope_theta)
        k = rotary(k, positions, self.config.rope_theta)
        if cache is not None:
            rows, slots = jnp.arange(x.shape[0])[:, None], positions if slots is None else slots
            k = cache[0].at[rows, slots].set(k.astype(cache[0].dtype))
            v = cache[1].at[rows, slots].set(v.astype(cache[1].dtype))
        out = attend(q, k.astype(dt), v.astype(dt), mask, causal=cache is None)
        return jnp.einsum("btnh,nhd->btd", out, self.o[...].astype(dt)), (k, v)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, f, dtype = config.hidden_size, config.intermediate_size, jnp.dtype(config.param_dtype)
        self.gate = _param(rngs, (d, f), dtype)
        self.up = _param(rngs, (d, f), dtype)
        self.down = _param(rngs, (f, d), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        # [B, T, D] as [B * T, D]: XLA:CPU runs the weight gradients (a contraction over B and T)
        # as one GEMM instead of a slow two-axis one (docs/benchmarks.md, "The train step").
        x2 = x.reshape(-1, x.shape[-1])
        hidden = jax.nn.silu(x2 @ self.gate[...].astype(dt)) * (x2 @ self.up[...].astype(dt))
        return (hidden @ self.down[...].astype(dt)).reshape(x.shape)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.param_dtype)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, positions, mask, cache=None, slots=None):
        attn_out, cache = self.attn(self.attn_norm(x), positions, mask, cache, slots)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), cache


def segment_mask(segment_ids: Int[jax.Array, "B T"]) -> Bool[jax.Array, "B T T"]:
    """Causal attention within packed segments."""
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


class CausalLM(nnx.Module):
    """``model(input_ids [B, T]) -> float32[B, T, V]`` logits."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.param_dtype)
        self.config = config
        self.embed = _param(rngs, (config.vocab_size, config.hidden_size), dtype)

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(layer_rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, layer_rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, (config.vocab_size, config.hidden_size), dtype)

    @property
    def unembedding(self) -> Float[jax.Array, "V D"]:
        """The output projection (the embedding when tied)."""
        return (self.embed if self.config.tie_word_embeddings else self.lm_head)[...]

    def hidden_states(
        self,
        input_ids: Int[np.ndarray | jax.Array, "B T"],
        positions: Int[np.ndarray | jax.Array, "B T"] | None = None,
        segment_ids: Int[jax.Array, "B T"] | None = None,
        *,
        mask: Bool[jax.Array, "B T S"] | None = None,
        cache: KVCache | None = None,
        slots: Int[jax.Array, "B T"] | None = None,
        frozen: Float[np.ndarray | jax.Array, "B T D"] | None = None,
        keys_values: bool = False,
    ) -> tuple[Float[jax.Array, "B T D"], KVCache | None]:
        """Final-normed hidden states and the updated cache when one is given; without a cache,
        ``keys_values`` returns every layer's keys and values of these tokens instead (a ``KVCache``
        of ``[L, B, T, K, H]``, under stop-gradient), else ``None``.

        ``slots``: where a cache receives these tokens' keys (default: their positions). ``mask``
        overrides the default (causal within ``segment_ids``; with a cache: every slot at or before
        the query's position); without a cache it must never let a token see a later one
        (``attend`` skips those keys), and ``S`` is ``T``. ``frozen``: ``frozen_states`` of the same
        inputs, computed earlier (frozen weights give the same states every epoch), so only the
        trainable layers run.
        """
        positions, mask = self._positions_and_mask(input_ids, positions, segment_ids, mask, cache)
        k = self.config.frozen_layers
        if cache is not None:
            x, new_cache = self._layers(self._embed(input_ids), positions, mask, slice(None), tuple(cache), slots=slots)
            return self.final_norm(x), KVCache(*new_cache)
        if keys_values:
            if frozen is not None:
                raise ValueError("keys_values needs the frozen layers' keys: run them (frozen=None)")
            x, bottom = self._layers(self._embed(input_ids), positions, mask, slice(0, k), keys_values=True)
            x, top = self._layers(
                jax.lax.stop_gradient(x) if k else x, positions, mask, slice(k, None), keys_values=True
            )
            return self.final_norm(x), KVCache(*(jnp.concatenate(pair) for pair in zip(bottom, top)))
        if frozen is None:
            frozen = self.frozen_states(input_ids, positions, mask=mask)
        x, _ = self._layers(frozen.astype(jnp.dtype(self.config.compute_dtype)), positions, mask, slice(k, None))
        return self.final_norm(x), None

    def frozen_states(
        self,
        input_ids: Int[np.ndarray | jax.Array, "B T"],
        positions: Int[np.ndarray | jax.Array, "B T"] | None = None,
        segment_ids: Int[jax.Array, "B T"] | None = None,
        *,
        mask: Bool[jax.Array, "B T T"] | None = None,
    ) -> Float[jax.Array, "B T D"]:
        """The residual stream after the embedding and the first ``frozen_layers`` layers. With
        frozen layers the embedding is frozen too and the result is under stop-gradient, so the
        backward pass skips them entirely."""
        x = self._embed(input_ids)
        k = self.config.frozen_layers
        if not k:
            return x
        positions, mask = self._positions_and_mask(input_ids, positions, segment_ids, mask)
        return jax.lax.stop_gradient(self._layers(jax.lax.stop_gradient(x), positions, mask, slice(0, k))[0])

    def _embed(self, input_ids: np.ndarray | jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], input_ids, axis=0).astype(jnp.dtype(self.config.compute_dtype))

    def _positions_and_mask(self, input_ids, positions, segment_ids, mask, cache=None):
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if mask is None:
            if cache is not None:
                mask = jnp.arange(cache.k.shape[2])[None, None, :] <= positions[:, :, None]
            else:
                mask = segment_mask(jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids)
        return positions, mask

    def _layers(self, x, positions, mask, layers: slice, cache=None, keys_values: bool = False, slots=None):
        """Runs the stacked layers ``layers`` over ``x [B, T, D]`` with a scan; returns the output and
        the layers' updated cache slices, or (``keys_values``, no cache) their keys and values under
        stop-gradient, or ``None``."""
        graphdef, layer_state = nnx.split(self.layers)
        layer_state = jax.tree.map(lambda a: a[layers], layer_state)

        def body(h, layer_in):
            state, layer_cache = layer_in
            h, kv = nnx.merge(graphdef, state)(h, positions, mask, layer_cache, slots)
            if layer_cache is None:
                kv = jax.lax.stop_gradient(kv) if keys_values else None
            return h, kv

        if self.config.remat:
            body = jax.checkpoint(body)
        return jax.lax.scan(body, x, (layer_state, cache))

    def logits(self, hidden: Float[jax.Array, "*shape D"]) -> Float32[jax.Array, "*shape V"]:
        """The LM head, in float32 whatever the compute dtype."""
        w = self.unembedding.astype(hidden.dtype)
        return jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)

    def __call__(
        self,
        input_ids: Int[np.ndarray | jax.Array, "B T"],
        positions: Int[np.ndarray | jax.Array, "B T"] | None = None,
        segment_ids: Int[jax.Array, "B T"] | None = None,
    ) -> Float32[jax.Array, "B T V"]:
        hidden, _ = self.hidden_states(input_ids, positions, segment_ids)
        return self.logits(hidden)

    def token_logprobs(
        self,
        input_ids: Int[jax.Array, "B T"],
        targets: Int[jax.Array, "B T"],
        positions: Int[jax.Array, "B T"] | None = None,
        segment_ids: Int[jax.Array, "B T"] | None = None,
        *,
        mask: Bool[jax.Array, "B T T"] | None = None,
        chunk_size: int = 256,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[Float32[jax.Array, "B T"], Float32[jax.Array, "B T"] | None]:
        """``log p(targets[b, t] | input_ids[b, :t+1])``, never building ``[B, T, V]``.

        See ``logprobs_from_hidden``; also returns the entropy if asked.
        """
        hidden, _ = self.hidden_states(input_ids, positions, segment_ids, mask=mask)
        return self.logprobs_from_hidden(
            hidden, targets, chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy
        )

    def logprobs_from_hidden(
        self,
        hidden: Float[jax.Array, "B T D"],
        targets: Int[np.ndarray | jax.Array, "B T"],
        *,
        chunk_size: int = 256,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[Float32[jax.Array, "B T"], Float32[jax.Array, "B T"] | None]:
        """Log-probs of ``targets`` under the logits of ``hidden`` (and entropies).

        Logits are computed ``chunk_size`` positions at a time under ``jax.checkpoint``, so forward
        and backward hold at most ``[B, chunk_size, V]``. Logits are divided by ``temperature``
        (to match a sampler's processed log-probs).
        """
        b, t, d = hidden.shape
        chunk = min(chunk_size, t)
        n_chunks = -(-t // chunk)
        pad = n_chunks * chunk - t
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n_chunks, chunk, d)
        targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n_chunks, chunk)

        @jax.checkpoint
        def one_chunk(args):
            h, tgt = args
            logits = self.logits(h) / temperature
            lse = jax.nn.logsumexp(logits, axis=-1)
            logp = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0] - lse
            if not with_entropy:
                return logp, None
            return logp, lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)

        def unchunk(x):  # [n_chunks, B, chunk] -> [B, T]
            return x.swapaxes(0, 1).reshape(b, -1)[:, :t]

        logp, entropy = jax.lax.map(one_chunk, (hidden.swapaxes(0, 1), targets.swapaxes(0, 1)))
        return unchunk(logp), (unchunk(entropy) if with_entropy else None)
