"""One chat completion with a model, in process: a smoke test of the model stack.

python -m experiments.chat --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import time

from orsd_jax import chat
from orsd_jax.models import EMBEDDED, load_model
from orsd_jax.sampling import SamplingParams
from orsd_jax.sampling.jax_sampler import JaxSampler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED, help="registry name or Hugging Face directory")
    parser.add_argument("--prompt", default="Name three things you can find in a kitchen.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    model, tokenizer = load_model(args.model)
    fmt = chat.chat_format(tokenizer)
    sampler = JaxSampler(model, tokenizer, max_model_len=1024)
    params = SamplingParams(
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=fmt.stop_token_ids,
        seed=args.seed,
    )
    completion = sampler.generate([chat.prompt_ids(fmt, tokenizer, args.prompt)], params)[0]
    print(f"user: {args.prompt}\nassistant: {completion.text}")
    print(
        f"({len(completion.token_ids)} tokens, finish: {completion.finish_reason}, {time.perf_counter() - started:.1f} s)"
    )


if __name__ == "__main__":
    main()
