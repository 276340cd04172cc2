"""The answer format shared by every environment: ``<think>...</think><action>...</action>``.

The rule follows verl-agent's projection (facts, not code): the response is lower-cased, the
action is the text between the first ``<action>`` and the first ``</action>`` after it, and the
format is valid only if both action tags and both think tags are present and the text has no
CJK characters. We add what verl-agent leaves out: an action is *valid* only when it is also
admissible (an admissible entry like ``search[<your query>]`` admits any non-empty query). Without action tags, ``action`` is None and the rollout sends the environment an empty command,
a no-op that still counts toward the step limit. This function never raises.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

_CJK = re.compile(r"[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af]")
_SPACES = re.compile(r"\s+")
_PLACEHOLDER = re.compile(r"(\w+)\[<[^>]*>\]")


@dataclasses.dataclass(frozen=True)
class ParsedAction:
    action: str | None  # the command to send, normalised; None when the format is broken
    valid_format: bool  # both tag pairs present, non-empty action, no CJK
    admissible: bool  # the action is one of the admissible commands
    reason: str  # "" when valid, else a short description of what was wrong

    @property
    def valid(self) -> bool:
        return self.valid_format and self.admissible


def _normalise(text: str) -> str:
    return _SPACES.sub(" ", text).strip().strip("'\"`").strip()


def _matches(action: str, admissible: str) -> bool:
    """Equality, or a filled placeholder: ``search[red mug]`` matches ``search[<your query>]``."""
    placeholder = _PLACEHOLDER.fullmatch(admissible)
    if placeholder is None:
        return action == admissible
    prefix = placeholder.group(1)
    return action.startswith(prefix + "[") and action.endswith("]") and len(action) > len(prefix) + 2


def parse_action(response: str, admissible_actions: Sequence[str]) -> ParsedAction:
    """Extracts the action from a model response. ``admissible_actions`` is compared lower-cased."""
    if not isinstance(response, str):
        return ParsedAction(None, False, False, "response is not text")
    lowered = response.lower()
    start = lowered.find("<action>")
    end = lowered.find("</action>", start + 8) if start >= 0 else -1
    if start < 0 or end < 0:
        return ParsedAction(None, False, False, "missing <action>...</action>")
    action = _normalise(lowered[start + len("<action>") : end])
    if "<action>" in action or "</action>" in action:
        return ParsedAction(None, False, False, "nested action tags")
    if not action:
        return ParsedAction(None, False, False, "empty action")
    if "<think>" not in lowered or "</think>" not in lowered:
        format_error = "missing <think>...</think>"
    elif _CJK.search(response):
        format_error = "contains CJK characters"
    else:
        format_error = ""
    admissible = any(_matches(action, _normalise(a.lower())) for a in admissible_actions)
    reason = format_error or ("" if admissible else "action is not admissible")
    return ParsedAction(action, not format_error, admissible, reason)
