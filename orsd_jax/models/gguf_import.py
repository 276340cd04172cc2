"""GGUF files (llama.cpp) to Hugging Face directories.

Weights are dequantized with the ``gguf`` package. llama.cpp's converter permutes the rows of
Llama's q/k projections (it pairs rotary dimensions by interleaving; Hugging Face splits them in
halves), so we apply the inverse permutation. The tokenizer and chat template come from the GGUF
metadata through transformers' GGUF tokenizer conversion.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's rotary row permutation of a ``[heads * H, D]`` projection."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Writes ``out_dir`` (config, f32 safetensors, tokenizer) from a Llama or Qwen3 GGUF file.

    Written to a temporary sibling and renamed into place, so a crash leaves no half directory; when
    another process renamed its copy first, that one is kept.
    """
    import gguf
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (llama, qwen3)")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    hidden = _field(reader, f"{arch}.embedding_length")
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        name = _hf_name(t.name)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, heads if "attn_q" in t.name else kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    tied = "lm_head.weight" not in tensors
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
        },
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:  # another process (a test worker) imported it first: keep its directory
            if not (out_dir / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir
