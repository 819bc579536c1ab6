"""GLM-4.5/4.6 XML tool calls stream while sampled. For random calls rendered
by the GLM template (arguments of every JSON kind and raw strings, values that look like
JSON prefixes, unicode, `<`), fed in arbitrary chunkings of their ids: every streamed name
and arguments text is a prefix of `parse_glm`'s, and at the end equal to it; a raw-string
value streams in pieces; shapes parse_glm rejects (or reads differently) stop the stream."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from session_server.turn.incremental import (
    FieldSplitter,
    IncrementalDecoder,
    IncrementalText,
    calls_for,
    markup_for,
)
from session_server.turn.incremental_calls import CallArgs, CallStart
from session_server.turn.incremental_glm import GlmCalls
from trajectory.codec import load_codec
from trajectory.codec.parsing import parse_glm, tool_names

NAMES = ("read", "edit", "write_file")
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]
_MARKERS = ("<tool_call>", "</tool_call>", "</arg_value>", "<arg_value>", "</arg_key>", "<arg_key>", "<|", "think>")
_PIECES = st.sampled_from(list("abtrufalsenNIy0129-+.eE{}[]\",: \n\t\\/<>é日🙂") + ["</arg_val", "<tool_", "</tool"])
_LOOKALIKES = ["true", "tru", "truex", "null", "nul", "false ", "NaN", "Infinity", "-Infinity", "-I", "-", "1e",
               "12abc", "01", "1.5 ", " 7", "\t\"a\"\n", '"x"', '"x" y', '"unterminated', "[1,", "[1, 2]", "{}",
               '{"a": 1, "a": 2}', '{"a": [true, null]} tail', "", " ", "a<b", "x </arg_val y", "\\u00e9"]


def _text(max_size: int) -> st.SearchStrategy[str]:
    return st.lists(_PIECES, max_size=max_size).map("".join)


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | _text(12)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        _text(6), inner, max_size=3), max_leaves=8)


def _clean(value: Any) -> bool:
    """A value whose rendered text parse_glm can read back (no markup inside it)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return not any(m in text for m in _MARKERS)


_VALUES = st.one_of(st.sampled_from(_LOOKALIKES), _text(40), _json_values()).filter(_clean)
_KEYS = st.text(st.sampled_from(list("abkey_ 1é日-")), min_size=1, max_size=8).map(str.strip).filter(bool)
_CALLS = st.lists(st.tuples(st.sampled_from(NAMES), st.dictionaries(_KEYS, _VALUES, max_size=5)), min_size=1,
                  max_size=3)


