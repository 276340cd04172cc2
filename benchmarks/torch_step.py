"""The ORSD train step in PyTorch and Hugging Face transformers, on the weights of a ``CausalLM``.

The baseline a verl-agent user runs: a transformers model (``sdpa`` attention, f32), one
with-rubric forward under ``torch.no_grad()`` and one without-rubric forward with gradients over
right-padded rows, the loss, ``backward``, ``clip_grad_norm_`` and ``torch.optim.AdamW``. The loss
(``policy_loss``) mirrors ``orsd_jax.loss.policy_loss`` line by line, so a benchmark can time the
JAX step against it in one process and ``tests/test_torch_step.py`` can check that both compute
the same loss, gradients and update.

``make_torch_step(model, samples, loss, optimizer) -> TorchStep``; ``step()`` runs one update on
the samples and returns ``{"loss", "grad_norm", ...}``; ``step.trained_tokens`` are the tokens of
the without-rubric sequences (what ``benchmarks/loss.py`` counts).

Shapes: B samples, R samples with a rubric, T padded sequence length, Y padded response length,
D hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from orsd_jax.batch import StepSample
from orsd_jax.loss import LossConfig
from orsd_jax.models import CausalLM, hf_tensors
from orsd_jax.train_step import OptimizerConfig


def to_torch(model: CausalLM) -> PreTrainedModel:
    """The transformers model (``LlamaForCausalLM`` or ``Qwen3ForCausalLM``) of ``model``'s weights:
    f32, ``sdpa`` attention, in train mode. Built from the config, so nothing is fetched."""
    config = model.config.to_hf_config()
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch_model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    tensors = {name: torch.tensor(v, dtype=torch.float32) for name, v in hf_tensors(model).items()}
    missing, unexpected = torch_model.load_state_dict(tensors, strict=False)
    # Tied embeddings: there is no lm_head tensor, the head is the embedding's parameter (loaded through it).
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"weights do not fit the transformers model: missing {missing}, unexpected {unexpected}")
    return torch_model.train()  # gradient checkpointing only runs in train mode; dropout is 0


@dataclasses.dataclass(frozen=True)
class Rows:
    """Right-padded sequences and, per response token, the position whose output predicts it."""

    input_ids: torch.Tensor  # int64[B, T]
    attention_mask: torch.Tensor  # int64[B, T]: 1 on real tokens
    index: torch.Tensor  # int64[B, Y]: 0 on padding response slots (masked in the loss)

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], y: int) -> Rows:
        ids = np.zeros((len(sequences), max(map(len, sequences))), np.int64)
        mask, index = np.zeros_like(ids), np.zeros((len(sequences), y), np.int64)
        for i, (s, p) in enumerate(zip(sequences, prompt_lengths)):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
            n = len(s) - p
            index[i, :n] = np.arange(p - 1, p - 1 + n)  # response token j sits at p + j
        return cls(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(index))


def response_logprobs(
    model: PreTrainedModel, rows: Rows, response: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[B, Y]`` of ``response [B, Y]``: the LM head runs at the response
    positions only (``[B, Y, V]`` logits, never ``[B, T, V]``), as ``orsd_jax.loss.logprobs_at``."""
    hidden = model.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, use_cache=False)
    h = hidden.last_hidden_state[torch.arange(len(rows.index))[:, None], rows.index]  # [B, Y, D], final-normed
    logp_all = torch.log_softmax(model.lm_head(h) / temperature, dim=-1)  # [B, Y, V]
    logp = torch.gather(logp_all, -1, response[..., None])[..., 0]
    entropy = -torch.sum(logp_all.exp() * logp_all, dim=-1)
    return logp, entropy


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio) - log_ratio - 1


