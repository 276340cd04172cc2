"""ALFWorld on the real TextWorld/ALFWorld engine: environment, procedural games, official
splits, the verl-agent prompt, and the success metrics papers report."""

from orsd_jax.envs.alfworld.data import (
    DEFAULT_EVAL_GAMES,
    DEFAULT_TRAIN_GAMES,
    GameDataError,
    default_games,
    load_split,
)
from orsd_jax.envs.alfworld.difficulty import EASY, HARD, PRESETS, STANDARD, Difficulty, get_difficulty
from orsd_jax.envs.alfworld.env import MAX_STEPS, WIN_REWARD, AlfworldEnv
from orsd_jax.envs.alfworld.generation import SPLITS, generate_games
from orsd_jax.envs.alfworld.metrics import success_markdown, success_table
from orsd_jax.envs.alfworld.prompts import HISTORY_LENGTH, build_prompt
from orsd_jax.envs.alfworld.tasks import COLUMNS, TASK_TYPES

__all__ = [
    "COLUMNS",
    "DEFAULT_EVAL_GAMES",
    "DEFAULT_TRAIN_GAMES",
    "EASY",
    "HARD",
    "HISTORY_LENGTH",
    "MAX_STEPS",
    "PRESETS",
    "SPLITS",
    "STANDARD",
    "TASK_TYPES",
    "WIN_REWARD",
    "AlfworldEnv",
    "Difficulty",
    "GameDataError",
    "build_prompt",
    "default_games",
    "generate_games",
    "get_difficulty",
    "load_split",
    "success_markdown",
    "success_table",
]
