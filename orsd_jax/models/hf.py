"""Hugging Face safetensors directories in and out: the one interchange format.

The mapping between Hugging Face tensor names and ``CausalLM`` parameters is one table. Our
projections are stored input-first with heads split out (``q: [D, N, H]``), and every layer
parameter is stacked on a leading ``[L]`` axis; Hugging Face stores ``nn.Linear`` weights as
``[out, in]``, one tensor per layer.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import PathParts
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from orsd_jax.models.decoder import CausalLM, ModelConfig

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


class CheckpointError(ValueError):
    """A model directory or checkpoint file that cannot be used as it is."""


# (hf name with {i} for the layer, our parameter path, hf -> ours, ours -> hf)
def _mapping(c: ModelConfig) -> list[tuple[str, tuple[str, ...], Callable, Callable]]:
    d, n, kv, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

    def proj_in(heads):  # [heads*H, D] <-> [D, heads, H]
        return (lambda w: w.T.reshape(d, heads, h), lambda p: p.reshape(d, heads * h).T)

    same = (lambda w: w, lambda p: p)
    transposed = (lambda w: w.T, lambda p: p.T)
    table = [
        ("model.embed_tokens.weight", ("embed",), *same),
        ("model.norm.weight", ("final_norm", "scale"), *same),
        ("model.layers.{i}.input_layernorm.weight", ("layers", "attn_norm", "scale"), *same),
        ("model.layers.{i}.post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), *same),
        ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "attn", "q"), *proj_in(n)),
        ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "attn", "k"), *proj_in(kv)),
        ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "attn", "v"), *proj_in(kv)),
        (
            "model.layers.{i}.self_attn.o_proj.weight",
            ("layers", "attn", "o"),
            lambda w: w.T.reshape(n, h, d),
            lambda p: p.reshape(n * h, d).T,
        ),
        ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "mlp", "gate"), *transposed),
        ("model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "up"), *transposed),
        ("model.layers.{i}.mlp.down_proj.weight", ("layers", "mlp", "down"), *transposed),
    ]
    if c.qk_norm:
        table += [
            ("model.layers.{i}.self_attn.q_norm.weight", ("layers", "attn", "q_norm", "scale"), *same),
            ("model.layers.{i}.self_attn.k_norm.weight", ("layers", "attn", "k_norm", "scale"), *same),
        ]
    if not c.tie_word_embeddings:
        table.append(("lm_head.weight", ("lm_head",), *same))
    return table


def _read_config(directory: pathlib.Path) -> dict:
    if not directory.is_dir():
        raise CheckpointError(f"model directory {directory} does not exist")
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err


def _weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index} is malformed: {err}") from err
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = [directory / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{directory} lacks weight files: {', '.join(missing)}")
    return files


def _tensors(files: list[pathlib.Path]) -> Iterator[tuple[str, np.ndarray]]:
    for path in files:
        try:
            with safe_open(path, framework="np") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"corrupt safetensors file {path}: {err}") from err


def abstract_model(config: ModelConfig) -> CausalLM:
    """The model's structure with shapes and dtypes but no values (nothing is computed)."""
    return nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0)))


def load_hf_params(directory: str | os.PathLike, **config_overrides) -> CausalLM:
    """Builds a ``CausalLM`` from a Hugging Face directory (single file or sharded index)."""
    directory = pathlib.Path(directory)
    config = ModelConfig.from_hf_config(_read_config(directory), **config_overrides)
    dtype = np.dtype(jnp.dtype(config.param_dtype))
    by_name: dict[str, tuple[tuple[str, ...], Callable, int | None]] = {}
    for hf_name, path, to_ours, _ in _mapping(config):
        if "{i}" in hf_name:
            for i in range(config.num_layers):
                by_name[hf_name.format(i=i)] = (path, to_ours, i)
        else:
            by_name[hf_name] = (path, to_ours, None)
    graphdef, abstract_state = nnx.split(abstract_model(config))
    expected = {path: v.get_value() for path, v in nnx.to_flat_state(abstract_state)}
    layers: dict[tuple[str, ...], list] = {}
    values: dict[PathParts, np.ndarray] = {}
    for name, tensor in _tensors(_weight_files(directory)):
        if name not in by_name:
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue  # some exporters write the tied head anyway
            raise CheckpointError(f"unexpected tensor {name!r} in {directory} for {config.architecture}")
        path, to_ours, layer = by_name.pop(name)
        value = to_ours(tensor).astype(dtype)
        want = expected[path].shape[1:] if layer is not None else expected[path].shape
        if value.shape != tuple(want):
            raise CheckpointError(
                f"tensor {name!r} has shape {tensor.shape}, which does not fit {config.architecture} "
                f"(expected {tuple(want)} after conversion)"
            )
        if layer is None:
            values[path] = value
        else:
            layers.setdefault(path, [None] * config.num_layers)[layer] = value
    if by_name:
        raise CheckpointError(f"{directory} lacks tensors: {', '.join(sorted(by_name)[:5])}")
    values.update({path: np.stack(parts) for path, parts in layers.items()})
    state = nnx.from_flat_state(
        [(path, v.replace(jnp.asarray(values[path]))) for path, v in nnx.to_flat_state(abstract_state)]
    )
    return nnx.merge(graphdef, state)


def hf_tensors(model: CausalLM) -> dict[str, np.ndarray]:
    """Hugging Face tensor names to host arrays, in the model's parameter dtype."""
    config = model.config
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out = {}
    for hf_name, path, _, to_hf in _mapping(config):
        value = np.asarray(jax.device_get(flat[path]))
        if "{i}" in hf_name:
            for i in range(config.num_layers):
                out[hf_name.format(i=i)] = np.ascontiguousarray(to_hf(value[i]))
        else:
            out[hf_name] = np.ascontiguousarray(to_hf(value))
    return out


def save_hf(
    model: CausalLM, tokenizer, out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> pathlib.Path:
    """Writes a directory that transformers' ``AutoModelForCausalLM`` and vLLM load as they are.

    Weights above ``max_shard_bytes`` are split into ``model-0000k-of-0000n.safetensors`` files
    with a ``model.safetensors.index.json``. ``tokenizer`` may be None (weights and config only).
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata=metadata)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, start=1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / name, metadata=metadata)
            weight_map.update({tensor: name for tensor in shard})
        total = sum(v.nbytes for v in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config = model.config.to_hf_config()
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
