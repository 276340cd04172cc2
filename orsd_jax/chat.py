"""Chat formatting shared by every prompt builder.

A prompt is one user turn rendered with the tokenizer's chat template and ending in the
assistant header. We render the template once around a sentinel and keep the token ids before
and after the user text (``ChatFormat.head`` / ``tail``); a prompt is then
``head + encode(user_text) + encode(insert) + tail``. The ids without an insert are therefore a
prefix-compatible sibling of the ids with one (the rubric of ORSD is such an insert, placed at
the end of the user turn), and the same user text always gives the same ids.

Qwen3's template takes ``enable_thinking``; with thinking off it pre-fills an empty
``<think></think>`` block after the assistant header. That block is the start of the assistant's
answer (``ChatFormat.prefill``): the answer parser reads it before the sampled text, so a Qwen3
answer of ``<action>...</action>`` alone has both tag pairs. SmolLM2's template inserts its
default system prompt when none is given, and pre-fills nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

_SENTINEL = "\u2063ORSD_USER_TEXT\u2063"


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    head: tuple[int, ...]  # template tokens before the user text
    tail: tuple[int, ...]  # end of the user turn up to where the assistant's answer starts
    stop_token_ids: tuple[int, ...]  # tokens that end an assistant turn
    prefill: str = ""  # the answer's start that the template writes after the assistant header


def chat_format(tokenizer, *, system: str | None = None, thinking: bool = False) -> ChatFormat:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _SENTINEL}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the tokenizer's chat template does not place the user text exactly once")
    head, tail = text.split(_SENTINEL)
    think = tail.find("<think>")
    template = lambda t: list(tokenizer.encode(t, add_special_tokens=False)) if t else []  # noqa: E731
    return ChatFormat(
        head=tuple(template(head)),
        tail=tuple(template(tail)),
        stop_token_ids=stop_token_ids(tokenizer),
        prefill=tail[think:] if think >= 0 else "",
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as text: none added, and a special token's string written in it (an
    environment's or the model's ``<|im_end|>``) is split into ordinary tokens, so no text can
    end a turn or open another one (``tests/faults/test_model_output.py``)."""
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)) if text else []


def prompt_ids(fmt: ChatFormat, tokenizer, user_text: str, insert: str = "") -> list[int]:
    """``head + user_text + insert + tail`` as token ids."""
    return [*fmt.head, *encode(tokenizer, user_text), *encode(tokenizer, insert), *fmt.tail]


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The end-of-turn tokens: the tokenizer's EOS plus ``<|im_end|>``/``<|endoftext|>`` if present."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if token in vocab and vocab[token] not in ids:
            ids.append(int(vocab[token]))
    return tuple(ids)


def decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)
