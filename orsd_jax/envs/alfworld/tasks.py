"""The six ALFWorld task types: official names, short names and the columns papers report."""

from __future__ import annotations

from alfworld.agents.environment.alfred_tw_env import TASK_TYPES as OFFICIAL_TASK_IDS  # 1..6 -> name

SHORT_NAMES = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick2",
}
OFFICIAL_NAMES = {short: official for official, short in SHORT_NAMES.items()}
TASK_TYPES = tuple(SHORT_NAMES[OFFICIAL_TASK_IDS[i]] for i in sorted(OFFICIAL_TASK_IDS))
# Column labels in the order the literature reports them.
COLUMNS = {"pick": "Pick", "look": "Look", "clean": "Clean", "heat": "Heat", "cool": "Cool", "pick2": "Pick2"}
