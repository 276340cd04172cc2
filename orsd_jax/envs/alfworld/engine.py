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

TextWorld's text grammar is parsed by TatSu, a pure-Python PEG parser: ``load`` parses the game's
grammar (its rules' right-hand sides are mostly the same text in every game), and every step
parses each admissible command's template, the conditions of the rules it expands and the
feedback rule again. ``make_engine`` memoises these parses too: symbols and conditions are
deep-copied out of the cache (``derive`` writes a context into them), and a game's parsed grammar
is kept for the last few games (``GameLogic`` copies its rules into a grammar of its own and only
reads them).
"""

from __future__ import annotations

import copy
import functools

import fast_downward
import textworld
import textworld.logic
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from textworld.envs.pddl import PddlEnv, textgen
from textworld.envs.pddl import logic as pddl_logic

NOTHING_HAPPENS = "Nothing happens."  # the engine's reply to a command that is not admissible
_TRANSLATIONS_KEPT = 8  # two per game (plain and optimised for the planner)
_GRAMMARS_KEPT = 8
_SYMBOLS_KEPT = 4096  # texts parsed: 82 distinct right-hand sides and templates in 6 easy games


def _memoise_translation() -> None:
    if not hasattr(fast_downward.pddl2sas, "cache_info"):
        fast_downward.pddl2sas = functools.lru_cache(maxsize=_TRANSLATIONS_KEPT)(fast_downward.pddl2sas)


def _copied_from_cache(parse, maxsize: int):
    """``parse`` memoised; each call gets its own deep copy (callers write into the parsed objects)."""
    cached = functools.lru_cache(maxsize=maxsize)(parse)

    def parse_copy(*args, **kwargs):
        return copy.deepcopy(cached(*args, **kwargs))

    parse_copy.cache_info = cached.cache_info  # type: ignore[attr-defined]  # hits; marks the patch as in
    return parse_copy


def _memoise_parses() -> None:
    if hasattr(textgen._parse_and_convert, "cache_info"):
        return
    textgen._parse_and_convert = _copied_from_cache(textgen._parse_and_convert, _SYMBOLS_KEPT)
    textworld.logic._parse_and_convert = _copied_from_cache(textworld.logic._parse_and_convert, _SYMBOLS_KEPT)
    pddl_logic._parse_and_convert = functools.lru_cache(maxsize=_GRAMMARS_KEPT)(pddl_logic._parse_and_convert)


def make_engine(*, plan: bool = False) -> textworld.core.Wrapper:
    """An engine to ``load`` game files into; ``plan`` adds the planner's policy to each state."""
    _memoise_translation()
    _memoise_parses()
    infos = textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=plan, extras=["gamefile"])
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
