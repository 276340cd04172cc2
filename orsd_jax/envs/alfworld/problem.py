"""Writing a ``GameSpec`` as an ALFRED PDDL problem and a TextWorld ``game.tw-pddl`` file.

The problem has the shape of ALFWorld's ``initial_state.pddl``: THOR ids escaped for PDDL
(``|`` -> ``_bar_`` and so on, which ``AlfredDemangler`` turns back into "cabinet 3"), one location
per receptacle plus the agent's start, type facts, ``canContain`` for every receptacle/object type
pair present (from ``VAL_RECEPTACLE_OBJECTS``), the properties of ``VAL_ACTION_OBJECTS``, and the
goal from ``goal_library.gdict``. The game file bundles the package's ``alfred.pddl`` and
``alfred.twl2`` (with the task sentence in place of ``UNKNOWN GOAL``), as ``alfworld-generate``
lays it out.
"""

from __future__ import annotations

import functools
import importlib.resources

from alfworld.gen import constants, goal_library

from orsd_jax.envs.alfworld.sampling import TOOLS, GameSpec
from orsd_jax.envs.alfworld.scenes import LAMP_CLASSES, OPENABLE_CLASSES, can_contain, has_property

# Per-character escapes of ALFRED's planner ('#' stands for the PDDL type dash in goal_library).
_ESCAPES = str.maketrans({"-": "_minus_", "#": "-", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"})
# Types the domain's actions name as constants; the problem must declare them.
_DOMAIN_RTYPES = ("SinkBasin", "Microwave", "Fridge")
_DOMAIN_OTYPES = ("Knife", "ButterKnife")


def escape(text: str) -> str:
    return text.translate(_ESCAPES)


@functools.cache
def logic_files() -> tuple[str, str]:
    """The package's PDDL domain and TextWorld grammar."""
    data = importlib.resources.files("alfworld") / "data"
    return (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()


def _location(pose: tuple[int, int, int, int]) -> str:
    return escape("loc|" + "|".join(str(int(v)) for v in pose))


def _locations(spec: GameSpec) -> dict[str, str]:
    """Receptacle id -> location name (scenes give every receptacle a pose of its own)."""
    return {r.thor_id: _location(r.pose) for r in spec.receptacles}


def declarations(spec: GameSpec) -> list[tuple[str, str]]:
    """Every (name, PDDL type) the problem declares, in the order it declares them."""
    rtypes = sorted({r.cls for r in spec.receptacles} | set(_DOMAIN_RTYPES) | ({spec.parent_target} - {""}))
    otypes = sorted({o.cls for o in spec.objects + spec.lamps} | set(_DOMAIN_OTYPES))
    out = [("agent1", "agent")]
    out += [(f"{t}Type", "otype") for t in otypes]
    out += [(f"{t}Type", "rtype") for t in rtypes]
    out += [(escape(o.thor_id), "object") for o in spec.objects + spec.lamps]
    out += [(escape(r.thor_id), "receptacle") for r in spec.receptacles]
    locations = set(_locations(spec).values()) | {_location(spec.start_pose)}
    out += [(loc, "location") for loc in sorted(locations)]
    return out


def problem_pddl(spec: GameSpec) -> str:
    locations = _locations(spec)
    receptacles = {r.thor_id: r for r in spec.receptacles}
    declared = declarations(spec)
    rtypes = [name[: -len("Type")] for name, kind in declared if kind == "rtype"]
    otypes = [name[: -len("Type")] for name, kind in declared if kind == "otype"]

    facts = [f"(atLocation agent1 {_location(spec.start_pose)})"]
    for r in spec.receptacles:
        name = escape(r.thor_id)
        facts += [f"(receptacleType {name} {r.cls}Type)", f"(receptacleAtLocation {name} {locations[r.thor_id]})"]
        if r.cls in OPENABLE_CLASSES:
            facts.append(f"(openable {name})")
    for o in spec.objects + spec.lamps:
        name, holder = escape(o.thor_id), receptacles[o.receptacle]
        facts += [
            f"(objectType {name} {o.cls}Type)",
            f"(inReceptacle {name} {escape(holder.thor_id)})",
            f"(objectAtLocation {name} {locations[holder.thor_id]})",
        ]
        if o.cls not in LAMP_CLASSES:
            facts.append(f"(pickupable {name})")
        if o.cls in constants.MOVABLE_RECEPTACLES_SET:
            facts.append(f"(isReceptacleObject {name})")
        for prop, predicate in (
            ("Cleanable", "cleanable"),
            ("Heatable", "heatable"),
            ("Coolable", "coolable"),
            ("Toggleable", "toggleable"),
            ("Sliceable", "sliceable"),
        ):
            if has_property(o.cls, prop):
                facts.append(f"({predicate} {name})")
        # ALFRED counts whatever starts in a fridge as already cool.
        if holder.cls == TOOLS["cool"] and has_property(o.cls, "Coolable"):
            facts.append(f"(isCool {name})")
    facts += [f"(canContain {r}Type {o}Type)" for r in rtypes for o in otypes if can_contain(r, o)]

    goal = goal_library.gdict[spec.official_task_type]["pddl"].format(
        obj=spec.object_target, recep=spec.parent_target, toggle=spec.toggle_target
    )
    indent = "\n        "
    return (
        f"(define (problem plan_{escape(spec.dir_name)})\n"
        f"    (:domain alfred)\n"
        f"    (:objects{indent}{indent.join(f'{name} - {kind}' for name, kind in declared)}\n    )\n"
        f"    (:init{indent}{indent.join(facts)}\n    )\n"
        f"{escape(goal.strip())}\n"
    )


def game_data(spec: GameSpec, problem: str, walkthrough: list[str] | None) -> dict:
    """The ``game.tw-pddl`` content; ``solvable`` is set from the walkthrough."""
    domain, grammar = logic_files()
    return {
        "pddl_domain": domain,
        "grammar": grammar.replace("UNKNOWN GOAL", spec.description),
        "pddl_problem": problem,
        "solvable": walkthrough is not None,
        "walkthrough": walkthrough,
    }
