"""Parse gaps that verify-template found: Qwen3.5 / Nemotron 3 tool calls in the
`<function=NAME><parameter=K>V</parameter></function>` format round-trip through
render -> parse for every JSON type the template writes (trajectory/codec/xml_args.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fast.trajectory.renderer_families import BY_NAME
from trajectory.codec.renderers_codec import RenderersCodec
from trajectory.codec.xml_args import xml_value

XML_FAMILIES = ("qwen3.5", "nemotron-3-nano")
_PROPS = {"flag": {"type": "boolean"}, "when": {"type": ["string", "null"]}, "n": {"type": "integer"},
          "x": {"type": "number"}, "obj": {"type": "object"}, "items": {"type": "array"},
          "city": {"type": "string"}, "zip": {"type": "string"}, "either": {"anyOf": [{"type": "string"},
                                                                                     {"type": "boolean"}]}}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d",
                                           "parameters": {"type": "object", "properties": _PROPS}}}]
# the tool declared without properties: no schema for any value
BARE = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
# values the template writes unambiguously (or that the schema disambiguates)
ROUND_TRIP: dict[str, Any] = {
    "flag": True, "when": None, "n": -3, "x": 1.5, "obj": {"a": [1, True, None], "b": {"c": "d"}},
    "items": ["x", 2, False], "city": "Paris", "zip": "75001", "either": False,
}


def _call(args: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(args)}}]}


def _round_trip(codec: RenderersCodec, args: dict[str, Any], tools: Any) -> tuple[Any, dict[str, Any]]:
    parsed = codec.parse_assistant(codec.canonical_assistant_ids(_call(args)), tools=tools)
    assert len(parsed.tool_calls) == 1, (parsed.status, parsed.status_detail)
    return parsed.status, json.loads(parsed.tool_calls[0].arguments)


@pytest.mark.parametrize("name", XML_FAMILIES)
def test_xml_call_round_trips_json_types(load_renderer_tokenizer: Any, name: str) -> None:
    """true/false/null, numbers, nested objects, lists and strings come back as sent;
    before, `True`/`None` (Python's str() in the template) made the call invalid_json."""
    codec = RenderersCodec(load_renderer_tokenizer(name), BY_NAME[name].renderer)
    status, args = _round_trip(codec, ROUND_TRIP, TOOLS)
    assert status == "ok" and args == ROUND_TRIP
    # without a schema the JSON literals and plain strings still round-trip
    plain = {"flag": False, "when": None, "n": 3, "city": "Paris", "obj": {"k": [True]}}
    status, args = _round_trip(codec, plain, BARE)
    assert status == "ok" and args == plain


@pytest.mark.parametrize("name", XML_FAMILIES)
def test_xml_arguments_ambiguity(load_renderer_tokenizer: Any, name: str) -> None:
    """Irreducible: the template writes the string "75001" and the number 75001 alike
    (`| string`), and "True" like true: without a schema saying "string", the non-string
    wins; a declared string keeps the text."""
    codec = RenderersCodec(load_renderer_tokenizer(name), BY_NAME[name].renderer)
    looks = {"zip": "75001", "city": "True", "obj": '{"a": 1}'}
    _, undeclared = _round_trip(codec, looks, BARE)
    assert undeclared == {"zip": 75001, "city": True, "obj": {"a": 1}}
    declared = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "city": {"type": "string"}, "obj": {"type": "string"}}}}}]
    assert _round_trip(codec, looks, declared)[1] == looks


def test_xml_value_rules() -> None:
    """The inverse of the template's rule, and where a value cannot fit its schema."""
    assert xml_value("True", None) == (True, True)
    assert xml_value("None", {"type": ["string", "null"]}) == (None, True)
    assert xml_value("None", {"type": "string"}) == ("None", True)
    assert xml_value("True", {"type": "integer"}) == ("True", False)  # stays invalid_json
    assert xml_value("Paris", {"type": "integer"}) == ("Paris", False)
    assert xml_value("Paris", None) == ("Paris", True)
    assert xml_value("True", {"anyOf": [{"type": "string"}, {"type": "boolean"}]}) == (True, True)
