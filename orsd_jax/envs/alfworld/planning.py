"""Solvability check and walkthrough: Fast Downward on the part of the room the task touches.

TextWorld's planner (``PddlState.replan``) is a blind uniform-cost search. On a full room of 30-50
receptacles and as many objects it runs for minutes, because every door it could open and every
object it could carry multiplies the states. The goal only mentions the target objects, one
receptacle of the goal class, the appliance and the lamp, and removing anything else only removes
options (every action's preconditions name just its own arguments), so a plan for that part is
a plan for the whole room, and an optimal one: any two receptacles are one ``go to`` apart, and
every target object and where it lies is kept. The plan is written with the names the full
game shows ("cabinet 7"), from the official ``Demangler`` over the full game's entities.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import fast_downward
from alfworld.agents.utils.misc import Demangler
from textworld.envs.pddl import logic as pddl_logic

from orsd_jax.envs.alfworld.problem import declarations, logic_files, problem_pddl
from orsd_jax.envs.alfworld.sampling import TOOLS, GameSpec


def relevant_part(spec: GameSpec) -> GameSpec:
    """The game reduced to the task's objects, where they lie, one goal receptacle, the
    appliance and the lamp with its holder."""
    targets = tuple(o for o in spec.objects if o.cls == spec.object_target)
    keep = {o.receptacle for o in targets + spec.lamps}
    for cls in (spec.parent_target, TOOLS.get(spec.task_type)):
        if cls:
            keep.add(next(r.thor_id for r in spec.receptacles if r.cls == cls))
    receptacles = tuple(r for r in spec.receptacles if r.thor_id in keep)
    return dataclasses.replace(spec, receptacles=receptacles, objects=targets)


def display_names(spec: GameSpec) -> dict[str, types.SimpleNamespace]:
    """PDDL name (lower-cased, as Fast Downward reports it) -> the name the game shows."""
    ids = {name.lower(): types.SimpleNamespace(id=name.lower()) for name, _ in declarations(spec)}
    demangler = Demangler(game_infos=ids)
    return {name: types.SimpleNamespace(name=demangler.demangle_alfred_name(name)) for name in ids}


class Planner:
    """A planner library and the parsed domain, reused for many games.

    Like TextWorld, it never unloads its copy of the library: loading another copy after
    ``dlclose`` crashes the process.
    """

    def __init__(self) -> None:
        domain, grammar = logic_files()
        self._logic = pddl_logic.GameLogic(domain=domain, grammar=grammar)
        self._lib = fast_downward.load_lib()

    def walkthrough(self, spec: GameSpec) -> list[str] | None:
        """The planner's commands that win ``spec``, or None when it finds no plan."""
        state = pddl_logic.PddlState(self._lib, problem_pddl(relevant_part(spec)), self._logic)
        if state.check_goal():
            return None  # already won at the start: not a task
        plan = state.replan(display_names(spec))
        return plan or None


@functools.cache
def process_planner() -> Planner:
    """The planner of this process."""
    return Planner()
