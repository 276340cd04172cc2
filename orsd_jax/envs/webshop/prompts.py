"""The user message for one WebShop step, structured as verl-agent's WebShop prompt.

Structure carried over (the wording is ours): the task; then, from the second step on, how many
steps were taken and the last ``history_length`` (observation, action) pairs as
``[Observation k: '...', Action k: '...']``; the current step number and observation; the
available actions one per line as ``'action',`` inside ``[`` ``]``; the answer format
(reasoning in ``<think> </think>``, one action in ``<action> </action>``). Observations are cut
after the instruction segment and every remaining segment is single-quoted and re-joined with
" [SEP] " (the page unchanged when the instruction is not on it, as on the done page). A prompt
with history longer than 13,000 characters falls back to the one without history.
"""

from __future__ import annotations

from collections.abc import Sequence

from orsd_jax.envs.webshop.pages import SEP

MAX_PROMPT_CHARS = 13_000

_ANSWER_FORMAT = (
    "Choose your next move. First reason step by step about what this page shows and which of the "
    "available actions brings you closest to buying what the task asks for, and write that reasoning "
    "inside <think> </think> tags. Then write exactly one of the available actions inside "
    "<action> </action> tags."
)

_NO_HISTORY = """You are a skilled shopping assistant browsing the WebShop online store.
Your task: {task}.
The page you are looking at: {observation}.
The actions available on this page:
[
{actions}
].

{answer_format}
"""

_WITH_HISTORY = """You are a skilled shopping assistant browsing the WebShop online store.
Your task: {task}.
You have taken {step_count} step(s) so far. \
Here are the last {history_length} pages you saw, each with the action you took on it: {history}
This is step {current_step}. The page you are looking at: {observation}.
The actions available on this page:
[
{actions}
].

{answer_format}
"""


def format_observation(observation: str, task_description: str) -> str:
    """The segments after the instruction, each single-quoted; the page itself if it has none."""
    parts = observation.split(SEP)
    if task_description not in parts:
        return observation
    rest = parts[parts.index(task_description) + 1 :]
    return SEP.join(f"'{p}'" for p in rest)


def build_prompt(
    task_description: str,
    observation: str,
    available_actions: Sequence[str],
    history: Sequence[tuple[str, str]],
    step_count: int,
    history_length: int = 2,
) -> str:
    """The user message for the current step.

    ``history`` holds the (raw observation, action) pairs of earlier steps, oldest first (at least
    the last ``history_length``); ``step_count`` is how many steps were taken before this one.
    """
    if step_count < 0 or step_count < min(len(history), max(history_length, 0)):
        raise ValueError(f"step_count {step_count} is below the {len(history)} history entries given")
    actions = "\n".join(f"'{a}'," for a in available_actions)
    current = format_observation(observation, task_description)
    no_history = _NO_HISTORY.format(
        task=task_description, observation=current, actions=actions, answer_format=_ANSWER_FORMAT
    )
    recent = list(history[-history_length:]) if history_length > 0 else []
    if step_count == 0 or not recent:
        return no_history
    first = step_count - len(recent) + 1
    lines = "\n".join(
        f"[Observation {first + i}: '{format_observation(obs, task_description)}', Action {first + i}: '{act}']"
        for i, (obs, act) in enumerate(recent)
    )
    prompt = _WITH_HISTORY.format(
        task=task_description,
        step_count=step_count,
        history_length=len(recent),
        history=lines,
        current_step=step_count + 1,
        observation=current,
        actions=actions,
        answer_format=_ANSWER_FORMAT,
    )
    return no_history if len(prompt) > MAX_PROMPT_CHARS else prompt
