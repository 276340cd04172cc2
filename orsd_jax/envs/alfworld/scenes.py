"""Room compositions of the 120 AI2-THOR scenes, read from the tables the alfworld package ships.

``alfworld/gen/layouts/FloorPlan<n>-objects.json`` lists the object classes present in a scene and
``FloorPlan<n>-openable.json`` the receptacle instances ALFRED interacts with, keyed by their THOR
id (``Cabinet|+00.68|+00.50|-02.20``) with the agent pose used to reach them. Receptacle classes
that a scene lists but that have no pose there (garbage cans, toasters, ...) get one instance with
a pose derived from the scene and class, so every scene is a fixed, deterministic room.
Object properties and containment rules come from ``alfworld.gen.constants``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import random

from alfworld.gen import constants

# Classes that are receptacles in the PDDL sense (fixed furniture); the movable ones (bowl, mug,
# pan, ...) are objects that happen to hold things and are placed like any other object.
RECEPTACLE_CLASSES = frozenset(constants.VAL_RECEPTACLE_OBJECTS) - set(constants.MOVABLE_RECEPTACLES)
# Everything a receptacle can hold can be picked up; sliced pieces only exist after slicing.
PICKUPABLE_CLASSES = frozenset(
    obj for objs in constants.VAL_RECEPTACLE_OBJECTS.values() for obj in objs if not obj.endswith("Sliced")
)
LAMP_CLASSES = ("DeskLamp", "FloorLamp")
# Lamps are not pickupable and no canContain rule mentions them; THOR parents them to furniture.
LAMP_HOLDERS = {
    "DeskLamp": ("Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable", "DiningTable", "TVStand"),
    "FloorLamp": ("SideTable", "Dresser", "Desk", "Shelf", "ArmChair", "Sofa", "Bed", "CoffeeTable"),
}
OPENABLE_CLASSES = frozenset(constants.OPENABLE_CLASS_LIST)


@dataclasses.dataclass(frozen=True)
class Receptacle:
    thor_id: str  # e.g. "Sink|-01.90|+00.97|-01.50|SinkBasin"
    cls: str  # e.g. "SinkBasin"
    pose: tuple[int, int, int, int]  # grid x, grid z, rotation / 90, camera horizon


@dataclasses.dataclass(frozen=True)
class Scene:
    number: int
    room_type: str
    receptacles: tuple[Receptacle, ...]  # sorted by id
    object_classes: tuple[str, ...]  # pickupable classes present, sorted
    lamp_classes: tuple[str, ...]  # toggleable lamps present, sorted

    def receptacles_of(self, cls: str) -> tuple[Receptacle, ...]:
        return tuple(r for r in self.receptacles if r.cls == cls)

    @property
    def receptacle_classes(self) -> frozenset[str]:
        return frozenset(r.cls for r in self.receptacles)


def room_type(scene_number: int) -> str:
    for name, numbers in constants.SCENE_TYPE.items():
        if scene_number in numbers:
            return name
    raise ValueError(f"scene {scene_number} belongs to no room type")


def receptacle_class(thor_id: str) -> str:
    parts = thor_id.split("|")
    # Basins carry their own class after the sink's coordinates: "Sink|x|y|z|SinkBasin".
    return parts[-1] if len(parts) == 5 else parts[0]


def _pose(x: float, z: float, rotation: float, horizon: float) -> tuple[int, int, int, int]:
    step = constants.AGENT_STEP_SIZE
    return round(x / step), round(z / step), round(rotation / 90) % 4, round(horizon)


def _thor_coordinate(value: float) -> str:
    return f"{value:+06.2f}"


def _synthesised_receptacle(scene_number: int, cls: str) -> Receptacle:
    rng = random.Random(f"scene{scene_number}-{cls}")
    xyz = [rng.uniform(-3.0, 3.0), rng.uniform(0.0, 1.5), rng.uniform(-3.0, 3.0)]
    thor_id = "|".join([cls, *map(_thor_coordinate, xyz)])
    if cls in ("SinkBasin", "BathtubBasin"):
        thor_id = "|".join([cls[: -len("Basin")], *map(_thor_coordinate, xyz), cls])
    pose = _pose(xyz[0], xyz[2], rng.choice((0, 90, 180, 270)), rng.choice((0, 30, 60)))
    return Receptacle(thor_id, cls, pose)


def _distinct_poses(receptacles: list[Receptacle]) -> tuple[Receptacle, ...]:
    """One location per receptacle, so that "go to X" always means one receptacle: a pose
    shared with an earlier receptacle is nudged along the camera horizon."""
    used, out = set(), []
    for r in receptacles:
        x, z, rotation, horizon = r.pose
        while (x, z, rotation, horizon) in used:
            horizon += 1
        used.add((x, z, rotation, horizon))
        out.append(dataclasses.replace(r, pose=(x, z, rotation, horizon)))
    return tuple(out)


def _read_layout(scene_number: int, kind: str):
    path = importlib.resources.files("alfworld.gen") / "layouts" / f"FloorPlan{scene_number}-{kind}.json"
    return json.loads(path.read_text())


@functools.cache
def load_scene(scene_number: int) -> Scene:
    classes = set(_read_layout(scene_number, "objects"))
    receptacles = [
        Receptacle(thor_id, receptacle_class(thor_id), _pose(*pose))
        for thor_id, pose in _read_layout(scene_number, "openable").items()
        if receptacle_class(thor_id) in RECEPTACLE_CLASSES
    ]
    posed = {r.cls for r in receptacles}
    receptacles += [_synthesised_receptacle(scene_number, cls) for cls in sorted(classes & RECEPTACLE_CLASSES - posed)]
    return Scene(
        number=scene_number,
        room_type=room_type(scene_number),
        receptacles=_distinct_poses(sorted(receptacles, key=lambda r: r.thor_id)),
        object_classes=tuple(sorted(classes & PICKUPABLE_CLASSES)),
        lamp_classes=tuple(sorted(classes & set(LAMP_CLASSES))),
    )


def scene_numbers(unseen: bool) -> tuple[int, ...]:
    """ALFRED's own split of the scenes: 24 train and 6 test floor plans per room type."""
    return tuple(sorted(constants.TEST_SCENE_NUMBERS if unseen else constants.TRAIN_SCENE_NUMBERS))


def can_contain(receptacle_cls: str, object_cls: str) -> bool:
    return object_cls in constants.VAL_RECEPTACLE_OBJECTS.get(receptacle_cls, ())


def has_property(object_cls: str, prop: str) -> bool:
    """``prop`` is one of Heatable, Coolable, Cleanable, Toggleable, Sliceable."""
    return object_cls in constants.VAL_ACTION_OBJECTS[prop]
