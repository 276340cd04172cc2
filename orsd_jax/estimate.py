"""Memory and FLOPs of one ORSD update, per device, for a model config, a packed batch shape and a mesh.

For planning (which presets fit on which machines), not for allocation: activations are an
estimate of what the backward pass keeps, to within tens of percent. Assumptions, matching
``orsd_jax.train_step`` and ``orsd_jax.loss``:

- Parameters, gradients and AdamW moments in ``param_dtype`` (optax keeps moments in the
  parameters' dtype); with micro-batches, a float32 gradient accumulator besides.
  With FSDP all of these are divided by the device count; one layer's weights are gathered at a
  time (the layers run in a ``lax.scan``).
- Activations of the packed layout (an upper bound for the default two-stream replay, whose
  gradient stream is shorter and whose with-rubric stream keeps nothing but every layer's prefix
  keys and values): one micro-batch of ``rows / (devices * micro_batches)`` packed rows of
  ``seq_len`` tokens in ``compute_dtype``. Without remat, every layer keeps its intermediates
  (including the ``[heads, T, T]`` attention scores and probabilities); with remat, every layer
  keeps its input and one layer at a time is recomputed.
- The LM head runs on the ``2 * response_len`` gathered positions of a row, in chunks.
- FLOPs: ``2 * weights`` per token and matmul, attention of each query block against the keys up
  to its end (``decoder.query_blocks``: about 5/8 of ``T x T``), backward twice the forward, remat
  one more forward.

``python -m orsd_jax.estimate`` prints the paper's presets on 4 x A100 80GB.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from orsd_jax.models import ModelConfig
from orsd_jax.models.decoder import query_blocks

GB = 1e9

# The paper's models (Hugging Face config.json of Qwen/Qwen3-1.7B and Qwen/Qwen3-4B).
QWEN3_1_7B = ModelConfig(
    "qwen3",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
QWEN3_4B = ModelConfig(
    "qwen3",
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
PAPER_MODELS = {"Qwen/Qwen3-1.7B": QWEN3_1_7B, "Qwen/Qwen3-4B": QWEN3_4B}  # planned without their weights


def layer_params(c: ModelConfig) -> int:
    """Parameters of one decoder layer."""
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    norms = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
    return attention + 3 * c.hidden_size * c.intermediate_size + norms


# On CPU a score's softmax and mask cost about what its two matmuls do: one cpu-demo update packed
# in rows of 512, 768 and 1,024 tokens trained in 87.2, 76.4 and 77.2 s, which the row cost of
# ``minibatches.packed_steps`` fits with this factor (docs/benchmarks.md, "The update packed at once");
# with prompt trees its choice, 640, trained in 61.4 s against 65.6 s (768) and 65.0 s (1,024)
# (docs/benchmarks.md, "Prompt trees").
ATTENTION_OVERHEAD = 2.0


def attention_tokens(c: ModelConfig) -> float:
    """The row length at which a token's attention (its matmuls, 4 x heads x head_dim a key, times
    ``ATTENTION_OVERHEAD``) costs what its layers' weights do: 1,536 for SmolLM2-135M."""
    return 2 * layer_params(c) / (ATTENTION_OVERHEAD * 4 * c.num_heads * c.head_dim)


def param_count(c: ModelConfig) -> int:
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_layers * layer_params(c) + c.hidden_size


def attention_pairs(seq_len: int) -> int:
    """(query, key) pairs causal attention scores: each query block against the keys up to its end."""
    return sum((end - start) * end for start, end in query_blocks(seq_len))


def forward_flops(c: ModelConfig, rows: int, seq_len: int, head_positions: int, keys: int | None = None) -> float:
    """Matmul FLOPs of one forward: layers over ``rows x seq_len`` tokens, the LM head on
    ``head_positions`` per row (a packed ORSD row: ``2 Y``, with and without the rubric).
    ``keys``: every query scores that many keys (a cache read densely) instead of causal blocks."""
    matmul_weights = layer_params(c) - 2 * c.hidden_size - (2 * c.head_dim if c.qk_norm else 0)
    layers = 2 * matmul_weights * rows * seq_len * c.num_layers
    pairs = attention_pairs(seq_len) if keys is None else seq_len * keys
    attention = 4 * rows * pairs * c.num_heads * c.head_dim * c.num_layers
    head = 2 * c.vocab_size * c.hidden_size * rows * head_positions
    return float(layers + attention + head)


def frozen_flops(c: ModelConfig, rows: int, seq_len: int) -> float:
    """The frozen bottom layers' (``c.frozen_layers``) forward: no LM head, no backward."""
    return forward_flops(dataclasses.replace(c, num_layers=c.frozen_layers, frozen_layers=0), rows, seq_len, 0)


def trained_flops(c: ModelConfig, rows: int, seq_len: int, head_positions: int) -> float:
    """The trained layers' and the LM head's forward with its backward (2x) and, under remat, its
    recomputation (1x)."""
    trained = dataclasses.replace(c, num_layers=c.num_layers - c.frozen_layers, frozen_layers=0)
    return (4 if c.remat else 3) * forward_flops(trained, rows, seq_len, head_positions)


def train_flops(c: ModelConfig, rows: int, seq_len: int, head_positions: int) -> float:
    """A train step's forward and backward: the frozen layers forward only, the rest trained."""
    return frozen_flops(c, rows, seq_len) + trained_flops(c, rows, seq_len, head_positions)


