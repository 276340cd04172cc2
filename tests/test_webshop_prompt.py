"""The WebShop user message: fields, order, observation quoting, history and the length fallback."""

from orsd_jax.envs.actions import parse_action
from orsd_jax.envs.webshop.prompts import MAX_PROMPT_CHARS, build_prompt, format_observation

TASK = "Find me a red mug, and price lower than 20.00 dollars"
START = f"WebShop [SEP] Instruction: [SEP] {TASK} [SEP] Search"
RESULTS = (
    f"Instruction: [SEP] {TASK} [SEP] Back to Search [SEP] Page 1 (Total results: 2) [SEP] Next > [SEP] "
    "B01 [SEP] Red Mug [SEP] $9.99"
)
ITEM = f"Instruction: [SEP] {TASK} [SEP] Back to Search [SEP] < Prev [SEP] Red Mug [SEP] Price: $9.99"
ACTIONS = ("click[back to search]", "click[next >]", "click[b01]")


def test_observation_is_cut_after_the_instruction_and_quoted():
    assert format_observation(START, TASK) == "'Search'"
    assert format_observation(RESULTS, TASK) == (
        "'Back to Search' [SEP] 'Page 1 (Total results: 2)' [SEP] 'Next >' [SEP] 'B01' [SEP] 'Red Mug' [SEP] '$9.99'"
    )
    done = "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 1.0"
    assert format_observation(done, TASK) == done


def test_first_step_has_no_history():
    prompt = build_prompt(TASK, START, ("search[<your query>]", "click[search]"), [], 0)
    assert f"{TASK}." in prompt and "'Search'." in prompt
    assert "[\n'search[<your query>]',\n'click[search]',\n]." in prompt
    assert "step(s)" not in prompt and "Observation" not in prompt and "This is step" not in prompt
    assert "<think> </think>" in prompt and "<action> </action>" in prompt
    assert prompt.index(TASK) < prompt.index("'Search'") < prompt.index("click[search]") < prompt.index("<think>")


def test_history_keeps_the_last_steps_numbered():
    history = [(START, "search[red mug]"), (RESULTS, "click[b01]"), (ITEM, "click[< prev]")]
    prompt = build_prompt(TASK, RESULTS, ACTIONS, history, step_count=3)
    assert "3 step(s)" in prompt and "last 2 pages" in prompt and "step 4." in prompt
    assert "Observation 1" not in prompt and "search[red mug]" not in prompt
    assert (
        f"[Observation 2: '{format_observation(RESULTS, TASK)}', Action 2: 'click[b01]']\n"
        f"[Observation 3: '{format_observation(ITEM, TASK)}', Action 3: 'click[< prev]']"
    ) in prompt
    order = [prompt.index(s) for s in (TASK, "Observation 2", "Observation 3", "step 4.", "'click[b01]',", "<think>")]
    assert order == sorted(order)
    assert build_prompt(TASK, RESULTS, ACTIONS, history, 3) == prompt  # a pure function
    assert "Observation 3" not in build_prompt(TASK, RESULTS, ACTIONS, history, 3, history_length=0)


def test_long_history_falls_back_to_the_prompt_without_history():
    long_page = f"Instruction: [SEP] {TASK} [SEP] " + " [SEP] ".join(["x" * 100] * 80)
    history = [(long_page, "click[next >]"), (long_page, "click[next >]")]
    prompt = build_prompt(TASK, RESULTS, ACTIONS, history, step_count=2)
    assert prompt == build_prompt(TASK, RESULTS, ACTIONS, [], step_count=0)
    assert len(build_prompt(TASK, RESULTS, ACTIONS, history[:1], step_count=1)) < MAX_PROMPT_CHARS


def test_a_well_formed_answer_parses_with_the_shared_parser():
    answer = "<think>The first result is the mug.</think><action>click[b01]</action>"
    parsed = parse_action(answer, ACTIONS)
    assert parsed.valid and parsed.action == "click[b01]"
