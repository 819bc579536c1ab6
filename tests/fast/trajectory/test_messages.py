"""Tolerant message matching."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

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


def _call_raw(args: object) -> dict[str, object]:
    """A tool call whose arguments are an object, not JSON text (some clients send so)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]}


def _call(args: object) -> dict[str, object]:
    import json as _json

    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "f", "arguments": _json.dumps(args)}}]}


def test_true_one_and_one_point_zero_are_different_arguments() -> None:
    """Typed JSON equality: the template renders `true`, `1` and `1.0` differently."""
    values = [True, 1, 1.0, "1", None, [1], {"v": 1}]
    for i, a in enumerate(values):
        for j, b in enumerate(values):
            assert messages_equal(_call({"x": a}), _call({"x": b})) == (i == j), (a, b)
    # key order alone is tolerated
    assert messages_equal(_call({"a": 1, "b": [True]}), _call({"b": [True], "a": 1}))
    assert not messages_equal(_call({"a": [1, True]}), _call({"a": [True, 1]}))
    assert messages_equal(_call({"big": 2**70}), _call({"big": 2**70}))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 2, allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
    max_leaves=8,
)


@given(_json_values, _json_values)
def test_messages_equal_is_typed_json_equality(a: object, b: object) -> None:
    import orjson

    same = orjson.dumps(a, option=orjson.OPT_SORT_KEYS) == orjson.dumps(b, option=orjson.OPT_SORT_KEYS)
    assert messages_equal(_call({"x": a}), _call({"x": b})) == same


def test_inlined_reasoning_recognised_only_when_the_rest_is_ours() -> None:
    from trajectory.messages import inlined_reasoning

    ours = {"role": "assistant", "content": "Done.", "reasoning_content": "Think.", "tool_calls": [CALL]}
    sent = {"role": "assistant", "content": "<think>\nThink.\n</think>\n\nDone.",
            "tool_calls": [{**CALL, "id": "client_1"}]}
    assert not messages_equal(ours, sent) and inlined_reasoning(ours, sent)
    assert not inlined_reasoning(ours, {**sent, "content": "<think>Think.</think>Other."})
    assert not inlined_reasoning(ours, {**sent, "tool_calls": []})
    assert not inlined_reasoning(ours, {**sent, "content": "Done."})  # nothing inlined
    assert not inlined_reasoning({**ours, "role": "user"}, sent)


_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"])},
    optional={"refusal": st.none() | st.text(max_size=1), "content": _json_values | st.just(-0.0) | st.just(0.0), "name": st.text(max_size=2),
              "reasoning_content": st.none() | st.text(max_size=2), "tool_call_id": st.none() | st.text(max_size=1),
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"id": st.none() | st.text(max_size=1),
                   "function": st.fixed_dictionaries({"name": st.text(max_size=1), "arguments": _json_values})}),
                  max_size=2)},
)


_TWEAKS = ("drop_reasoning", "empty_reasoning", "content_none", "content_empty", "no_calls", "empty_calls",
           "refusal", "none_id", "deep_copy")


def _tweaked(a: dict, tweaks: list[str]) -> dict:
    """A copy of `a` as a client might send it back: what the comparison tolerates, and
    some of what it does not (a None call id, an emptied content)."""
    import copy as _copy

    b = _copy.deepcopy(a)
    for t in tweaks:
        if t == "drop_reasoning":
            b.pop("reasoning_content", None)
        elif t == "empty_reasoning":
            b["reasoning_content"] = ""
        elif t in ("content_none", "content_empty"):
            b["content"] = None if t == "content_none" else ""
        elif t in ("no_calls", "empty_calls"):
            b["tool_calls"] = None if t == "no_calls" else []
        elif t == "refusal":
            b["refusal"] = None
        elif t == "none_id":
            b["tool_call_id"] = None
    return b


@given(_messages, st.lists(st.sampled_from(_TWEAKS), max_size=3))
def test_the_quick_check_agrees_on_messages_sent_back(a: dict, tweaks: list[str]) -> None:
    import copy as _copy
    from unittest import mock

    from trajectory import messages as m

    b = _tweaked(a, tweaks)
    fast = (m.messages_equal(a, b), m.match_returned(_copy.deepcopy(a), _copy.deepcopy(b)),
            m.messages_equal(b, a))
    with mock.patch.object(m, "_identical_fields", lambda x, y: False):
        slow = (m.messages_equal(a, b), m.match_returned(_copy.deepcopy(a), _copy.deepcopy(b)),
                m.messages_equal(b, a))
    assert fast == slow


@given(_messages, _messages, st.booleans())
@example({"role": "user", "content": 0.0}, {"role": "user", "content": -0.0}, False)
@example({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"x": [0.0]}}}]},
         {"role": "assistant", "tool_calls": [{"id": "b", "function": {"name": "f", "arguments": {"x": [-0.0]}}}]}, False)
def test_the_quick_identity_check_never_changes_a_comparison(a: dict, b: dict, copy: bool) -> None:
    """`messages_equal` / `match_returned` answer as the tolerant comparison alone does,
    for equal messages (a deep copy, the usual case) and for any two."""
    import copy as _copy
    from unittest import mock

    from trajectory import messages as m

    if copy:
        b = _copy.deepcopy(a)
    fast = (m.messages_equal(a, b), m.match_returned(_copy.deepcopy(a), _copy.deepcopy(b)))
    with mock.patch.object(m, "_identical_fields", lambda x, y: False):
        slow = (m.messages_equal(a, b), m.match_returned(_copy.deepcopy(a), _copy.deepcopy(b)))
    assert fast == slow


def _deep(d: int) -> object:
    value: object = 1
    for _ in range(d):
        value = {"a": value}
    return value


@pytest.mark.parametrize("a, b", [
    # nested far past the recursion a Python walk could take (a client may send this)
    (_call_raw(_deep(900)), _call_raw(_deep(900))),
    # keys JSON cannot tell apart as typed values, and keys it cannot sort
    (_call_raw({1: "y"}), _call_raw({True: "y"})),
    (_call_raw({1: "y", "a": 1}), _call_raw({1: "y", "a": 1})),
    # tool calls that are not objects (validation refuses them over HTTP)
    ({"role": "assistant", "tool_calls": ["x"]}, {"role": "assistant", "tool_calls": ["x"]}),
])
def test_the_quick_check_answers_or_raises_as_the_tolerant_comparison(a: dict, b: dict) -> None:
    import copy as _copy
    from unittest import mock

    from trajectory import messages as m

    def outcome(fn: object) -> object:
        try:
            return fn()  # type: ignore[operator]
        except Exception as exc:
            return type(exc)

    calls = (lambda: m.messages_equal(a, b), lambda: m.match_returned(_copy.deepcopy(a), _copy.deepcopy(b)))
    fast = [outcome(c) for c in calls]
    with mock.patch.object(m, "_identical_fields", lambda x, y: False):
        slow = [outcome(c) for c in calls]
    assert fast == slow
