"""The ALFWorld user message: the fields and order of verl-agent's prompts, in our own words.

Step 0 shows the role, the whole intro (which contains the task), the admissible actions and
the answer format. Later steps show the task, how many steps were taken, the last
``history_length`` (observation, action) pairs numbered by step, the current step number and
observation, the admissible actions and the answer format. Each history observation is the raw
feedback the action was chosen on. Actions are listed quoted, one per line. The text is a pure
function of its arguments, so the same state always gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

HISTORY_LENGTH = 2

_ROLE = (
    "You are an expert agent acting in the ALFRED embodied environment, "
    "a household you explore and change through text commands."
)
_ANSWER_FORMAT = (
    "First reason step by step about the current situation and write that reasoning between <think> and </think>. "
    "Then write exactly one of the admissible actions between <action> and </action>."
)


def _action_list(admissible_actions: Sequence[str]) -> str:
    return "\n ".join(f"'{action}'" for action in admissible_actions)


def build_prompt(
    task_description: str,
    observation: str,
    admissible_actions: Sequence[str],
    history: Sequence[tuple[str, str]],
    step_count: int,
    history_length: int = HISTORY_LENGTH,
) -> str:
    """The user message for one step.

    ``history`` holds ``(observation before action k, action k)`` for the steps taken so far
    (``step_count`` of them; older ones may be left out), ``observation`` is the latest feedback.
    """
    if step_count < 0 or history_length < 0:
        raise ValueError(f"step_count and history_length must be >= 0, got {step_count}, {history_length}")
    if len(history) > step_count:
        raise ValueError(f"history has {len(history)} entries but only {step_count} steps were taken")
    if step_count == 0:
        return (
            f"{_ROLE}\n"
            f"This is what you see now: {observation}\n"
            f"The admissible actions are:\n [{_action_list(admissible_actions)}].\n"
            f"{_ANSWER_FORMAT}"
        )
    shown = list(history)[max(0, len(history) - history_length) :] if history_length else []
    first = step_count - len(shown) + 1
    past = "".join(
        f"\n[Observation {first + k}: '{seen}', Action {first + k}: '{action}']"
        for k, (seen, action) in enumerate(shown)
    )
    if shown:
        past = f" Your last {len(shown)} observation(s) and the action taken after each:{past}"
    return (
        f"{_ROLE}\n"
        f"Your task is to: {task_description}\n"
        f"You have taken {step_count} step(s) so far.{past}\n"
        f"Now, at step {step_count + 1}, this is what you see: {observation}\n"
        f"The admissible actions are:\n [{_action_list(admissible_actions)}].\n"
        f"{_ANSWER_FORMAT}"
    )
