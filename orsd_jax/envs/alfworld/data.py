"""ALFWorld splits on disk: collected with the official loader's rules, or generated once and cached.

A data root holds ``json_2.1.1/{train,valid_seen,valid_unseen}`` (what ``alfworld-download`` puts
in ``$ALFWORLD_DATA``, or what ``generate_games`` writes). ``load_split`` keeps a game when, as in
``AlfredTWEnv.collect_game_files``, its path has no ``movable`` or ``Sliced``, its
``traj_data.json`` names one of the six task types, and its ``game.tw-pddl`` says ``solvable``.
Unlike the official loader (which walks in file-system order) the result has a fixed order, and
the ``movable``/``Sliced`` test looks only below the split directory.

The order interleaves the task types: paths sort by type first, so a sorted split's first games
would all be ``look`` tasks, and every "first N games" (warm-start demonstrations, a short
evaluation) would see one type. Interleaved, any prefix holds each type in about its share of
the split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from orsd_jax.envs.alfworld.difficulty import Difficulty, get_difficulty
from orsd_jax.envs.alfworld.generation import GENERATOR_VERSION, SPLITS, generate_games
from orsd_jax.envs.alfworld.tasks import SHORT_NAMES, TASK_TYPES
from orsd_jax.envs.base import Task

SPLIT_ALIASES = {"eval_in_distribution": "valid_seen", "eval_out_of_distribution": "valid_unseen"}
DEFAULT_TRAIN_GAMES = 200
DEFAULT_EVAL_GAMES = 50
_TASK_RULE = re.compile(r'"rhs": "Your task is to: (.*)\."')
_COMPLETE = "complete.json"  # written last into a generated root before it is renamed into place


class GameDataError(ValueError):
    """A data directory that is missing, empty or malformed."""


def split_dir(data_dir: str | os.PathLike, split: str) -> Path:
    name = SPLIT_ALIASES.get(split, split)
    if name not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS} or {tuple(SPLIT_ALIASES)}")
    root = Path(data_dir).expanduser().resolve()  # task keys must work from any working directory
    if not root.is_dir():
        raise GameDataError(f"ALFWorld data directory {root} does not exist")
    path = root / "json_2.1.1" / name
    if not path.is_dir():
        raise GameDataError(
            f"{path} is missing: an ALFWorld data root holds json_2.1.1/{{{','.join(SPLITS)}}} "
            "(set ALFWORLD_DATA, or generate games with python -m orsd_jax.envs.alfworld.generate)"
        )
    return path


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GameDataError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise GameDataError(f"{path} does not hold a JSON object")
    return data


def task_sentence(game: dict, path: Path) -> str:
    """The goal text the game's grammar prints after "Your task is to: "."""
    match = _TASK_RULE.search(str(game.get("grammar", "")))
    if match is None:
        raise GameDataError(f"{path} has no task sentence in its grammar")
    return match.group(1)


def load_split(data_dir: str | os.PathLike, split: str, task_types: Sequence[str] = ()) -> list[Task]:
    """The playable games of a split (of ``task_types`` only, when given) in ``interleave_types``
    order, that of a deterministic sweep."""
    unknown = set(task_types) - set(TASK_TYPES)
    if unknown:
        raise ValueError(f"unknown ALFWorld task types {sorted(unknown)}; expected some of {TASK_TYPES}")
    path = split_dir(data_dir, split)
    tasks = []
    for root, _, files in os.walk(path):
        if "traj_data.json" not in files:
            continue
        relative = os.path.relpath(root, path)
        if "movable" in relative or "Sliced" in relative:
            continue
        official = _read_json(Path(root) / "traj_data.json").get("task_type")
        task_type = SHORT_NAMES.get(official) if isinstance(official, str) else None
        game_path = Path(root) / "game.tw-pddl"
        if task_type is None or not game_path.is_file():
            continue
        game = _read_json(game_path)
        if game.get("solvable") is True and (not task_types or task_type in task_types):
            tasks.append(Task("alfworld", str(game_path), task_type, task_sentence(game, game_path)))
    if not tasks:
        of_types = f" of types {', '.join(task_types)}" if task_types else ""
        raise GameDataError(f"no playable ALFWorld games{of_types} under {path}")
    return interleave_types(tasks)


def interleave_types(tasks: Sequence[Task]) -> list[Task]:
    """``tasks`` sorted by path within each type, the types merged by position: a type's ``j``-th
    of ``n`` games sits at ``(j + 1/2) / n`` of the way through (ties in ``TASK_TYPES`` order)."""
    by_type: dict[str, list[Task]] = {}
    for task in sorted(tasks, key=lambda t: t.key):
        by_type.setdefault(task.task_type, []).append(task)
    position = {
        t.key: ((j + 0.5) / len(ts), TASK_TYPES.index(kind)) for kind, ts in by_type.items() for j, t in enumerate(ts)
    }
    return sorted(tasks, key=lambda t: (*position[t.key], t.key))


def user_data_root() -> Path | None:
    """``$ALFWORLD_DATA`` as the user set it, or None.

    Importing ``alfworld`` sets the variable to ``~/.cache/alfworld`` (and creates that folder)
    when it is unset; that default counts as unset unless it holds games.
    """
    value = os.environ.get("ALFWORLD_DATA")
    if not value:
        return None
    root = Path(value).expanduser()
    if root == Path("~/.cache/alfworld").expanduser() and not (root / "json_2.1.1").exists():
        return None
    return root


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$ORSD_JAX_CACHE``, else ``~/.cache/orsd_jax``."""
    return Path(cache_dir or os.environ.get("ORSD_JAX_CACHE") or Path.home() / ".cache" / "orsd_jax").expanduser()


def cache_name(difficulty: Difficulty, seed: int, n_train: int, n_eval: int) -> str:
    """``<difficulty>-seed<seed>-train<n>-eval<n>-v<generator version>-<digest of the settings>``."""
    settings = json.dumps(dataclasses.asdict(difficulty), sort_keys=True).encode()
    digest = hashlib.sha256(settings).hexdigest()[:8]
    return f"{difficulty.name}-seed{seed}-train{n_train}-eval{n_eval}-v{GENERATOR_VERSION}-{digest}"


def default_games(
    difficulty: str | Difficulty = "easy",
    seed: int = 0,
    n_train: int = DEFAULT_TRAIN_GAMES,
    n_eval: int = DEFAULT_EVAL_GAMES,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> Path:
    """A data root with all three splits: ``$ALFWORLD_DATA`` when set, else games generated
    once into the user cache (``n_eval`` each for valid_seen and valid_unseen) and reused."""
    root = user_data_root()
    if root is not None:
        for split in SPLITS:
            split_dir(root, split)
        return root
    difficulty = get_difficulty(difficulty)
    name = cache_name(difficulty, seed, n_train, n_eval)
    base = cache_root(cache_dir) / "alfworld"
    target = base / name
    if (target / _COMPLETE).is_file():
        return target
    if target.exists():
        raise GameDataError(f"{target} exists but is not a complete generated set; delete it to regenerate")
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=base))
    try:
        counts = {"train": n_train, "valid_seen": n_eval, "valid_unseen": n_eval}
        generate_games(scratch, counts, seed, difficulty, workers)
        (scratch / _COMPLETE).write_text(json.dumps({"version": GENERATOR_VERSION, "name": name}))
        try:
            os.rename(scratch, target)  # atomic: readers see no set or a complete one
        except OSError:
            if not (target / _COMPLETE).is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
