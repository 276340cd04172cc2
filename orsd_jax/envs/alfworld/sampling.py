"""Drawing one game: a task (type, object, target) and a room laid out for it.

Everything here is a pure function of its arguments and a ``random.Random``, so a game is fixed
by (seed, split, index). The in-distribution/out-of-distribution separation follows ALFRED:
train and valid_seen games use the train floor plans, valid_unseen games the test floor plans,
and the (object, target) pairs are split too, so the unseen split asks for combinations the
train split never does.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random

from alfworld.gen import constants, goal_library

from orsd_jax.envs.alfworld.difficulty import Difficulty
from orsd_jax.envs.alfworld.scenes import (
    LAMP_HOLDERS,
    OPENABLE_CLASSES,
    Receptacle,
    can_contain,
    has_property,
    load_scene,
    scene_numbers,
)
from orsd_jax.envs.alfworld.tasks import OFFICIAL_NAMES

# The appliance each task type needs, and the object property it acts on (alfred.pddl hard-codes
# SinkBasinType, MicrowaveType and FridgeType in the clean, heat and cool actions).
TOOLS = {"clean": "SinkBasin", "heat": "Microwave", "cool": "Fridge"}
PROPERTIES = {"clean": "Cleanable", "heat": "Heatable", "cool": "Coolable"}
UNSEEN_PAIR_SHARE = 4  # one (object, target) pair in four is reserved for valid_unseen


@dataclasses.dataclass(frozen=True)
class PlacedObject:
    thor_id: str
    cls: str
    receptacle: str  # thor id of the receptacle it starts in


@dataclasses.dataclass(frozen=True)
class GameSpec:
    """A complete game before it is written as PDDL."""

    task_type: str  # short name: pick, look, clean, heat, cool, pick2
    scene: int
    object_target: str  # class of the object to move or look at
    parent_target: str  # class of the receptacle to put it in ("" for look)
    toggle_target: str  # class of the lamp to switch on (look only, else "")
    description: str  # the task sentence
    receptacles: tuple[Receptacle, ...]
    objects: tuple[PlacedObject, ...]  # pickupable objects, targets included
    lamps: tuple[PlacedObject, ...]
    start_pose: tuple[int, int, int, int]

    @property
    def official_task_type(self) -> str:
        return OFFICIAL_NAMES[self.task_type]

    @property
    def dir_name(self) -> str:
        """The official task directory name: ``<task>-<obj>-<mrecep>-<recep or toggle>-<scene>``."""
        target = self.parent_target or self.toggle_target
        return f"{self.official_task_type}-{self.object_target}-None-{target}-{self.scene}"

    @property
    def pddl_params(self) -> dict:
        return {
            "object_target": self.object_target,
            "parent_target": self.parent_target,
            "toggle_target": self.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        }


def is_unseen_pair(object_cls: str, target_cls: str) -> bool:
    digest = hashlib.sha256(f"{object_cls}|{target_cls}".encode()).digest()
    return digest[0] % UNSEEN_PAIR_SHARE == 0


def _placement_pool(receptacles: list[Receptacle], placement: str) -> list[Receptacle]:
    if placement == "visible":
        return [r for r in receptacles if r.cls not in OPENABLE_CLASSES]
    if placement == "hidden":
        return [r for r in receptacles if r.cls in OPENABLE_CLASSES] or receptacles
    return receptacles


def _sources(scene_number: int, task_type: str, obj: str, target: str, placement: str) -> list[Receptacle]:
    """Receptacles the task's objects may start in: never the goal or the appliance, so the
    task is not already done and needs its defining action."""
    excluded = {target, TOOLS.get(task_type)}
    candidates = [r for r in load_scene(scene_number).receptacles if r.cls not in excluded and can_contain(r.cls, obj)]
    return _placement_pool(candidates, placement)


def _targets(scene_number: int, task_type: str, obj: str, closed_goal: bool) -> list[str]:
    scene = load_scene(scene_number)
    if task_type == "look":
        return [lamp for lamp in scene.lamp_classes if scene.receptacle_classes & set(LAMP_HOLDERS[lamp])]
    return sorted(
        cls
        for cls in scene.receptacle_classes
        if can_contain(cls, obj) and cls != TOOLS.get(task_type) and (closed_goal or cls not in OPENABLE_CLASSES)
    )


@functools.cache
def task_choices(task_type: str, unseen: bool, difficulty: Difficulty) -> tuple[tuple[int, str, str], ...]:
    """Every (scene, object class, target class) this split can ask for, in a fixed order."""
    rooms = constants.GOALS_VALID[OFFICIAL_NAMES[task_type]]
    tool = TOOLS.get(task_type)
    choices = []
    for number in scene_numbers(unseen):
        scene = load_scene(number)
        if scene.room_type not in rooms or (tool and tool not in scene.receptacle_classes):
            continue
        for obj in scene.object_classes:
            if task_type in PROPERTIES and not has_property(obj, PROPERTIES[task_type]):
                continue
            for target in _targets(number, task_type, obj, difficulty.closed_goal):
                if is_unseen_pair(obj, target) != unseen:
                    continue
                if _sources(number, task_type, obj, target, difficulty.target_placement):
                    choices.append((number, obj, target))
    if not choices:
        raise ValueError(f"no {task_type} task fits the {'unseen' if unseen else 'seen'} scenes at {difficulty}")
    return tuple(choices)


def _new_id(cls: str, rng: random.Random, taken: set[str]) -> str:
    while True:
        xyz = (rng.uniform(-3.0, 3.0), rng.uniform(0.0, 2.0), rng.uniform(-3.0, 3.0))
        thor_id = "|".join([cls, *(f"{v:+06.2f}" for v in xyz)])
        if thor_id not in taken:
            taken.add(thor_id)
            return thor_id


def _start_pose(rng: random.Random, receptacles: tuple[Receptacle, ...]) -> tuple[int, int, int, int]:
    used = {r.pose for r in receptacles}
    while True:
        pose = (rng.randint(-12, 12), rng.randint(-12, 12), rng.randint(0, 3), 30)
        if pose not in used:
            return pose


def _choose_room(
    rng: random.Random, all_receptacles: tuple[Receptacle, ...], required: set[Receptacle], bounds
) -> tuple[Receptacle, ...]:
    if bounds is None:
        return all_receptacles
    size = rng.randint(*bounds)
    others = [r for r in all_receptacles if r not in required]
    extra = rng.sample(others, min(len(others), max(0, size - len(required))))
    return tuple(sorted(required | set(extra), key=lambda r: r.thor_id))


def sample_game(task_type: str, unseen: bool, difficulty: Difficulty, rng: random.Random) -> GameSpec:
    number, obj, target = rng.choice(task_choices(task_type, unseen, difficulty))
    scene = load_scene(number)
    look = task_type == "look"
    parent, toggle = ("", target) if look else (target, "")

    n_targets = rng.randint(*difficulty.target_instances)
    if task_type == "pick2":
        n_targets = max(2, n_targets)
    pool = _sources(number, task_type, obj, parent, difficulty.target_placement)
    sources = [rng.choice(pool) for _ in range(n_targets)]
    required = set(sources)
    if parent:
        required.add(rng.choice(scene.receptacles_of(parent)))
    if task_type in TOOLS:
        required.add(rng.choice(scene.receptacles_of(TOOLS[task_type])))
    lamp_holder = None
    if look:
        lamp_holder = rng.choice([r for r in scene.receptacles if r.cls in LAMP_HOLDERS[toggle]])
        required.add(lamp_holder)
    room = _choose_room(rng, scene.receptacles, required, difficulty.receptacles)

    taken = {r.thor_id for r in room}
    objects = [PlacedObject(_new_id(obj, rng, taken), obj, source.thor_id) for source in sources]
    others = [cls for cls in scene.object_classes if cls != obj]
    holders = {cls: [r for r in room if can_contain(r.cls, cls)] for cls in others}
    others = [cls for cls in others if holders[cls]]
    if difficulty.distractors is None:  # as ALFRED fills a scene: every class, 1-3 copies
        draws = [cls for cls in others for _ in range(rng.randint(1, constants.MAX_NUM_OF_OBJ_INSTANCES))]
    else:
        draws = [rng.choice(others) for _ in range(rng.randint(*difficulty.distractors))] if others else []
    objects += [PlacedObject(_new_id(cls, rng, taken), cls, rng.choice(holders[cls]).thor_id) for cls in draws]
    lamps = (PlacedObject(_new_id(toggle, rng, taken), toggle, lamp_holder.thor_id),) if lamp_holder is not None else ()

    template = rng.choice(goal_library.gdict[OFFICIAL_NAMES[task_type]]["templates"])
    description = template.format(obj=obj.lower(), recep=parent.lower(), toggle=toggle.lower())
    return GameSpec(
        task_type=task_type,
        scene=number,
        object_target=obj,
        parent_target=parent,
        toggle_target=toggle,
        description=description,
        receptacles=room,
        objects=tuple(objects),
        lamps=lamps,
        start_pose=_start_pose(rng, room),
    )
