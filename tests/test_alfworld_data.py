"""Split loading against the official collector, clear errors for bad data, and the cached
default game set."""

import json
import shutil
from pathlib import Path

import pytest
from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

from orsd_jax.envs.alfworld import EASY, SPLITS, GameDataError, default_games, generate_games, load_split
from orsd_jax.envs.alfworld import data as data_module
from orsd_jax.envs.alfworld.data import interleave_types
from orsd_jax.envs.alfworld.tasks import SHORT_NAMES, TASK_TYPES
from orsd_jax.envs.base import Task


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data")
    generate_games(path, {"train": 8}, seed=21, difficulty=EASY, workers=1)
    return path


def _official(split_path: Path) -> list[str]:
    config = {
        "env": {"goal_desc_human_anns_prob": 0.0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {"data_path": str(split_path), "num_train_games": -1, "num_eval_games": -1},
    }
    return sorted(AlfredTWEnv(config, train_eval="train").game_files)


def test_skips_what_the_official_loader_skips(root, tmp_path):
    """Unsupported directories, task types and unsolvable games are dropped exactly as the
    official ``AlfredTWEnv`` drops them."""
    work = tmp_path / "copy"
    shutil.copytree(root, work)
    split = work / "json_2.1.1" / "train"
    trials = sorted(p.parent for p in split.rglob("traj_data.json"))

    def edit(path: Path, **changes) -> None:
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))

    shutil.copytree(trials[0], split / "pick_and_place_with_movable_recep-Apple-Bowl-Fridge-7" / "trial_x")
    shutil.copytree(trials[1], split / "pick_heat_then_place_in_recep-AppleSliced-None-Fridge-7" / "trial_y")
    edit(trials[2] / "traj_data.json", task_type="pick_and_place_with_movable_recep")
    edit(trials[3] / "game.tw-pddl", solvable=False)
    game = json.loads((trials[4] / "game.tw-pddl").read_text())
    del game["solvable"]
    (trials[4] / "game.tw-pddl").write_text(json.dumps(game))
    (trials[5] / "game.tw-pddl").unlink()

    ours = load_split(work, "train")
    assert sorted(t.key for t in ours) == _official(split)
    assert len(ours) == len(trials) - 4


def test_every_prefix_of_a_split_is_a_fair_sample_of_its_task_types():
    counts = dict(zip(TASK_TYPES, (13, 12, 7, 6, 6, 6)))  # an easy split's mix
    tasks = [
        Task("alfworld", f"games/{kind}-{i:02d}/game.tw-pddl", kind, "") for kind, n in counts.items() for i in range(n)
    ]
    order = interleave_types(tasks[::-1])
    assert sorted(t.key for t in order) == sorted(t.key for t in tasks)
    for kind in TASK_TYPES:  # each type in path order
        keys = [t.key for t in order if t.task_type == kind]
        assert keys == sorted(keys)
    total = len(tasks)
    for n in range(1, total + 1):
        for kind, k in counts.items():
            assert abs(sum(t.task_type == kind for t in order[:n]) - n * k / total) <= 1, (n, kind)


def test_tasks_carry_type_and_sentence(root, monkeypatch):
    monkeypatch.chdir(root.parent)
    tasks = load_split(root.name, "train")  # a relative data root still gives absolute game paths
    assert all(Path(t.key).is_absolute() for t in tasks)
    assert [t.key for t in tasks] == [t.key for t in interleave_types(tasks)]
    some = sorted({t.task_type for t in tasks})[:2]
    assert [t.key for t in load_split(root.name, "train", some)] == [t.key for t in tasks if t.task_type in some]
    with pytest.raises(ValueError, match="unknown ALFWorld task types"):
        load_split(root.name, "train", ("pick", "juggle"))
    for task in tasks:
        traj = json.loads((Path(task.key).parent / "traj_data.json").read_text())
        assert task.env == "alfworld" and task.key.endswith("game.tw-pddl")
        assert SHORT_NAMES[traj["task_type"]] == task.task_type
        assert Path(task.key).parent.parent.name.startswith(traj["task_type"] + "-")
        assert f"Your task is to: {task.description}." in json.loads(Path(task.key).read_text())["grammar"]


def test_bad_directories_give_errors_naming_the_path(root, tmp_path):
    with pytest.raises(GameDataError, match="does not exist"):
        load_split(tmp_path / "nowhere", "train")
    with pytest.raises(GameDataError, match=r"json_2\.1\.1/valid_seen is missing"):
        load_split(root, "valid_seen")
    with pytest.raises(ValueError, match="unknown split"):
        load_split(root, "test")
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(GameDataError, match="no playable ALFWorld games"):
        load_split(tmp_path, "train")
    broken = tmp_path / "json_2.1.1" / "train" / "pick_and_place_simple-Apple-None-Fridge-7" / "trial_1"
    broken.mkdir(parents=True)
    (broken / "traj_data.json").write_text("{not json")
    with pytest.raises(GameDataError, match=str(broken / "traj_data.json")):
        load_split(tmp_path, "train")


def test_default_games_are_generated_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    monkeypatch.setenv("ORSD_JAX_CACHE", str(tmp_path / "cache"))
    path = default_games("easy", seed=4, n_train=6, n_eval=3, workers=1)
    assert path.parent == tmp_path / "cache" / "alfworld" and path.name.startswith("easy-seed4-train6-eval3-")
    assert [len(load_split(path, split)) for split in SPLITS] == [6, 3, 3]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no scratch left behind

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(data_module, "generate_games", no_generation)
    assert default_games("easy", seed=4, n_train=6, n_eval=3) == path
    with pytest.raises(AssertionError):
        default_games("easy", seed=5, n_train=6, n_eval=3)  # another seed is another set
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_default_games_prefers_alfworld_data(root, tmp_path, monkeypatch):
    for split in SPLITS[1:]:
        shutil.copytree(root / "json_2.1.1" / "train", tmp_path / "json_2.1.1" / split)
    shutil.copytree(root / "json_2.1.1" / "train", tmp_path / "json_2.1.1" / "train")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    assert default_games() == tmp_path
    monkeypatch.setenv("ALFWORLD_DATA", str(root))  # train only
    with pytest.raises(GameDataError, match="valid_seen is missing"):
        default_games()


def test_an_incomplete_cached_set_is_reported(tmp_path, monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    (tmp_path / "alfworld" / data_module.cache_name(EASY, 0, 2, 1)).mkdir(parents=True)
    with pytest.raises(GameDataError, match="not a complete generated set"):
        default_games("easy", seed=0, n_train=2, n_eval=1, cache_dir=tmp_path)
