"""Procedural games checked against independent oracles: the real TextWorld/ALFWorld engine,
its own Fast Downward planner on the full game, the official ``AlfredTWEnv`` collector and
ALFRED's own scene split."""

import filecmp
import importlib.resources
import json
import random
import statistics
from pathlib import Path

import pytest
from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv
from alfworld.gen import constants

from orsd_jax.envs.alfworld import EASY, STANDARD, TASK_TYPES, Difficulty, generate_games, get_difficulty, load_split
from orsd_jax.envs.alfworld.engine import NOTHING_HAPPENS, make_engine
from orsd_jax.envs.alfworld.generate import main
from orsd_jax.envs.alfworld.generation import task_type_plan
from orsd_jax.envs.alfworld.sampling import is_unseen_pair
from orsd_jax.envs.alfworld.scenes import load_scene, receptacle_class

SEEDS = (0, 1, 2)
UNIFORM_EASY = Difficulty("easy-uniform", (3, 5), (0, 2), (1, 1), "visible", False, (1,) * 6)


def _game(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _traj(path: str) -> dict:
    return json.loads((Path(path).parent / "traj_data.json").read_text())


@pytest.fixture(scope="module")
def easy_roots(tmp_path_factory) -> dict[int, Path]:
    roots = {}
    for seed in SEEDS:
        roots[seed] = tmp_path_factory.mktemp(f"easy{seed}")
        generate_games(roots[seed], {"train": 6, "valid_unseen": 6}, seed, UNIFORM_EASY, workers=1)
    return roots


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def _play_walkthrough(engine, task) -> None:
    """The engine loads the game, shows the task, refuses a nonsense command and is won by the
    walkthrough on its last command and not before."""
    engine.load(task.key)
    state = engine.reset()
    assert f"Your task is to: {task.description}." in state.feedback
    before = state["admissible_commands"]
    state, _, _ = engine.step("fly to the moon")
    assert state.feedback == NOTHING_HAPPENS and state["admissible_commands"] == before
    walkthrough = _game(task.key)["walkthrough"]
    for i, command in enumerate(walkthrough):
        assert not state["won"], f"won before step {i} of {walkthrough}"
        assert command in state["admissible_commands"], (command, state["admissible_commands"])
        state, _, _ = engine.step(command)
    assert state["won"]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_task_type_is_won_by_its_walkthrough(easy_roots, engine, seed):
    tasks = load_split(easy_roots[seed], "train") + load_split(easy_roots[seed], "valid_unseen")
    assert {t.task_type for t in load_split(easy_roots[seed], "train")} == set(TASK_TYPES)
    for task in tasks:
        _play_walkthrough(engine, task)


def test_standard_games_are_won_by_their_walkthrough(tmp_path, engine):
    generate_games(tmp_path, {"train": 6}, seed=0, difficulty=STANDARD, workers=1)
    tasks = load_split(tmp_path, "train")
    assert {t.task_type for t in tasks} == set(TASK_TYPES)
    for task in tasks:
        _play_walkthrough(engine, task)


def test_walkthrough_is_as_short_as_the_engines_own_plan(easy_roots):
    """The engine's planner on the whole room finds no shorter plan than the walkthrough,
    which was planned on the task's part of the room only."""
    planner = make_engine(plan=True)
    for task in load_split(easy_roots[0], "train"):
        planner.load(task.key)
        own_plan = planner.reset()["policy_commands"]
        assert own_plan and len(own_plan) == len(_game(task.key)["walkthrough"])


@pytest.mark.parametrize("split", ["train", "valid_unseen"])
def test_official_loader_collects_the_generated_split(easy_roots, split):
    alias = {"train": "train", "valid_unseen": "eval_out_of_distribution"}[split]
    path = str(easy_roots[1] / "json_2.1.1" / split)
    config = {
        "env": {"goal_desc_human_anns_prob": 0.0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {
            "data_path": path,
            "eval_id_data_path": path,
            "eval_ood_data_path": path,
            "num_train_games": -1,
            "num_eval_games": -1,
        },
    }
    official = AlfredTWEnv(config, train_eval=alias).game_files
    ours = sorted(t.key for t in load_split(easy_roots[1], split))
    assert len(official) == 6 and sorted(official) == ours


def test_generation_is_reproducible(tmp_path, easy_roots):
    generate_games(tmp_path / "again", {"train": 6, "valid_unseen": 6}, 0, UNIFORM_EASY, workers=2)
    comparison = filecmp.dircmp(easy_roots[0], tmp_path / "again")
    assert _identical_trees(comparison)
    first = {Path(t.key).read_bytes() for t in load_split(easy_roots[0], "train")}
    other_seed = {Path(t.key).read_bytes() for t in load_split(easy_roots[1], "train")}
    assert not first & other_seed


def _identical_trees(cmp: filecmp.dircmp) -> bool:
    _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
    same_here = not (cmp.left_only or cmp.right_only or mismatch or errors)
    return same_here and all(_identical_trees(sub) for sub in cmp.subdirs.values())


def test_unseen_split_uses_new_scenes_and_pairs(tmp_path):
    generate_games(tmp_path, {"train": 30, "valid_unseen": 30}, seed=3, difficulty=EASY, workers=1)
    keys = {split: [_traj(t.key) for t in load_split(tmp_path, split)] for split in ("train", "valid_unseen")}

    def pair(traj):
        params = traj["pddl_params"]
        return params["object_target"], params["parent_target"] or params["toggle_target"]

    train_scenes = {t["scene"]["scene_num"] for t in keys["train"]}
    unseen_scenes = {t["scene"]["scene_num"] for t in keys["valid_unseen"]}
    assert train_scenes <= set(constants.TRAIN_SCENE_NUMBERS)
    assert unseen_scenes <= set(constants.TEST_SCENE_NUMBERS)
    train_pairs = {pair(t) for t in keys["train"]}
    unseen_pairs = {pair(t) for t in keys["valid_unseen"]}
    assert not train_pairs & unseen_pairs
    assert all(is_unseen_pair(*p) for p in unseen_pairs) and not any(is_unseen_pair(*p) for p in train_pairs)


def test_easy_games_are_short_and_standard_games_longer(tmp_path):
    lengths, receptacles = {}, {}
    for difficulty in (EASY, STANDARD):
        root = tmp_path / difficulty.name
        generate_games(root, {"train": 24}, seed=0, difficulty=difficulty, workers=1)
        trajs = [(_game(t.key), _traj(t.key)) for t in load_split(root, "train")]
        lengths[difficulty.name] = statistics.mean(len(game["walkthrough"]) for game, _ in trajs)
        receptacles[difficulty.name] = [traj["generator"]["receptacles"] for _, traj in trajs]
    assert lengths["easy"] <= 6
    assert lengths["standard"] > lengths["easy"]
    assert max(receptacles["easy"]) <= EASY.receptacles[1]
    assert statistics.mean(receptacles["standard"]) > 2 * statistics.mean(receptacles["easy"])


def test_scenes_come_from_the_package_tables():
    """Every scene keeps the receptacles the package lists for it, each at a location of its own."""
    layouts = importlib.resources.files("alfworld.gen") / "layouts"
    for number in constants.SCENE_NUMBERS:
        scene = load_scene(number)
        listed = json.loads((layouts / f"FloorPlan{number}-objects.json").read_text())
        posed = json.loads((layouts / f"FloorPlan{number}-openable.json").read_text())
        ids = {r.thor_id for r in scene.receptacles}
        assert {i for i in posed if receptacle_class(i) in constants.VAL_RECEPTACLE_OBJECTS} <= ids
        assert {r.cls for r in scene.receptacles} <= set(constants.VAL_RECEPTACLE_OBJECTS)
        assert set(scene.object_classes) <= set(listed)
        assert len({r.pose for r in scene.receptacles}) == len(scene.receptacles)


def test_task_type_plan_follows_the_weights():
    plan = task_type_plan(80, EASY.task_weights, random.Random(0))
    counts = [plan.count(t) for t in TASK_TYPES]
    assert counts == [20, 20, 10, 10, 10, 10]
    uneven = task_type_plan(7, (1,) * 6, random.Random(1))
    assert len(uneven) == 7 and {uneven.count(t) for t in TASK_TYPES} == {1, 2}
    assert task_type_plan(7, (1,) * 6, random.Random(1)) == uneven


def test_cli_writes_a_split_and_refuses_to_overwrite(tmp_path, capsys):
    main(["--out", str(tmp_path), "--split", "valid_seen", "--n", "2", "--seed", "5", "--difficulty", "easy"])
    assert len(load_split(tmp_path, "eval_in_distribution")) == 2
    assert "wrote 2 valid_seen games" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="valid_seen"):
        main(["--out", str(tmp_path), "--split", "valid_seen", "--n", "2"])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown difficulty"):
        get_difficulty("nightmare")
    with pytest.raises(ValueError, match="target_placement"):
        Difficulty("x", None, None, (1, 1), "under the bed", True, (1,) * 6)
    with pytest.raises(ValueError, match="task_weights"):
        Difficulty("x", None, None, (1, 1), "any", True, (1, 1))
    with pytest.raises(ValueError, match="receptacles"):
        Difficulty("x", (5, 3), None, (1, 1), "any", True, (1,) * 6)
    with pytest.raises(ValueError, match="unknown split"):
        generate_games("unused", {"test": 1}, seed=0)
