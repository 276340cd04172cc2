"""The shared answer parser on malformed model outputs: it classifies, and never raises."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orsd_jax.envs import parse_action

ADMISSIBLE = ["go to desk 1", "take pen 1 from desk 1", "look"]


def test_well_formed_answer_is_valid():
    parsed = parse_action("<think>The pen is on the desk.</think>\n<action>go to desk 1</action>", ADMISSIBLE)
    assert (parsed.action, parsed.valid_format, parsed.admissible, parsed.valid, parsed.reason) == (
        "go to desk 1",
        True,
        True,
        True,
        "",
    )


@pytest.mark.parametrize(
    "response",
    [
        "",
        "   \n ",
        "go to desk 1",
        "<think>hmm</think>",
        "<think>hmm</think><action>go to desk 1",
        "<think>hmm</think>go to desk 1</action>",
        "<think>hmm</think></action>go to desk 1<action>",
    ],
)
def test_missing_action_tags_give_no_action(response):
    parsed = parse_action(response, ADMISSIBLE)
    assert parsed.action is None and not parsed.valid_format and not parsed.valid and parsed.reason


@pytest.mark.parametrize("response", ["<think>x</think><action></action>", "<think>x</think><action> \t\n </action>"])
def test_empty_action_is_invalid(response):
    parsed = parse_action(response, ADMISSIBLE)
    assert parsed.action is None and not parsed.valid and "empty" in parsed.reason


def test_nested_action_tags_are_invalid():
    parsed = parse_action("<think>x</think><action><action>look</action></action>", ADMISSIBLE)
    assert parsed.action is None and not parsed.valid and "nested" in parsed.reason


def test_first_of_several_actions_counts():
    parsed = parse_action("<think>x</think><action>look</action> then <action>go to desk 1</action>", ADMISSIBLE)
    assert parsed.action == "look" and parsed.valid


def test_missing_think_keeps_the_action_but_breaks_the_format():
    parsed = parse_action("<action>look</action>", ADMISSIBLE)
    assert parsed.action == "look" and parsed.admissible and not parsed.valid_format and not parsed.valid
    assert "think" in parsed.reason


def test_case_quotes_and_spacing_are_normalised():
    parsed = parse_action("<THINK>x</THINK><Action> 'Take  Pen 1\nfrom desk 1' </Action>", ADMISSIBLE)
    assert parsed.action == "take pen 1 from desk 1" and parsed.valid


def test_inadmissible_command_is_well_formed_but_not_valid():
    parsed = parse_action("<think>x</think><action>fly to the moon</action>", ADMISSIBLE)
    assert parsed.action == "fly to the moon" and parsed.valid_format and not parsed.admissible
    assert not parsed.valid and "admissible" in parsed.reason


# The last one spells "go" with a Cyrillic o.
@pytest.mark.parametrize("text", ["régler le bureau 1", "go to desk 1 🙂", "gо to desk 1"])
def test_non_ascii_actions_do_not_match(text):
    parsed = parse_action(f"<think>x</think><action>{text}</action>", ADMISSIBLE)
    assert parsed.action == text.lower() and parsed.valid_format and not parsed.admissible


def test_cjk_text_breaks_the_format():
    parsed = parse_action("<think>我想去桌子</think><action>go to desk 1</action>", ADMISSIBLE)
    assert parsed.action == "go to desk 1" and parsed.admissible and not parsed.valid_format


@pytest.mark.parametrize("response", [None, 42, b"<action>look</action>", ["<action>look</action>"]])
def test_non_text_responses_are_invalid(response):
    parsed = parse_action(response, ADMISSIBLE)
    assert parsed.action is None and not parsed.valid


_pieces = st.sampled_from(["<action>", "</action>", "<think>", "</think>", "look", "go to desk 1", " ", "\n", "'"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_pieces, st.text(max_size=8)), max_size=12).map("".join))
def test_never_raises_and_stays_consistent(response):
    parsed = parse_action(response, ADMISSIBLE)
    assert parsed.valid == (parsed.valid_format and parsed.admissible)
    assert parsed.action is not None or not parsed.valid_format
    assert (parsed.reason == "") == parsed.valid
    if parsed.valid:
        assert parsed.action in ADMISSIBLE
