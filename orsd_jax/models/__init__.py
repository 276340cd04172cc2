"""Models: the NNX decoder, checkpoints in and out, and the registry of names.

``load_model(path_or_name, dtype=...) -> (model, tokenizer)`` and
``save_hf(model, tokenizer, out_dir)`` are the public entry points.
"""

from __future__ import annotations

import json
import os
import pathlib

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
    directory = resolve(path_or_name)
    model = load_hf_params(
        directory, param_dtype=dtype, compute_dtype=compute_dtype or dtype, remat=remat, frozen_layers=frozen_layers
    )
    return model, load_tokenizer(directory)


def load_tokenizer(directory: str | os.PathLike):
    """The tokenizer of a Hugging Face directory: the class its ``tokenizer_config.json`` names, as
    ``AutoTokenizer`` picks it, without importing ``AutoTokenizer``, whose module pulls in torch
    (5.7 s against 1.3 s to import on a 2-core machine; every run, evaluation and report pays it
    at start). A directory naming no class ``transformers`` exports goes through ``AutoTokenizer``.
    """
    import transformers

    config = pathlib.Path(directory) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(directory)


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
    "load_tokenizer",
    "resolve",
    "save_hf",
    "segment_mask",
]
