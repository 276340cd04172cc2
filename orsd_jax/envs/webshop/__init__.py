"""WebShop in text mode, offline: official data, BM25 search, the original reward and goals."""

from orsd_jax.envs.webshop.data import DATA_ENV_VAR, Catalog, Product, WebShopDataError, load_catalog
from orsd_jax.envs.webshop.env import WebShopEnv, parse_command
from orsd_jax.envs.webshop.goals import Goal, GoalSet, make_goal_set
from orsd_jax.envs.webshop.oracle import OraclePolicy, oracle_episode, run_oracle
from orsd_jax.envs.webshop.pages import Page
from orsd_jax.envs.webshop.prompts import build_prompt, format_observation
from orsd_jax.envs.webshop.reward import RewardBreakdown, get_reward
from orsd_jax.envs.webshop.search import SearchEngine, analyze
from orsd_jax.envs.webshop.world import World, goal_task, load_goals, load_world

__all__ = [
    "DATA_ENV_VAR",
    "Catalog",
    "Goal",
    "GoalSet",
    "OraclePolicy",
    "Page",
    "Product",
    "RewardBreakdown",
    "SearchEngine",
    "WebShopDataError",
    "WebShopEnv",
    "World",
    "analyze",
    "build_prompt",
    "format_observation",
    "get_reward",
    "goal_task",
    "load_catalog",
    "load_goals",
    "load_world",
    "make_goal_set",
    "parse_command",
    "oracle_episode",
    "run_oracle",
]
