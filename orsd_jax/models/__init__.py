"""Models: the NNX decoder, checkpoints in and out, and the registry of names.

``load_model(path_or_name, dtype=...) -> (model, tokenizer)`` and
``save_hf(model, tokenizer, out_dir)`` are the public entry points.
"""

from __future__ import annotations

import os

from orsd_jax.models.decoder import CausalLM, KVCache, ModelConfig, UnsupportedModelError, segment_mask
from orsd_jax.models.hf import CheckpointError, abstract_model, hf_tensors, load_hf_params, save_hf
from orsd_jax.models.registry import EMBEDDED, cache_dir, resolve


def load_model(
    path_or_name: str | os.PathLike,
    dtype: str = "float32",
    compute_dtype: str | None = None,
    remat: bool = False,
    frozen_layers: int = 0,
):
    """``(CausalLM, tokenizer)`` from a Hugging Face directory or a registry name.

    ``dtype`` is the parameter dtype (``float32`` or ``bfloat16``); ``compute_dtype`` defaults
    to it; ``remat`` and ``frozen_layers`` are training options (see ``ModelConfig``). Nothing is
    downloaded: see ``orsd_jax.models.registry``.
    """
    from transformers import AutoTokenizer

    directory = resolve(path_or_name)
    model = load_hf_params(
        directory, param_dtype=dtype, compute_dtype=compute_dtype or dtype, remat=remat, frozen_layers=frozen_layers
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


__all__ = [
    "EMBEDDED",
    "CausalLM",
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "UnsupportedModelError",
    "abstract_model",
    "cache_dir",
    "hf_tensors",
    "load_hf_params",
    "load_model",
    "resolve",
    "save_hf",
    "segment_mask",
]
