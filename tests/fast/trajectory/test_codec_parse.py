"""parse_assistant per family: reasoning, content, tool calls, malformed markup."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajectory.codec import ToolCallParseStatus, load_codec

CALL_ID = re.compile(r"^call_[0-9a-f]+$")


def enc(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _call(name: str, args: dict) -> dict:
    return {"id": "x", "type": "function", "function": {"name": name, "arguments": args}}


def tools(*names: str) -> list[dict]:
    """The request's `tools`: calls are parsed only when sent, only to these names."""
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


def round_trip(load_tokenizer: Any, family: str, msg: dict) -> Any:
    """Parse the canonical ids of `msg` (what a model would sample), offering its tools."""
    codec = load_codec(load_tokenizer(family))
    names = [tc["function"]["name"] for tc in msg.get("tool_calls") or []]
    return codec.parse_assistant(codec.canonical_assistant_ids(msg), tools=tools(*names))


@pytest.mark.parametrize("family", ["qwen3", "glm4moe"])
def test_reasoning_content_and_calls(load_tokenizer: Any, family: str) -> None:
    msg = {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "Need weather.",
        "tool_calls": [
            _call("get_weather", {"city": "Paris", "days": 3, "hot": True}),
            _call("search", {"q": "news"}),
        ],
    }
    p = round_trip(load_tokenizer, family, msg)
    assert p.status == ToolCallParseStatus.OK
    assert p.reasoning_content == "Need weather."
    assert p.content == "Let me look."
    assert [c.name for c in p.tool_calls] == ["get_weather", "search"]
    assert json.loads(p.tool_calls[0].arguments) == {"city": "Paris", "days": 3, "hot": True}
    assert all(CALL_ID.match(c.id) for c in p.tool_calls)
    assert len({c.id for c in p.tool_calls}) == 2
    out = p.to_message()
    assert out["tool_calls"][1]["function"]["name"] == "search"


@pytest.mark.parametrize("family", ["qwen3", "llama3", "llama3.1", "glm4moe"])
def test_plain_content(load_tokenizer: Any, family: str) -> None:
    p = round_trip(load_tokenizer, family, {"role": "assistant", "content": "It is sunny."})
    assert p.status == ToolCallParseStatus.OK and p.tool_calls == []
    assert p.content == "It is sunny."


def test_qwen3_missing_open_think_tag(load_tokenizer: Any) -> None:
    tok = load_tokenizer("qwen3")
    p = load_codec(tok).parse_assistant(enc(tok, "thinking here\n</think>\n\nAnswer.<|im_end|>"))
    assert p.reasoning_content == "thinking here" and p.content == "Answer."


def test_glm_missing_open_think_tag_and_typed_values(load_tokenizer: Any) -> None:
    tok = load_tokenizer("glm4moe")
    text = (
        "hmm</think>\n<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>\n"
        "<arg_key>s</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>l</arg_key>\n"
        "<arg_value>[1, 2]</arg_value>\n</tool_call><|observation|>"
    )
    p = load_codec(tok).parse_assistant(enc(tok, text), tools=tools("f"))
    assert p.status == ToolCallParseStatus.OK and p.reasoning_content == "hmm"
    assert json.loads(p.tool_calls[0].arguments) == {"n": 5, "s": "Paris", "l": [1, 2]}
    assert p.content is None


def test_llama31_single_json_call(load_tokenizer: Any) -> None:
    msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("get_weather", {"city": "Paris", "n": 2})],
    }
    p = round_trip(load_tokenizer, "llama3.1", msg)
    assert p.status == ToolCallParseStatus.OK and p.content is None
    assert p.tool_calls[0].name == "get_weather"
    assert json.loads(p.tool_calls[0].arguments) == {"city": "Paris", "n": 2}


def test_llama3_plain_keeps_json_as_content(load_tokenizer: Any) -> None:
    tok = load_tokenizer("llama3")
    text = '{"name": "f", "parameters": {}}'
    p = load_codec(tok).parse_assistant(enc(tok, text + "<|eot_id|>"), tools=tools("f"))
    assert p.content == text and p.tool_calls == []


@pytest.mark.parametrize(
    ("family", "text", "status"),
    [
        (
            "qwen3",
            '<tool_call>\n{"name": "f", "arguments": {bad}\n</tool_call><|im_end|>',
            ToolCallParseStatus.INVALID_JSON,
        ),
        (
            "qwen3",
            '<tool_call>\n{"name": "f", "arguments": {}}',
            ToolCallParseStatus.INVALID_FORMAT,
        ),
        (
            "qwen3",
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            ToolCallParseStatus.INVALID_FORMAT,
        ),
        ("llama3.1", '{"name": "f", "parameters": {"a": }', ToolCallParseStatus.INVALID_JSON),
        (  # arguments under another key: not a call of no arguments (they would be lost)
            "qwen3",
            '<tool_call>\n{"name": "f", "args": {"a": 1}}\n</tool_call>',
            ToolCallParseStatus.INVALID_FORMAT,
        ),
        (
            "glm4moe",
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1",
            ToolCallParseStatus.INVALID_FORMAT,
        ),
        (
            "glm4moe",
            "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            ToolCallParseStatus.INVALID_FORMAT,
        ),
    ],
)
def test_malformed_calls_are_flagged_not_raised(
    load_tokenizer: Any, family: str, text: str, status: Any
) -> None:
    tok = load_tokenizer(family)
    p = load_codec(tok).parse_assistant(enc(tok, text), tools=tools("f"))
    assert p.status == status and p.tool_calls == []
    assert p.content is not None and p.content.strip() != ""
    assert p.status_detail


def test_a_call_without_arguments_has_empty_arguments(load_tokenizer: Any) -> None:
    tok = load_tokenizer("qwen3")
    p = load_codec(tok).parse_assistant(
        enc(tok, '<tool_call>\n{"name": "f"}\n</tool_call>'), tools=tools("f"))
    assert p.status == ToolCallParseStatus.OK
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [("f", {})]


@pytest.mark.parametrize("family", ["qwen3", "llama3", "llama3.1", "glm4moe"])
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_parse_never_raises(load_tokenizer: Any, family: str, data: Any) -> None:
    tok = load_tokenizer(family)
    codec = load_codec(tok)
    specials = sorted(tok.added_tokens_decoder)
    ids = data.draw(
        st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(specials)), max_size=40)
    )
    p = codec.parse_assistant(ids, tools=tools("f", "get_weather"))
    assert p.status in ToolCallParseStatus
    for c in p.tool_calls:
        assert CALL_ID.match(c.id)
        json.loads(c.arguments)
