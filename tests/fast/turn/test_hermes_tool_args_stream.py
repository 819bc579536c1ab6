"""Hermes tool calls (Qwen3) stream while sampled: for every split of a real
codec output's ids, each call's streamed arguments are the committed (canonical) ones
when the call parses, a call starts only once its name is offered and its arguments
object opened, and a shape the streamer does not vouch for is held back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_server.turn.incremental import (
    FieldSplitter,
    HermesCalls,
    IncrementalDecoder,
    IncrementalText,
    markup_for,
)
from session_server.turn.incremental_calls import CallArgs, CallStart
from trajectory.codec import load_codec
from trajectory.codec.parsing import tool_names

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("read", "edit")]


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


GOOD = [
    "<think>\nplan\n</think>\n\nReading.\n\n" + _call("read", '{"path":"\\u00e9/ß", "n": 1e5, "neg": -0}'),
    _call("read", '{"path": "a"}') + "\n" + _call("edit", '{"diff": "line1\\nline2 🙂", "ok": [true, null, 1.50]}'),
    "<think>\nx\n</think>\n\n" + _call("edit", "{}"),
]
HELD = [  # parse fine (or not) but are not streamed: the end-of-turn path sends them
    '<tool_call>\n{"arguments": {"a": 1}, "name": "read"}\n</tool_call>',
    '<tool_call>\n{"name": "read", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
    _call("nope", '{"a": 1}'),
]
BROKEN = [
    _call("read", '{"a": 1, "a": 2}'),
    '<tool_call>\n{"name": "read", "arguments": {"path": "trunc',
    _call("read", '{"a": [1 2]}'),
]


def _kw(text: str) -> dict[str, Any] | None:
    """Thinking on waits for a `</think>` that a text without `<think>` may still write."""
    return None if text.startswith("<think>") else {"enable_thinking": False}


def _run(codec: Any, text: str, cuts: list[int], kw: Any = None) -> tuple[dict[str, Any], dict[int, list[str]], Any]:
    tools = TOOLS
    ids = [int(t) for t in codec.tokenizer.encode(text, add_special_tokens=False)]
    markup = markup_for(codec, tools=True, template_kwargs=kw)
    assert markup is not None and markup.hermes
    inc = IncrementalText(IncrementalDecoder(codec.tokenizer, codec.stop_token_ids), FieldSplitter(markup),
                          HermesCalls(tool_names(tools)))
    fields = {"reasoning_content": "", "content": ""}
    calls: dict[int, list[str]] = {}
    bounds = [0, *sorted({c % (len(ids) + 1) for c in cuts}), len(ids)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        for piece in inc.feed(ids[a:b]):
            if isinstance(piece, CallStart):
                assert piece.index == len(calls)
                calls[piece.index] = [piece.name, ""]
            elif isinstance(piece, CallArgs):
                calls[piece.index][1] += piece.text
            else:
                fields[piece[0]] += piece[1]
    final = codec.parse_assistant(ids, tools=tools, template_kwargs=kw).to_message()
    return fields, calls, final


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tool_args_streamed_calls_equal_the_parsed_calls(load_tokenizer: Any, data: st.DataObject) -> None:
    codec = load_codec(load_tokenizer("qwen3"))
    text = data.draw(st.sampled_from(GOOD))
    cuts = data.draw(st.lists(st.integers(0, 10**4), max_size=60))
    fields, calls, final = _run(codec, text, cuts, _kw(text))
    want = final["tool_calls"]
    assert [c["function"]["name"] for c in want] == [calls[i][0] for i in range(len(calls))]
    assert [c["function"]["arguments"] for c in want] == [calls[i][1] for i in range(len(calls))]
    assert fields["content"] == (final["content"] or "")  # nothing of the content waits for the end
    assert fields["reasoning_content"] == (final.get("reasoning_content") or "")


@pytest.mark.parametrize("text", HELD + BROKEN)
def test_tool_args_unvouched_shapes_are_held_back(load_tokenizer: Any, text: str) -> None:
    codec = load_codec(load_tokenizer("qwen3"))
    _, calls, final = _run(codec, text, list(range(1, 400)), _kw(text))
    committed = final.get("tool_calls") or []
    for i, (name, args) in calls.items():  # what streamed is a prefix of the call, or the call failed
        if i < len(committed) and committed[i]["function"]["name"] == name:
            if not committed[i]["function"]["arguments"].startswith(args):
                assert text in BROKEN
        else:
            assert text in BROKEN
    if text in HELD:
        assert not calls


def test_tool_args_arrive_in_several_pieces(load_tokenizer: Any) -> None:
    codec = load_codec(load_tokenizer("qwen3"))
    long = json.dumps({"content": "word " * 200, "path": "src/app.py"})
    _, calls, final = _run(codec, _call("edit", long), list(range(1, 2000)), _kw(long))
    assert calls[0][1] == final["tool_calls"][0]["function"]["arguments"] == json.dumps(json.loads(long),
                                                                                      ensure_ascii=False)