def _feed(codec: Any, ids: list[int], cuts: list[int], final: list[tuple[str, str]]) -> tuple[dict[int, list[str]], int]:
    """Stream `ids` split at `cuts`; after every chunk each streamed call must be a prefix
    of `final`'s. (the streamed calls, how many argument pieces came)."""
    markup = markup_for(codec, tools=True, template_kwargs=None)
    assert markup is not None and markup.glm
    reader = calls_for(markup, tool_names(TOOLS))
    assert isinstance(reader, GlmCalls)
    inc = IncrementalText(IncrementalDecoder(codec.tokenizer, codec.stop_token_ids), FieldSplitter(markup), reader)
    calls: dict[int, list[str]] = {}
    pieces = 0
    bounds = [0, *sorted({c % (len(ids) + 1) for c in cuts}), len(ids)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        for piece in inc.feed(ids[a:b]):
            if isinstance(piece, CallStart):
                assert piece.index == len(calls)
                calls[piece.index] = [piece.name, ""]
            elif isinstance(piece, CallArgs):
                calls[piece.index][1] += piece.text
                pieces += 1
        for i, (name, args) in calls.items():
            assert i < len(final) and name == final[i][0] and final[i][1].startswith(args), (calls, final)
    return calls, pieces


def _render(codec: Any, content: str, calls: list[tuple[str, dict[str, Any]]]) -> list[int]:
    message = {"role": "assistant", "content": content, "reasoning_content": "plan",
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    return [int(t) for t in codec.canonical_assistant_ids(message)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(calls=_CALLS, content=st.sampled_from(["", "Writing it.", "x <b> y"]),
       cuts=st.lists(st.integers(0, 10**4), max_size=80))
def test_glm_tool_args_streamed_calls_equal_parse_glm(load_tokenizer: Any, calls: list[tuple[str, dict[str, Any]]],
                                                         content: str, cuts: list[int]) -> None:
    codec = load_codec(load_tokenizer("glm4moe"))
    ids = _render(codec, content, calls)
    parsed = codec.parse_assistant(ids, tools=TOOLS, template_kwargs=None)
    assume(len(parsed.tool_calls) == len(calls))  # the render reads back (keys, values without markup)
    final = [(c.name, c.arguments) for c in parsed.tool_calls]
    streamed, _ = _feed(codec, ids, cuts, final)
    assert [(n, a) for n, a in (streamed[i] for i in range(len(streamed)))] == final


def test_glm_tool_args_a_raw_string_streams_in_pieces(load_tokenizer: Any) -> None:
    codec = load_codec(load_tokenizer("glm4moe"))
    args = {"path": "src/app.py", "text": "print('hello')\n" * 40 + "done", "n": 3, "flag": "true"}
    ids = _render(codec, "Writing it.", [("write_file", args)])
    parsed = codec.parse_assistant(ids, tools=TOOLS, template_kwargs=None)
    final = [(c.name, c.arguments) for c in parsed.tool_calls]
    streamed, pieces = _feed(codec, ids, list(range(1, len(ids))), final)
    assert streamed[0] == ["write_file", json.dumps({**args, "flag": True}, ensure_ascii=False)]
    assert pieces > 20  # the long text value came token by token, not whole at its end


def _read(text: str) -> tuple[GlmCalls, dict[int, list[str]]]:
    reader, calls = GlmCalls(frozenset(NAMES)), {}
    for ch in text:  # one character at a time: every marker split
        for piece in reader.feed(ch):
            if isinstance(piece, CallStart):
                calls[piece.index] = [piece.name, ""]
            else:
                calls[piece.index][1] += piece.text
    return reader, calls


def _call(name: str, *pairs: tuple[str, str]) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                           for k, v in pairs) + "</tool_call>"


@pytest.mark.parametrize("text", [
    _call("nope", ("a", "1")),  # not an offered tool
    "<tool_call>read\nmore\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # a newline in the name
    "<tool_call>re<ad<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # `<` in the name
])
def test_glm_tool_args_rejected_names_do_not_start(text: str) -> None:
    reader, calls = _read(text)
    assert not calls and reader.stopped
    assert parse_glm(text, None, frozenset(NAMES)).tool_calls == []


@pytest.mark.parametrize("text,committed", [
    # a duplicate key: json keeps the last value at the first place; the stream stops before it
    (_call("read", ("a", "x"), ("b", "2"), ("a", "y")), True),
    # text after the calls: parse_glm fails the whole message
    (_call("read", ("a", "x")) + " trailing", False),
    # a call nested in a value, and a key that does not reach `<arg_value>`
    (_call("read", ("a", "x <tool_call> y")), False),
    ("<tool_call>read\n<arg_key>a</arg_key> junk <arg_value>1</arg_value></tool_call>", False),
])
def test_glm_tool_args_divergent_shapes_stop_the_stream(text: str, committed: bool) -> None:
    reader, calls = _read(text)
    parsed = parse_glm(text, None, frozenset(NAMES))
    assert reader.stopped and bool(parsed.tool_calls) == committed
    if committed:  # what streamed before the stop differs from the parse: live.py counts the divergence
        assert calls[0][1] == '{"a": "x", "b": 2' and parsed.tool_calls[0].arguments == '{"a": "y", "b": 2}'


def test_glm_tool_args_calls_after_content_and_without_arguments() -> None:
    text = "\nI will read it.\n" + _call("read", ("path", "a.py"), ("n", " 5 ")) + "\n<tool_call>edit\n</tool_call>\n"
    reader, calls = _read(text)
    parsed = parse_glm(text, None, frozenset(NAMES))
    assert not reader.stopped and parsed.content == "I will read it."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [tuple(calls[0]), tuple(calls[1])] == [
        ("read", '{"path": "a.py", "n": 5}'), ("edit", "{}")]