def step_flops(c: ModelConfig, batch) -> float:
    """The dense work of one train step on ``batch`` (an ``orsd_jax.batch.Batch`` in either layout,
    its shapes only): packed rows with both LM heads, or the two-stream replay's gradient stream
    and its forward-only with-rubric stream, which scores its whole cache (``T + U`` slots). A row
    runs the LM head at ``Batch.head``'s ``M`` positions."""
    b, t = batch.tokens.shape
    head = batch.head.shape[1]
    if batch.rubric_tokens is None:
        return train_flops(c, b, t, 2 * head)
    rows, u = batch.rubric_tokens.shape  # the stream's rows: those with a rubric
    return train_flops(c, b, t, head) + forward_flops(c, rows, u, head, keys=t + u)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device and FLOPs per update."""

    params: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    accumulator_bytes: float
    gathered_bytes: float  # FSDP: one layer's weights and gradients, gathered
    activation_bytes: float
    flops: float  # the whole update, all devices
    devices: int
    device_memory: float
    reference_bytes: float = 0.0  # the KL's frozen reference policy, sharded like the parameters

    @property
    def total_bytes(self) -> float:
        return (
            self.param_bytes
            + self.reference_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.accumulator_bytes
            + self.gathered_bytes
            + self.activation_bytes
        )

    @property
    def fits(self) -> bool:
        """With 10% left for the runtime, XLA's scratch and fragmentation (JAX preallocates 75% of a
        GPU unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise: set it to 0.9)."""
        return self.total_bytes <= 0.9 * self.device_memory


def estimate(
    config: ModelConfig,
    *,
    rows: int,
    seq_len: int,
    response_len: int,
    devices: int,
    micro_batches: int = 1,
    fsdp: bool = False,
    chunk_size: int = 64,
    device_memory_gb: float = 80.0,
    reference: bool = False,
) -> Estimate:
    """One update over ``rows`` packed rows (global) of ``seq_len`` tokens with ``response_len``
    response tokens each, on ``devices`` data-parallel devices; ``reference``: with the KL's
    reference policy (its parameters, and a forward without gradient per step)."""
    c = config
    p_bytes = np.dtype(c.param_dtype).itemsize
    a_bytes = np.dtype(c.compute_dtype).itemsize
    n = param_count(c)
    shard = devices if fsdp else 1
    rows_per_step = -(-rows // (devices * micro_batches))
    tokens = rows_per_step * seq_len
    d, f, heads, kv, h = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    # Per token of one layer: norms and residuals (3 D), q/k/v before and after RoPE and the
    # attention output (3 N H + 3 K H), the MLP's gate, up, activation and product (4 F).
    per_token = (3 * d + 3 * heads * h + 3 * kv * h + 4 * f) * a_bytes
    # float32 scores, masked scores, and the probabilities in the compute dtype, per query block
    scores = rows_per_step * heads * attention_pairs(seq_len) * (8 + a_bytes)
    one_layer = tokens * per_token + scores
    # Only trained layers keep activations for the backward pass; frozen ones (below them, no
    # gradient) need one layer's at a time.
    trained = c.num_layers - c.frozen_layers
    kept = tokens * d * a_bytes * trained + one_layer if c.remat else one_layer * max(trained, 1)
    mask = rows_per_step * seq_len**2  # bool [B, T, T]
    logits = 3 * rows_per_step * min(chunk_size, 2 * response_len) * c.vocab_size * 4
    flops = train_flops(c, rows, seq_len, 2 * response_len) + reference * forward_flops(c, rows, seq_len, response_len)
    return Estimate(
        params=n,
        param_bytes=n * p_bytes / shard,
        grad_bytes=n * p_bytes / shard,
        optimizer_bytes=2 * n * p_bytes / shard,
        accumulator_bytes=n * 4 / shard if micro_batches > 1 else 0.0,
        gathered_bytes=2 * layer_params(c) * p_bytes if fsdp else 0.0,
        activation_bytes=float(kept + mask + logits + tokens * d * a_bytes),
        flops=flops,
        devices=devices,
        device_memory=device_memory_gb * GB,
        reference_bytes=n * p_bytes / shard if reference else 0.0,
    )


# Planning shape of an agent step sample (ALFWorld, verl-agent limits): prompt up to 2048 tokens,
# a rubric of 5-8 criteria (~256 tokens), assistant header 8, response up to 512.
PAPER_SHAPE = dict(seq_len=2048 + 256 + 2 * (8 + 512), response_len=512)


def _report() -> None:
    print("GB per device on 4 x A100 80GB: float32 parameters, gradients and AdamW moments, bfloat16 compute,")
    print(f"64 packed rows of {PAPER_SHAPE['seq_len']} tokens per update in 16 micro-batches (one row per device each)")
    print(
        f"{'model':<11} {'layout':<11} {'remat':<5} {'params':>6} {'grads':>6} {'adam':>6} {'accum':>6} "
        f"{'acts':>6} {'total':>6}  fits"
    )
    for name, config in [("Qwen3-1.7B", QWEN3_1_7B), ("Qwen3-4B", QWEN3_4B)]:
        for fsdp in (False, True):
            for remat in (False, True):
                c = dataclasses.replace(config, compute_dtype="bfloat16", remat=remat)
                e = estimate(
                    c,
                    rows=64,
                    seq_len=PAPER_SHAPE["seq_len"],
                    response_len=PAPER_SHAPE["response_len"],
                    devices=4,
                    micro_batches=16,
                    fsdp=fsdp,
                )
                parts = [e.param_bytes, e.grad_bytes, e.optimizer_bytes, e.accumulator_bytes, e.activation_bytes]
                print(
                    f"{name:<11} {'FSDP' if fsdp else 'replicated':<11} {str(remat):<5} "
                    + " ".join(f"{x / GB:6.1f}" for x in parts)
                    + f" {e.total_bytes / GB:6.1f}  {e.fits}"
                )


if __name__ == "__main__":
    _report()
