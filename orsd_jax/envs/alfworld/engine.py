"""The real ALFWorld text engine: TextWorld's PDDL backend with ALFWorld's own wrappers.

This is the stack ``AlfredTWEnv.init_env`` builds for one game, without the gym batching:
``PddlEnv`` (Fast Downward grounding and planning) under ``AlfredDemangler`` (THOR ids to
"cabinet 3") and ``AlfredInfos`` (the game file in ``extra.gamefile``). Each ``PddlEnv`` loads
its own copy of the planner library, so several engines can live in one process.

TextWorld translates the game's PDDL to Fast Downward's SAS format twice on ``load`` and twice
again on every ``reset`` (0.2-2 s each on official-size rooms). The translation is a pure
function of its text arguments, so ``make_engine`` memoises the last few results: a reset of a
game already loaded in this process (the first reset after ``load``, or another copy of the game
in the same worker) then skips it. The cached task objects are only read by TextWorld.
"""

from __future__ import annotations

import functools

import fast_downward
import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from textworld.envs.pddl import PddlEnv

NOTHING_HAPPENS = "Nothing happens."  # the engine's reply to a command that is not admissible
_TRANSLATIONS_KEPT = 8  # two per game (plain and optimised for the planner)


def _memoise_translation() -> None:
    if not hasattr(fast_downward.pddl2sas, "cache_info"):
        fast_downward.pddl2sas = functools.lru_cache(maxsize=_TRANSLATIONS_KEPT)(fast_downward.pddl2sas)


def make_engine(*, plan: bool = False) -> textworld.core.Wrapper:
    """An engine to ``load`` game files into; ``plan`` adds the planner's policy to each state."""
    _memoise_translation()
    infos = textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=plan, extras=["gamefile"])
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
