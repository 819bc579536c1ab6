"""Kimi K2 / K2-Instruct / K2-Thinking: our KimiCodec (trajectory/codec/kimi.py).

Tokenizers: tests/fast/trajectory/renderer_families.py. `kimi-k2` is the moonshotai K2
template; `kimi-k2-instruct` / `kimi-k2-thinking` are llama.cpp's copies (tool-call ids
computed with `list.append`); the `-ids` variants take the ids from the messages, as the
model repository's templates do.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fast.trajectory.test_codec_contract import conversations, play
from trajectory.codec import (
    BridgeRefusal,
    BridgeResult,
    HistoryPolicy,
    KimiCodec,
    RefusalReason,
    ToolCallParseStatus,
    detect_family,
    load_codec,
)
from trajectory.codec.kimi import parse_kimi
from trajectory.codec.probe import render_text
from trajectory.codec.verify import TOOLS as TWO_TOOLS
from trajectory.codec.verify import verify_template
from trajectory.errors import TemplateNotSupported

SERVED = ["kimi-k2", "kimi-k2-instruct-ids", "kimi-k2-thinking-ids"]
REFUSED = ["kimi-k2-instruct", "kimi-k2-thinking"]
NAMES = frozenset({"get_weather", "search"})


def _call(name: str, idx: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"functions.{name}:{idx}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


@pytest.mark.parametrize("name", REFUSED)
def test_list_append_templates_refused_under_transformers_sandbox(load_renderer_tokenizer: Any, name: str) -> None:
    """The crash is the template, not our probe data: with ids already in Kimi's format the
    template still mutates a list, which transformers' immutable sandbox (what vLLM and
    SGLang render with) forbids; the codec refuses at load, saying so."""
    tok = load_renderer_tokenizer(name)
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", 0, {"city": "Paris"})]}]
    with pytest.raises(Exception, match="append"):
        tok.apply_chat_template(msgs, tokenize=False)
    assert detect_family(tok).family == "kimi-k2"
    with pytest.raises(TemplateNotSupported, match="ImmutableSandboxedEnvironment.*model repository"):
        load_codec(tok)
    report = verify_template(tok)
    assert report.error and "ImmutableSandboxedEnvironment" in report.error and not report.ok


@pytest.mark.parametrize("name", SERVED)
def test_detected_from_template_and_served(load_renderer_tokenizer: Any, name: str) -> None:
    tok = load_renderer_tokenizer(name)
    det = detect_family(tok)
    assert (det.family, det.source) == ("kimi-k2", "markers"), det.describe()
    codec = load_codec(tok)
    assert isinstance(codec, KimiCodec)
    assert codec.stop_token_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("name", SERVED)
def test_sampled_ids_round_trip_through_the_template(load_renderer_tokenizer: Any, name: str) -> None:
    """The model samples `functions.NAME:IDX`; parse returns that id; the client sends it back
    (call and result); the template renders the tokens the model sampled, token for token."""
    tok = load_renderer_tokenizer(name)
    codec = load_codec(tok)
    reasoning = name.endswith("thinking-ids")
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris and events?"}]
    ids = codec.render_first(msgs, tools=TWO_TOOLS)
    sampled_msg: dict[str, Any] = {"role": "assistant", "content": "Checking.",
                                   "tool_calls": [_call("get_weather", 0, {"city": "Paris"}),
                                                  _call("search", 1, {"q": "Paris events"})]}
    if reasoning:
        sampled_msg["reasoning_content"] = "Two lookups."
    sampled = codec.canonical_assistant_ids(sampled_msg)
    text = tok.decode(sampled)
    assert "<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>" in text
    parsed = codec.parse_assistant(sampled, tools=TWO_TOOLS)
    assert parsed.status == ToolCallParseStatus.OK
    assert [tc.id for tc in parsed.tool_calls] == ["functions.get_weather:0", "functions.search:1"]
    assert parsed.reasoning_content == ("Two lookups." if reasoning else None)
    returned = parsed.to_message()  # what the client receives and sends back
    results = [{"role": "tool", "tool_call_id": tc.id, "content": "ok"} for tc in parsed.tool_calls]
    res = codec.bridge([*msgs, returned], (ids + sampled)[-8:], results, tools=TWO_TOOLS)
    assert isinstance(res, BridgeResult) and not res.rewrites_history
    # as the server (and vLLM) render: tool-call arguments as objects (probe.render_form)
    full = render_text(tok, [*msgs, returned, *results], tools=TWO_TOOLS, add_generation_prompt=True)
    assert ids + sampled + res.prompt_ids == tok.encode(full, add_special_tokens=False)
    assert "## Return of functions.search:1" in tok.decode(res.prompt_ids)


def test_thinking_final_answer_reasoning_dropped_is_a_rewrite(load_renderer_tokenizer: Any) -> None:
    """K2-Thinking renders the split assistant answer with `<think></think>`: the sampled
    reasoning is not in the re-render. APPEND keeps the committed tokens and flags the
    rewrite; TEMPLATE refuses (the caller forks)."""
    tok = load_renderer_tokenizer("kimi-k2-thinking-ids")
    codec = load_codec(tok)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
    asst = {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
    ids = codec.render_first(msgs) + codec.canonical_assistant_ids(asst)
    assert "<think>Two and two.</think>4<|im_end|>" in tok.decode(ids)
    new = [{"role": "user", "content": "3+3?"}]
    res = codec.bridge([*msgs, asst], ids[-8:], new)
    assert isinstance(res, BridgeResult) and res.rewrites_history
    full = tok.encode(tok.apply_chat_template([*msgs, asst, *new], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)
    assert full[-len(res.prompt_ids):] == res.prompt_ids and full[: len(ids)] != ids
    ref = codec.bridge([*msgs, asst], ids[-8:], new, policy=HistoryPolicy.TEMPLATE, committed=ids)
    assert isinstance(ref, BridgeRefusal) and ref.reason == RefusalReason.HISTORY_REWRITE


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE], ids=["append", "template"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_contract_both_policies(load_renderer_tokenizer: Any, name: str, policy: HistoryPolicy, data: Any) -> None:
    reasoning = name.endswith("thinking-ids")
    conv = data.draw(conversations("qwen3", reasoning=reasoning, max_calls=3))
    play(load_renderer_tokenizer(name), name, conv, policy)


@pytest.mark.parametrize("name", SERVED)
def test_verify_template_no_hard_failures(load_renderer_tokenizer: Any, name: str) -> None:
    report = verify_template(load_renderer_tokenizer(name), thinking="both")
    assert report.family == "kimi-k2"
    assert report.ok, report.hard_failures()
    assert all(p.ok for p in report.parses), report.format_text()
    exact = [s for s in report.steps if s.outcome == "exact"]
    assert exact and all(s.outcome in ("exact", "rewrite") for s in report.steps), report.format_text()


# -- parse: typed failures -----------------------------------------------------------

SEC = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
ONE = "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|>"


@pytest.mark.parametrize(("text", "status", "detail"), [
    ("Hi" + SEC.format(ONE.format('{"city": ')), ToolCallParseStatus.INVALID_JSON, "tool call"),
    ("Hi" + SEC.format(ONE.format("[1]")), ToolCallParseStatus.INVALID_JSON, "not a JSON object"),
    ("Hi<|tool_calls_section_begin|>" + ONE.format("{}"), ToolCallParseStatus.INVALID_FORMAT, "unclosed"),
    (SEC.format(ONE.format("{}").replace("get_weather", "rm_rf")), ToolCallParseStatus.INVALID_FORMAT, "rm_rf"),
    (SEC.format(ONE.format("{}").replace("functions.get_weather:0", "call_1")),
     ToolCallParseStatus.INVALID_FORMAT, "functions.NAME:IDX"),
    (SEC.format(ONE.format("{}")) + "tail", ToolCallParseStatus.INVALID_FORMAT, "after tool calls"),
    ("Hi" + ONE.format("{}"), ToolCallParseStatus.INVALID_FORMAT, "outside a section"),
    (SEC.format("junk" + ONE.format("{}")), ToolCallParseStatus.INVALID_FORMAT, "markup"),
])
def test_parse_failures_are_typed(text: str, status: ToolCallParseStatus, detail: str) -> None:
    parsed = parse_kimi(text, "R", NAMES)
    assert (parsed.status, parsed.content, parsed.reasoning_content, parsed.tool_calls) == (status, text, "R", [])
    assert detail in parsed.status_detail


def test_parse_calls_and_no_tools() -> None:
    text = "Checking." + SEC.format(ONE.format('{"city": "東京", "metric": true, "date": null}')
                                    + "<|tool_call_begin|>search:3<|tool_call_argument_begin|>{}<|tool_call_end|>")
    parsed = parse_kimi(text, None, NAMES)
    assert parsed.status == ToolCallParseStatus.OK and parsed.content == "Checking."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "東京", "metric": True, "date": None}),
        ("search:3", "search", {})]
    assert parse_kimi(text, None, frozenset()).content == text  # no tools offered: content
