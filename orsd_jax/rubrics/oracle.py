"""Oracle rubric bundles, written from privileged knowledge instead of by a model.

The credit probe compares the log-likelihood gap under a policy-written rubric with the gap under
a rubric that certainly points at the expert's actions. These bundles are the latter, phrased
like a policy's own process criteria so that only their content differs:

- ALFWorld: the planner's plan, one criterion per step in plan order ("Goes to the desk 1 before
  anything else", "Takes the statue 1 from the desk 1", ...); a plan of more than 8 steps is cut
  into 8 runs of consecutive steps joined by ", then "; one of fewer than 5 steps is padded with
  general criteria. Every step names its command's objects and receptacles in full (never "it"),
  so a verifier can check each one without the others.
- WebShop: the goal: search with its key words, open a product of its type with its attributes,
  choose each of its options, stay under its price bound, buy.

Every bundle is what ``parse_bundle`` reads back from its numbered list (the form
``rubric_insert`` shows), so it can stand in for a selected bundle anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from orsd_jax.demos import alfworld_walkthrough
from orsd_jax.envs.base import Task
from orsd_jax.envs.webshop.goals import NO_PRICE_BOUND, Goal
from orsd_jax.rubrics.parse import MAX_CRITERIA, MIN_CRITERIA, parse_bundle

# ALFWorld's commands (the PDDL grammar's templates) in the third person; the object held while
# going somewhere or using something is added by ``step_phrases``.
_STEP_PHRASES = (
    (re.compile(r"go to (.+)"), "goes to the {0}"),
    (re.compile(r"take (.+) from (.+)"), "takes the {0} from the {1}"),
    (re.compile(r"move (.+) to (.+)"), "moves the {0} to the {1}"),
    (re.compile(r"open (.+)"), "opens the {0}"),
    (re.compile(r"close (.+)"), "closes the {0}"),
    (re.compile(r"heat (.+) with (.+)"), "heats the {0} with the {1}"),
    (re.compile(r"cool (.+) with (.+)"), "cools the {0} with the {1}"),
    (re.compile(r"clean (.+) with (.+)"), "cleans the {0} with the {1}"),
    (re.compile(r"slice (.+) with (.+)"), "slices the {0} with the {1}"),
    (re.compile(r"use (.+)"), "uses the {0}"),
    (re.compile(r"examine (.+)"), "examines the {0}"),
    (re.compile(r"look"), "looks around"),
    (re.compile(r"inventory"), "checks what it carries"),
)
_HOLDING_MATTERS = ("go to ", "use ")  # where the held object says what the step is for
_ORDINALS = ("second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
ALFWORLD_PADDING = (
    "Finishes the task in at most {n} actions",
    "Does not repeat an action that had no effect",
    "Only chooses actions from the list of admissible actions",
    "Does not go to places the task does not need",
)
WEBSHOP_PADDING = (
    "Buys in at most {n} actions",
    "Does not search again after a matching product is found",
)
# What ``parse_bundle`` would strip or collapse (markdown emphasis, runs of whitespace).
_UNSAFE = re.compile(r"[*_`\s]+")


def _phrase(command: str) -> str:
    return next((t.format(*m.groups()) for p, t in _STEP_PHRASES if (m := p.fullmatch(command))), f"does {command}")


def step_phrases(plan: Sequence[str]) -> list[str]:
    """One lower-case phrase per plan step, all distinct: a going or using step says what is held
    ("goes to the fridge 1 while holding the apple 1"), and a phrase that occurred before says
    how often ("... for the second time": pick2 plans go to the same place twice)."""
    held: str | None = None
    phrases: list[str] = []
    seen: dict[str, int] = {}
    for command in plan:
        phrase = _phrase(command)
        if held and command.startswith(_HOLDING_MATTERS):
            phrase += f" while holding the {held}"
        seen[phrase] = seen.get(phrase, 0) + 1
        if seen[phrase] > 1:
            k = seen[phrase] - 2
            phrase += f" for the {_ORDINALS[k] if k < len(_ORDINALS) else f'{k + 2}th'} time"
        phrases.append(phrase)
        if m := re.fullmatch(r"take (.+) from .+", command):
            held = m.group(1)
        elif command.startswith("move "):
            held = None
    return phrases


def runs(n: int, k: int) -> list[range]:
    """``range(n)`` cut into ``k`` consecutive runs whose lengths differ by at most one (longer first)."""
    size, extra = divmod(n, k)
    starts = [i * size + min(i, extra) for i in range(k + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def _sentence(phrases: Sequence[str]) -> str:
    text = ", then ".join(phrases)
    return text[0].upper() + text[1:]


def oracle_bundle(criteria: Sequence[str]) -> tuple[str, ...]:
    """``criteria`` cleaned as the parser cleans them; a ValueError when they are not a valid
    bundle of exactly these criteria (too few or many, duplicates, too short or long)."""
    criteria = tuple(_UNSAFE.sub(" ", c).strip(" \"'") for c in criteria)
    parsed = parse_bundle("\n".join(f"{k}. {c}" for k, c in enumerate(criteria, start=1)))
    if not parsed.valid or parsed.criteria != criteria:
        raise ValueError(
            f"not a bundle of exactly these criteria ({parsed.reason or 'changed by parsing'}): {criteria}"
        )
    return criteria


def plan_criteria(plan: Sequence[str]) -> tuple[str, ...]:
    """5-8 criteria covering every step of ``plan`` (ALFWorld commands) in order."""
    if not plan:
        raise ValueError("an empty plan has no steps to write criteria about")
    phrases = step_phrases(plan)
    phrases[0] += " before anything else"
    criteria = [_sentence([phrases[i] for i in run]) for run in runs(len(plan), min(len(plan), MAX_CRITERIA))]
    padding = [p.format(n=len(plan)) for p in ALFWORLD_PADDING]
    return oracle_bundle(criteria + padding[: max(0, MIN_CRITERIA - len(criteria))])


def alfworld_oracle(task: Task) -> tuple[str, ...]:
    """The oracle bundle of a generated or official ALFWorld game: its stored planner walkthrough."""
    return plan_criteria(alfworld_walkthrough(task))


def _listing(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" and {items[-1]}"


def _option_phrase(option: tuple[str, str] | str) -> str:
    return f"chooses {option[1]} as the {option[0]}" if isinstance(option, tuple) else f"chooses the option {option}"


def webshop_oracle(goal: Goal) -> tuple[str, ...]:
    """5-8 criteria: search with the goal's words, open a product of its type with its
    attributes, choose each option (one criterion each while they fit, else all in one), stay
    under the price bound (when it has one), buy."""
    attributes = list(dict.fromkeys(goal.attributes))
    options = [_option_phrase(o) for o in dict.fromkeys(goal.goal_options)]
    shortest = len(options) + 3  # search, open the product, choose each option, buy
    words = _listing([goal.query, *attributes])
    having = f" with {_listing(attributes)}" if attributes else ""
    head = [f"Searches with the key words {words}", f"Opens a {goal.query} product{having}"]
    buy = (
        "Clicks buy now only after choosing every option the request names"
        if options
        else "Clicks buy now on that product"
    )
    tail = [buy]
    if goal.price_upper < NO_PRICE_BOUND:
        tail.insert(0, f"Buys a product that costs less than {goal.price_upper:.2f} dollars")
    if len(head) + len(options) + len(tail) > MAX_CRITERIA:
        options = [", ".join(options)]
    criteria = head + [_sentence([o]) for o in options] + tail
    padding = [p.format(n=shortest) for p in WEBSHOP_PADDING]
    return oracle_bundle(criteria + padding[: max(0, MIN_CRITERIA - len(criteria))])