def policy_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    logp_with: torch.Tensor | None,
    has_rubric: torch.Tensor,
    advantage: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    config: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, token_count, metric_sums)`` as ``orsd_jax.loss.policy_loss``: ``logp``/``entropy
    [B, Y]`` without the rubric (with gradients), ``logp_with [B, Y]`` with it (no gradient; ``None``:
    no correction), ``has_rubric bool[B]``, ``advantage [B]``, ``old_logp``/``ref_logp``/``mask [B, Y]``."""
    rubric = mask * has_rubric[:, None] * (logp_with is not None)
    logp_with = logp.detach() if logp_with is None else torch.where(rubric > 0, logp_with, logp.detach())
    gap = logp_with - logp.detach()
    adv = advantage[:, None] + config.coef * torch.clamp(gap, -config.clip, config.clip)
    adv = torch.where(mask > 0, adv, 0.0)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if config.dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * config.dual_clip), per_token)
    sums = {
        "clipped": torch.sum((clipped > unclipped) * mask),
        "approx_kl": torch.sum(_k3(log_ratio.detach()) * mask),
        "entropy": torch.sum(entropy.detach() * mask),
    }
    if config.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs: StepSample.ref_logprobs")
        ref_kl = torch.clamp(_k3(torch.clamp(ref_logp - logp, -20.0, 20.0)), -10.0, 10.0)
        per_token = per_token + config.kl_coef * ref_kl
        sums["ref_kl"] = torch.sum(ref_kl.detach() * mask)
    if config.entropy_coef:
        per_token = per_token - config.entropy_coef * entropy
    return torch.sum(per_token * mask), torch.sum(mask), sums


@dataclasses.dataclass(frozen=True)
class TorchStep:
    """One ORSD update on fixed samples, built by ``make_torch_step``."""

    model: PreTrainedModel
    optimizer: torch.optim.AdamW
    loss_config: LossConfig
    grad_clip: float
    without: Rows  # every sample's prefix + tail + response
    with_rubric: Rows | None  # the rubric samples' prefix + insert + tail + response (None: no correction)
    rubric_rows: torch.Tensor  # int64[R]: their rows in the batch
    response: torch.Tensor  # int64[B, Y]
    mask: torch.Tensor  # float32[B, Y]
    old_logp: torch.Tensor  # float32[B, Y]
    ref_logp: torch.Tensor | None  # float32[B, Y]
    advantage: torch.Tensor  # float32[B]
    has_rubric: torch.Tensor  # bool[B]

    @property
    def trained_tokens(self) -> int:
        """Tokens of the without-rubric sequences, the ones the backward pass runs over."""
        return int(self.without.attention_mask.sum())

    def backward(self) -> dict[str, float]:
        """Forwards, the token-mean loss and its gradients into ``.grad`` (no clipping, no update)."""
        c = self.loss_config
        logp_with = None
        if self.with_rubric is not None:
            with torch.no_grad():  # l+ is a fixed per-token reward: no graph for the with-rubric forward
                logp_r, _ = response_logprobs(
                    self.model, self.with_rubric, self.response[self.rubric_rows], c.temperature
                )
            logp_with = torch.zeros_like(self.old_logp).index_copy(0, self.rubric_rows, logp_r)
        logp, entropy = response_logprobs(self.model, self.without, self.response, c.temperature)
        loss_sum, count, sums = policy_loss(
            logp, entropy, logp_with, self.has_rubric, self.advantage, self.old_logp, self.ref_logp, self.mask, c
        )
        loss = loss_sum / count  # the token mean over the whole batch, as the JAX step
        loss.backward()
        n = float(count)
        return {
            "loss": loss.item(),
            "tokens": n,
            "clip_frac": float(sums["clipped"]) / n,
            "approx_kl": float(sums["approx_kl"]) / n,
            "entropy": float(sums["entropy"]) / n,
        }

    def __call__(self) -> dict[str, float]:
        """One whole train step: forwards, loss, backward, clipping, AdamW; metrics at the parameters it started from."""
        metrics = self.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)  # the norm before clipping
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics | {"grad_norm": float(grad_norm)}


def make_torch_step(
    model: CausalLM,
    samples: Sequence[StepSample],
    loss: LossConfig,
    optimizer: OptimizerConfig,
    *,
    frozen_layers: int = 0,
    remat: bool = False,
    threads: int | None = None,
) -> TorchStep:
    """A ``TorchStep`` on a transformers copy of ``model``'s weights (``model`` is not changed).

    ``frozen_layers``: the embedding and the first n layers get no gradient and no update (like
    ``orsd_jax.train_step.make_optimizer(frozen_layers=n)`` with ``ModelConfig.frozen_layers``);
    ``remat``: gradient checkpointing of every layer; ``threads``: ``torch.set_num_threads`` (a
    process-wide setting; None leaves torch's default).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    torch_model = to_torch(model)
    if frozen_layers:
        # With tied embeddings the LM head *is* the embedding's parameter, so it is frozen too. The
        # JAX step differs in one way there: the head's gradient still reaches the embedding and
        # counts in the global norm it clips by (freeze_first_layers only zeroes the update), so
        # grad_norm, and the update once clipping is active, differ between the two.
        torch_model.model.embed_tokens.requires_grad_(False)
        for layer in torch_model.model.layers[:frozen_layers]:
            layer.requires_grad_(False)
    if remat:
        # Non-reentrant, as verl: the reentrant variant loses gradients when a checkpointed
        # layer's input does not require grad (frozen layers below it).
        torch_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    adamw = torch.optim.AdamW(
        [p for p in torch_model.parameters() if p.requires_grad],
        lr=optimizer.learning_rate,
        betas=(optimizer.b1, optimizer.b2),
        eps=optimizer.eps,
        weight_decay=optimizer.weight_decay,  # decoupled, as optax.adamw's
    )

    y = max(len(s.response) for s in samples)

    def pad(rows: Sequence[Sequence[float]], dtype=np.float32) -> torch.Tensor:  # [B, Y]
        out = np.zeros((len(rows), y), dtype)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return torch.from_numpy(out)

    rubric = [i for i, s in enumerate(samples) if s.insert]
    with_rubric = None
    if rubric and loss.coef:  # as OrsdLoss: coef 0 skips the with-rubric forward
        seqs = [[*samples[i].prefix, *samples[i].insert, *samples[i].tail, *samples[i].response] for i in rubric]
        with_rubric = Rows.build(seqs, [len(q) - len(samples[i].response) for q, i in zip(seqs, rubric)], y)
    with_ref = [s.ref_logprobs is not None for s in samples]
    if any(with_ref) and not all(with_ref):
        raise ValueError("reference log-probs must be given for every sample or for none")
    return TorchStep(
        model=torch_model,
        optimizer=adamw,
        loss_config=loss,
        grad_clip=optimizer.grad_clip,
        without=Rows.build(
            [[*s.prefix, *s.tail, *s.response] for s in samples], [len(s.prefix) + len(s.tail) for s in samples], y
        ),
        with_rubric=with_rubric,
        rubric_rows=torch.tensor(rubric, dtype=torch.int64),
        response=pad([s.response for s in samples], np.int64),
        mask=pad([[1.0] * len(s.response) for s in samples]),
        old_logp=pad([s.old_logprobs for s in samples]),
        ref_logp=pad([s.ref_logprobs for s in samples]) if all(with_ref) else None,
        advantage=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        has_rubric=torch.tensor([bool(s.insert) for s in samples]),
    )
