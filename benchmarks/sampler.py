"""Sampler throughput: output tokens/s of JaxSampler, VLLMSampler and transformers' generate.

Usage: python benchmarks/sampler.py [--model NAME] [--batches 1 8 32] [--repeats 3]
           [--prompt-tokens 500] [--new-tokens 64]
           [--samplers transformers jax vllm vllm-own-binding vllm-compiled] [--vllm-env KEY=VALUE ...]

Every sampler gets the same agent-like prompts (a household task, admissible actions and a
history of steps, about --prompt-tokens tokens in the chat format), greedy decoding and no
stop token, so every row emits exactly --new-tokens tokens. Prompts differ from run to run so
vLLM's prefix cache gives no free prefill. Per batch size: one untimed warm-up run (jit
compilation, the server's first requests), then the median of --repeats timed runs. The
samplers run one after the other, each with the machine to itself: transformers and JAX use
every core, and so does vLLM's CPU worker as this project starts it; ``vllm-own-binding`` is vLLM
with its own default, which keeps one core for its scheduler; ``vllm-compiled`` is vLLM in its
torch.compile mode rather than eager. Each vLLM server's start-up time is printed; with both
``vllm`` and ``vllm-compiled``, so is the break-even: how many generated tokens at each batch size
repay the compiled mode's longer start-up.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

from orsd_jax import chat
from orsd_jax.models import EMBEDDED, load_model, resolve
from orsd_jax.sampling import SamplingParams

ROOMS = ["kitchen", "bathroom", "bedroom", "living room", "office", "garage"]
OBJECTS = ["mug", "apple", "book", "pencil", "towel", "plate", "key", "laptop", "vase", "spoon"]
PLACES = ["countertop", "cabinet", "drawer", "shelf", "desk", "sinkbasin", "fridge", "sofa", "bed", "table"]


def agent_prompt(tokenizer, fmt: chat.ChatFormat, seed: int, target_tokens: int) -> list[int]:
    """An ALFWorld-like step prompt of at least ``target_tokens`` tokens, different per seed."""
    rng = random.Random(seed)
    places = [f"{rng.choice(PLACES)} {i}" for i in range(1, 13)]
    task = f"put a {rng.choice(OBJECTS)} in the {rng.choice(places)}"
    lines = [
        f"Episode {seed}. You are in the middle of a {rng.choice(ROOMS)}. Around you are "
        + ", ".join(places)
        + f". Your task is to: {task}.",
        "Prior to this step, you have taken the following actions:",
    ]
    actions = [f"go to {p}" for p in places] + [f"open {p}" for p in places[:4]] + ["look", "inventory"]
    step = 1
    while True:
        place = rng.choice(places)
        seen = ", ".join(f"a {rng.choice(OBJECTS)} {rng.randint(1, 3)}" for _ in range(rng.randint(1, 4)))
        lines.append(f"[Step {step}] Action: go to {place}. Observation: You arrive at {place}. On it, you see {seen}.")
        text = "\n".join(
            lines
            + [
                f"Your admissible actions of the current situation are: [{', '.join(actions)}].",
                "Think step by step, then give your action inside <action></action>.",
            ]
        )
        ids = chat.prompt_ids(fmt, tokenizer, text)
        if len(ids) >= target_tokens:
            return ids
        step += 1


def measure(
    run: Callable[[list[list[int]]], int], prompts_for: Callable[[int, int], list[list[int]]], batch: int, repeats: int
) -> float:
    """Median output tokens/s over ``repeats`` runs after one warm-up run."""
    run(prompts_for(batch, 0))
    rates = []
    for r in range(1, repeats + 1):
        prompts = prompts_for(batch, r)
        start = time.perf_counter()
        tokens = run(prompts)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def transformers_runner(model_name: str, new_tokens: int) -> Callable[[list[list[int]]], int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve(model_name), dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0

    def run(prompts: list[list[int]]) -> int:
        width = max(map(len, prompts))  # left-padded, as decoder-only generation needs
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return int(out[:, width:].numel())

    return run


def sampler_runner(sampler, new_tokens: int) -> Callable[[list[list[int]]], int]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

    def run(prompts: list[list[int]]) -> int:
        return sum(len(c.token_ids) for c in sampler.generate(prompts, params))

    return run


def print_table(rates: dict[str, dict[int, float]], batches: Sequence[int], baseline: str) -> None:
    print(f"\n{'sampler':<22}{'batch':>6}{'tokens/s':>11}{'vs ' + baseline:>20}")
    for batch in batches:
        for name, by_batch in rates.items():
            if batch in by_batch:
                base = rates.get(baseline, {}).get(batch)
                ratio = f"{by_batch[batch] / base:.2f}x" if base else "-"
                print(f"{name:<22}{batch:>6}{by_batch[batch]:>11.1f}{ratio:>20}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--samplers",
        nargs="+",
        default=["transformers", "jax", "vllm", "vllm-own-binding"],
        choices=["transformers", "jax", "vllm", "vllm-own-binding", "vllm-compiled"],
    )
    parser.add_argument(
        "--vllm-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the vLLM server, e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0",
    )
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    fmt = chat.chat_format(tokenizer)
    max_model_len = args.prompt_tokens + 256 + args.new_tokens  # room for the longest prompt

    def prompts_for(batch: int, run: int) -> list[list[int]]:
        return [agent_prompt(tokenizer, fmt, 1000 * run + i, args.prompt_tokens) for i in range(batch)]

    lengths = [len(p) for p in prompts_for(8, 0)]
    print(
        f"{args.model}: prompts of {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new tokens, "
        f"greedy, median of {args.repeats} runs"
    )
    rates: dict[str, dict[int, float]] = {}

    def bench(name: str, run: Callable[[list[list[int]]], int]) -> None:
        rates[name] = {}
        for batch in args.batches:
            rates[name][batch] = measure(run, prompts_for, batch, args.repeats)
            print(f"  {name:<20} batch {batch:>3}: {rates[name][batch]:8.1f} tokens/s", flush=True)

    if "transformers" in args.samplers:
        bench("transformers", transformers_runner(args.model, args.new_tokens))
    if "jax" in args.samplers:
        from orsd_jax.sampling.jax_sampler import JaxSampler

        sampler = JaxSampler(model, tokenizer, max_model_len=max_model_len, max_batch=max(args.batches))
        bench("JaxSampler", sampler_runner(sampler, args.new_tokens))
        sampler.close()
    # vLLM with this project's core binding (every core), with vLLM's own (one core kept for its
    # scheduler), and compiled: (extra environment, eager).
    variants = {
        "vllm": ({}, True),
        "vllm-own-binding": ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, True),
        "vllm-compiled": ({}, False),
    }
    from orsd_jax.sampling.vllm_sampler import VLLMSampler
    from orsd_jax.sampling.vllm_server import ServerOptions

    startup: dict[str, float] = {}
    for variant in (v for v in variants if v in args.samplers):
        extra, eager = variants[variant]
        env = extra | dict(item.split("=", 1) for item in args.vllm_env)
        options = ServerOptions(
            max_model_len=max_model_len, dtype=model.config.param_dtype, eager=eager, cpu_kv_cache_gib=2, env=env
        )
        start = time.perf_counter()
        with VLLMSampler(resolve(args.model), tokenizer, options=options) as sampler:
            name = f"VLLMSampler ({'eager' if eager else 'compiled'}{', own binding' if extra else ''})"
            startup[variant] = time.perf_counter() - start
            print(f"  {name} ready in {startup[variant]:.0f} s", flush=True)
            bench(name, sampler_runner(sampler, args.new_tokens))
    print_table(rates, args.batches, "transformers")
    if {"vllm", "vllm-compiled"} <= startup.keys():
        eager_rates, compiled_rates = rates["VLLMSampler (eager)"], rates["VLLMSampler (compiled)"]
        extra_s = startup["vllm-compiled"] - startup["vllm"]
        print(f"\nstart-up: eager {startup['vllm']:.0f} s, compiled {startup['vllm-compiled']:.0f} s")
        for batch in args.batches:
            saved = 1 / eager_rates[batch] - 1 / compiled_rates[batch]  # seconds a token
            tokens = f"{extra_s / saved:,.0f} generated tokens" if saved > 0 else "never (compiled is not faster)"
            print(f"break-even at batch {batch}: {tokens}")


if __name__ == "__main__":
    main()
