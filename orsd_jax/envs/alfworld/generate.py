"""Command line for the procedural game generator (see ``generation``).

python -m orsd_jax.envs.alfworld.generate --out DIR --split train|valid_seen|valid_unseen --n N --seed S
    [--difficulty easy|standard|hard] [--workers W]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from orsd_jax.envs.alfworld.generation import SPLITS, generate_games


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Writes procedurally generated ALFWorld games in the official layout.")
    parser.add_argument("--out", required=True, help="data root; games go to OUT/json_2.1.1/<split>/")
    parser.add_argument("--split", required=True, choices=SPLITS)
    parser.add_argument("--n", type=int, required=True, help="number of games")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", default="standard", help="easy, standard or hard")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: by size, up to the CPUs)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    games = generate_games(args.out, {args.split: args.n}, args.seed, args.difficulty, args.workers)[args.split]
    print(
        f"wrote {len(games)} {args.split} games to {Path(args.out) / 'json_2.1.1' / args.split} "
        f"in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
