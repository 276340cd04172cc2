"""Sampler/trainer log-prob mismatch: how far the log-probs the rollout records are from the ones the
train step computes for the same tokens at the same parameters.

Usage: python -m benchmarks.logprob_mismatch [--temperatures 0.4 0.7 1.0] [--dtypes float32 bfloat16]
                                             [--samplers jax vllm] [--prompts 8] [--new-tokens 64]

The PPO ratio's old log-probs come from the sampler and the new ones from the JAX model: any
systematic difference between the two (kernels, dtype, temperature handling, tokenisation)
biases every update (``loss/logprob_mismatch_*`` logs it per update; ``LossConfig.tis_cap``
corrects for it). Here: the embedded model, agent-like prompts (``benchmarks.sampler``), each
sampler at each temperature and dtype; the trainer's log-probs from ``orsd_jax.loss``'s forward
on the same prompt and response tokens, in the same dtype. Printed per row: the mean and max
absolute difference over the response tokens, and the mean ratio p_trainer / p_sampler.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.sampler import agent_prompt
from orsd_jax import chat
from orsd_jax.batch import StepSample, build_batch
from orsd_jax.loss import response_logprobs
from orsd_jax.minibatches import logprob_mismatch
from orsd_jax.models import EMBEDDED, load_model, resolve
from orsd_jax.sampling import SamplingParams


def trainer_logprobs(model, prompts, completions, temperature: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(trainer, sampler, mask)``, each ``[N, Y]``: the train step's forward over prompt + response."""
    samples = [
        StepSample(prefix=p, tail=(), response=c.token_ids, old_logprobs=c.logprobs, advantage=0.0)
        for p, c in zip(prompts, completions)
    ]
    batch = build_batch(samples, layout="two-stream")
    graphdef, params = nnx.split(model)
    forward = jax.jit(
        lambda p, b: response_logprobs(nnx.merge(graphdef, p), b, temperature=temperature, with_rubric=False)[1]
    )
    return (
        np.asarray(forward(params, batch), np.float64),
        np.asarray(batch.old_logp, np.float64),
        np.asarray(batch.response_mask),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.4, 0.7, 1.0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--samplers", nargs="+", default=["jax", "vllm"], choices=["jax", "vllm"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    rows = []
    for dtype in args.dtypes:
        model, tokenizer = load_model(EMBEDDED, dtype=dtype)
        fmt = chat.chat_format(tokenizer)
        prompts = [agent_prompt(tokenizer, fmt, i, args.prompt_tokens) for i in range(args.prompts)]
        max_model_len = max(map(len, prompts)) + args.new_tokens + 64
        for name in args.samplers:
            start = time.perf_counter()
            if name == "jax":
                from orsd_jax.sampling.jax_sampler import JaxSampler

                sampler = JaxSampler(model, tokenizer, max_model_len=max_model_len, max_batch=args.prompts)
            else:
                from orsd_jax.sampling.vllm_sampler import VLLMSampler
                from orsd_jax.sampling.vllm_server import ServerOptions

                options = ServerOptions(max_model_len=max_model_len, dtype=dtype, cpu_kv_cache_gib=2)
                sampler = VLLMSampler(resolve(EMBEDDED), tokenizer, options=options)
            print(f"{name} sampler ({dtype}) ready in {time.perf_counter() - start:.0f} s", flush=True)
            try:
                for temperature in args.temperatures:
                    params = SamplingParams(temperature=temperature, max_new_tokens=args.new_tokens, seed=0)
                    completions = sampler.generate(prompts, params)
                    stats = logprob_mismatch(*trainer_logprobs(model, prompts, completions, temperature))
                    tokens = sum(len(c.token_ids) for c in completions)
                    rows.append((name, dtype, temperature, tokens, stats))
                    print(f"  T={temperature}: {stats}", flush=True)
            finally:
                sampler.close()
    print("\n| sampler | dtype | temperature | tokens | mean abs diff | max abs diff | mean p_trainer / p_sampler |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, dtype, temperature, tokens, s in rows:
        print(
            f"| {name} | {dtype} | {temperature} | {tokens} | {s['logprob_mismatch_mean']:.2e} | "
            f"{s['logprob_mismatch_max']:.2e} | {s['sampler_ratio_mean']:.4f} |"
        )


if __name__ == "__main__":
    main()
