"""Tolerant message matching (DESIGN.md s5)."""

from __future__ import annotations

from trajectory.messages import flatten_content, messages_equal, normalize_message

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "f", "arguments": '{"a": 1, "b": [1, 2]}'},
}


def test_content_parts_flattened() -> None:
    a = {
        "role": "user",
        "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
    }
    assert messages_equal(a, {"role": "user", "content": "hi there"})
    assert flatten_content(None) == ""


def test_arguments_compared_as_json() -> None:
    b = {**CALL, "function": {"name": "f", "arguments": '{"b":[1,2],"a":1}'}}
    assert messages_equal(
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "assistant", "content": "", "tool_calls": [b]},
    )
    c = {**CALL, "function": {"name": "f", "arguments": '{"a": 2, "b": [1, 2]}'}}
    assert not messages_equal(
        {"role": "assistant", "tool_calls": [CALL]}, {"role": "assistant", "tool_calls": [c]}
    )


def test_tool_call_id_and_role_matter() -> None:
    other = {**CALL, "id": "call_2"}
    assert not messages_equal(
        {"role": "assistant", "tool_calls": [CALL]}, {"role": "assistant", "tool_calls": [other]}
    )
    assert not messages_equal(
        {"role": "tool", "tool_call_id": "a", "content": "x"},
        {"role": "tool", "tool_call_id": "b", "content": "x"},
    )
    assert not messages_equal({"role": "user", "content": "x"}, {"role": "system", "content": "x"})


def test_reasoning_tolerated_when_dropped_or_echoed() -> None:
    ours = {"role": "assistant", "content": "A", "reasoning_content": "R"}
    assert messages_equal(ours, {"role": "assistant", "content": "A"})
    assert messages_equal(ours, dict(ours))
    assert not messages_equal(ours, {**ours, "reasoning_content": "other"})


def test_malformed_arguments_stay_strings() -> None:
    bad = {**CALL, "function": {"name": "f", "arguments": "{not json"}}
    assert (
        normalize_message({"role": "assistant", "tool_calls": [bad]})["tool_calls"][0]["arguments"]
        == "{not json"
    )
    assert messages_equal(
        {"role": "assistant", "tool_calls": [bad]}, {"role": "assistant", "tool_calls": [bad]}
    )
