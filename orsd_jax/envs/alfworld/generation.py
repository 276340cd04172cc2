"""Procedurally generated ALFWorld games, written in the official on-disk layout.

``generate_games(out, {"train": 200}, seed=0)`` (or the ``generate`` command-line module) writes
``out/json_2.1.1/<split>/<task>-<obj>-None-<recep>-<scene>/trial_S<seed>_<index>/`` with
``traj_data.json``, ``initial_state.pddl`` and ``game.tw-pddl`` (``solvable`` and the planner's
``walkthrough``), which ``AlfredTWEnv`` collects like the downloaded games. Game ``i`` of a split
depends only on (seed, split, i, difficulty): the same arguments give the same files, whatever
the number of worker processes.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import random
from collections.abc import Iterator, Mapping
from pathlib import Path

from orsd_jax.envs.alfworld.difficulty import Difficulty, get_difficulty
from orsd_jax.envs.alfworld.planning import Planner, process_planner
from orsd_jax.envs.alfworld.problem import game_data, problem_pddl
from orsd_jax.envs.alfworld.sampling import sample_game
from orsd_jax.envs.alfworld.tasks import TASK_TYPES
from orsd_jax.envs.pool import main_module_not_reimported

SPLITS = ("train", "valid_seen", "valid_unseen")
GENERATOR_VERSION = 1  # part of cache names: bump when the same seed would give other games
MAX_ATTEMPTS = 20  # fresh draws of a game before giving up on it
MANIFEST = "generation.json"


def task_type_plan(n: int, weights: tuple[float, ...], rng: random.Random) -> list[str]:
    """``n`` task types in the shares ``weights`` asks for (largest remainders), shuffled."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    plan = [t for t, c in zip(TASK_TYPES, counts) for _ in range(c)]
    rng.shuffle(plan)
    return plan


@dataclasses.dataclass(frozen=True)
class GeneratedGame:
    rel_dir: str  # "<task dir>/<trial dir>" under the split
    traj_data: dict
    problem: str
    game: dict


def make_game(
    planner: Planner, split: str, seed: int, index: int, task_type: str, difficulty: Difficulty
) -> GeneratedGame:
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"orsd-alfworld/{seed}/{split}/{index}/{attempt}")
        spec = sample_game(task_type, split == "valid_unseen", difficulty, rng)
        walkthrough = planner.walkthrough(spec)
        if walkthrough:
            break
    else:
        raise RuntimeError(f"no solvable {task_type} game for {split} index {index} in {MAX_ATTEMPTS} draws")
    problem = problem_pddl(spec)
    traj_data = {
        "task_id": f"orsd_{split}_s{seed}_{index:05d}",
        "task_type": spec.official_task_type,
        "scene": {"floor_plan": f"FloorPlan{spec.scene}", "scene_num": spec.scene},
        "pddl_params": spec.pddl_params,
        "generator": {
            "version": GENERATOR_VERSION,
            "difficulty": difficulty.name,
            "seed": seed,
            "split": split,
            "index": index,
            "receptacles": len(spec.receptacles),
            "objects": len(spec.objects),
        },
    }
    return GeneratedGame(
        rel_dir=f"{spec.dir_name}/trial_S{seed}_{index:05d}",
        traj_data=traj_data,
        problem=problem,
        game=game_data(spec, problem, walkthrough),
    )


def write_game(split_dir: Path, game: GeneratedGame) -> Path:
    trial = split_dir / game.rel_dir
    trial.mkdir(parents=True)
    (trial / "traj_data.json").write_text(json.dumps(game.traj_data, indent=2, sort_keys=True))
    (trial / "initial_state.pddl").write_text(game.problem)
    (trial / "game.tw-pddl").write_text(json.dumps(game.game))
    return trial / "game.tw-pddl"


def _make_game_job(job: tuple) -> GeneratedGame:
    return make_game(process_planner(), *job)


def _produce(jobs: list[tuple], workers: int) -> Iterator[GeneratedGame]:
    """Games in job order, made here or by ``workers`` processes."""
    if workers == 1:
        yield from map(_make_game_job, jobs)
    else:  # spawn: the caller may be a JAX process, whose threads fork would copy badly
        with main_module_not_reimported():
            pool = mp.get_context("spawn").Pool(workers)
        with pool:
            yield from pool.imap(_make_game_job, jobs, chunksize=4)


def generate_games(
    out: str | os.PathLike,
    counts: Mapping[str, int],
    seed: int,
    difficulty: str | Difficulty = "standard",
    workers: int | None = None,
) -> dict[str, list[Path]]:
    """Writes ``counts[split]`` games per split under ``out/json_2.1.1``; returns their game files."""
    difficulty = get_difficulty(difficulty)
    root = Path(out) / "json_2.1.1"
    jobs = []
    for split, n in counts.items():
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if n < 1:
            raise ValueError(f"need at least one game per split, got {n} for {split}")
        if (root / split).exists() and any((root / split).iterdir()):
            raise FileExistsError(f"{root / split} already holds games; choose an empty --out")
        types = task_type_plan(n, difficulty.task_weights, random.Random(f"orsd-alfworld/{seed}/{split}/types"))
        jobs += [(split, seed, i, task_type, difficulty) for i, task_type in enumerate(types)]

    workers = workers or min(os.cpu_count() or 1, max(1, len(jobs) // 25))
    written: dict[str, list[Path]] = {split: [] for split in counts}
    for (split, *_), game in zip(jobs, _produce(jobs, workers)):
        written[split].append(write_game(root / split, game))
    for split, n in counts.items():
        manifest = {
            "version": GENERATOR_VERSION,
            "seed": seed,
            "games": n,
            "difficulty": dataclasses.asdict(difficulty),
        }
        (root / split / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return written
