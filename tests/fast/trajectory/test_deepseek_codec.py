"""DeepSeek V3.1 / V3.2 / V4: our prefill-aware `DeepSeekCodec`.

Detected from the template alone; canonical sampling after the think prefill; the
contract suite under both history policies; tool-call markup (V3.1 and DSML) parsed
with typed failure statuses; `verify-template` with no hard failure on the offline
tokenizers and on the real DeepSeek tokenizer with every DeepSeek template."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fast.real_tokenizers import TEMPLATES, real_tokenizer_dir
from tests.fast.trajectory.test_codec_contract import TOOLS, conversations, play
from trajectory.codec import (
    BridgeRefusal,
    BridgeResult,
    DeepSeekCodec,
    HistoryPolicy,
    RefusalReason,
    ToolCallParseStatus,
    decode_text,
    detect_family,
    load_codec,
)
from trajectory.codec.probe import encode, render_text
from trajectory.codec.verify import verify_template

OFFLINE = ["deepseek-v3.1", "deepseek-v3.2", "deepseek-v4-flash"]
REAL_TEMPLATES = ["deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-ai-DeepSeek-V3.2.jinja",
                  "deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja"]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def real_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`real_deepseek(template)` -> the real DeepSeek tokenizer with that template."""
    from transformers import AutoTokenizer

    cache: dict[str, Any] = {}

    def load(template: str) -> Any:
        if template not in cache:
            d = real_tokenizer_dir("deepseek-v3.1-real", tmp_path_factory.mktemp("ds-real"))
            config = json.loads((d / "tokenizer_config.json").read_text())
            config["chat_template"] = (TEMPLATES / template).read_text()
            (d / "tokenizer_config.json").write_text(json.dumps(config))
            cache[template] = AutoTokenizer.from_pretrained(str(d))
        return cache[template]

    return load


@pytest.mark.parametrize("name", OFFLINE)
def test_deepseek_detected_from_template(load_renderer_tokenizer: Any, name: str) -> None:
    tok = load_renderer_tokenizer(name)
    det = detect_family(tok)
    assert (det.family, det.source) == ("deepseek", "markers"), det.describe()
    assert isinstance(load_codec(tok), DeepSeekCodec)


@pytest.mark.parametrize("template", REAL_TEMPLATES)
def test_real_deepseek_templates_are_detected_as_deepseek(real_deepseek: Any, template: str) -> None:
    assert isinstance(load_codec(real_deepseek(template)), DeepSeekCodec)


def test_v32_samples_after_the_prefill(load_renderer_tokenizer: Any) -> None:
    """Thinking off: prompt `<think></think>`, re-render `</think>`; the model samples the
    content only. Thinking on: prompt `<think>`, the model samples reasoning first."""
    tok = load_renderer_tokenizer("deepseek-v3.2")
    codec = load_codec(tok)
    asst = {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}
    prompt = decode_text(tok, codec.render_first(USER))
    assert prompt.endswith("<\uff5cAssistant\uff5c><think></think>")
    assert decode_text(tok, codec.canonical_assistant_ids(asst)) == "Sunny.<\uff5cend\u2581of\u2581sentence\uff5c>"
    on = {"thinking": True}
    assert decode_text(tok, codec.render_first(USER, template_kwargs=on)).endswith("<think>")
    got = decode_text(tok, codec.canonical_assistant_ids(asst, template_kwargs=on))
    assert got == "Look it up.</think>Sunny.<\uff5cend\u2581of\u2581sentence\uff5c>"
    parsed = codec.parse_assistant(codec.canonical_assistant_ids(asst, template_kwargs=on), template_kwargs=on)
    assert (parsed.reasoning_content, parsed.content) == ("Look it up.", "Sunny.")


def test_v32_prefill_rewrite_policies(load_renderer_tokenizer: Any) -> None:
    """The re-render drops the prompt's `<think>`: APPEND keeps the committed tokens and
    flags the rewrite; TEMPLATE (every committed id) refuses with HISTORY_REWRITE."""
    tok = load_renderer_tokenizer("deepseek-v3.2")
    codec = load_codec(tok)
    asst = {"role": "assistant", "content": "Sunny."}
    committed = codec.render_first(USER) + codec.canonical_assistant_ids(asst)
    new = [{"role": "user", "content": "Thanks."}]
    res = codec.bridge([*USER, asst], committed[-8:], new)
    assert isinstance(res, BridgeResult) and res.rewrites_history
    full = encode(tok, render_text(tok, [*USER, asst, *new], add_generation_prompt=True))
    assert full[-len(res.prompt_ids):] == res.prompt_ids and full[: len(committed)] != committed
    ref = codec.bridge([*USER, asst], committed[-8:], new, policy=HistoryPolicy.TEMPLATE, committed=committed)
    assert isinstance(ref, BridgeRefusal) and ref.reason == RefusalReason.HISTORY_REWRITE


@pytest.mark.parametrize("name", OFFLINE)
@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE], ids=["append", "template"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deepseek_codec_keeps_the_codec_contract(load_renderer_tokenizer: Any, name: str, policy: HistoryPolicy, data: Any) -> None:
    conv = data.draw(conversations(name, reasoning=True, max_calls=3))
    tok = load_renderer_tokenizer(name)
    play(tok, name, conv, policy, codec=load_codec(tok))


@pytest.mark.parametrize("template", ["deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-ai-DeepSeek-V4.jinja"])
@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE], ids=["append", "template"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_real_deepseek_templates_keep_the_codec_contract(real_deepseek: Any, template: str, policy: HistoryPolicy, data: Any) -> None:
    conv = data.draw(conversations("deepseek", reasoning=True, max_calls=3))
    tok = real_deepseek(template)
    play(tok, template, conv, policy, codec=load_codec(tok))


def _verify_ok(tok: Any) -> None:
    rep = verify_template(tok, thinking="both")
    assert rep.family == "deepseek" and rep.error is None
    assert rep.hard_failures == [], rep.format_text()
    assert all(p.ok for p in rep.parses), rep.format_text()


@pytest.mark.parametrize("name", OFFLINE)
def test_verify_template_offline(load_renderer_tokenizer: Any, name: str) -> None:
    _verify_ok(load_renderer_tokenizer(name))


@pytest.mark.parametrize("template", REAL_TEMPLATES)
def test_verify_template_real(real_deepseek: Any, template: str) -> None:
    _verify_ok(real_deepseek(template))


# -- parsing: V3.1 markup and DSML, round trip and typed failures ------------------

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "n": 2, "ok": True})}}


@pytest.mark.parametrize("name", OFFLINE)
def test_parse_round_trips(load_renderer_tokenizer: Any, name: str) -> None:
    """render(parse(sampled)) == sampled for a call with content, thinking on and off."""
    tok = load_renderer_tokenizer(name)
    codec = load_codec(tok)
    for kw in ({}, {"thinking": True}):
        asst = {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]}
        sampled = codec.canonical_assistant_ids(asst, template_kwargs=kw)
        parsed = codec.parse_assistant(sampled, tools=TOOLS, template_kwargs=kw)
        assert parsed.status == ToolCallParseStatus.OK and parsed.content == "Checking."
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": "Paris", "n": 2, "ok": True})] * 2
        assert codec.canonical_assistant_ids(parsed.to_message(), template_kwargs=kw) == sampled


def _parse(codec: Any, tok: Any, text: str) -> Any:
    return codec.parse_assistant(encode(tok, text), tools=TOOLS)


V31_BAD = {
    "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>get_weather"
    "<\uff5ctool\u2581sep\uff5c>{bad<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>":
        ToolCallParseStatus.INVALID_JSON,
    "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>get_weather"
    "<\uff5ctool\u2581sep\uff5c>{}": ToolCallParseStatus.INVALID_FORMAT,
    "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>nope"
    "<\uff5ctool\u2581sep\uff5c>{}<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>":
        ToolCallParseStatus.INVALID_FORMAT,
}
D = "\uff5cDSML\uff5c"
DSML_BAD = {
    f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="n" string="false">{{x'
    f'</{D}parameter>\n</{D}invoke>\n</{D}function_calls>': ToolCallParseStatus.INVALID_JSON,
    f'<{D}function_calls>\n<{D}invoke name="get_weather">\n': ToolCallParseStatus.INVALID_FORMAT,
    f'<{D}function_calls>\n<{D}invoke name="nope">\n</{D}invoke>\n</{D}function_calls>':
        ToolCallParseStatus.INVALID_FORMAT,
}


@pytest.mark.parametrize(("name", "cases"), [("deepseek-v3.1", V31_BAD), ("deepseek-v3.2", DSML_BAD)])
def test_parse_failures_are_typed(load_renderer_tokenizer: Any, name: str, cases: dict) -> None:
    tok = load_renderer_tokenizer(name)
    codec = load_codec(tok)
    for text, status in cases.items():
        parsed = _parse(codec, tok, text)
        assert parsed.status == status and not parsed.tool_calls, (text, parsed)
        assert parsed.content == text  # the raw text stays visible
    # no tools offered: the markup is content, never a call
    text = next(iter(cases))
    parsed = codec.parse_assistant(encode(tok, text))
    assert parsed.status == ToolCallParseStatus.OK and parsed.content == text and not parsed.tool_calls


def test_v4_call_without_arguments(load_renderer_tokenizer: Any) -> None:
    """V4 renders a call with no arguments as one newline inside `invoke`."""
    tok = load_renderer_tokenizer("deepseek-v4-flash")
    codec = load_codec(tok)
    call = {"id": "c", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    sampled = codec.canonical_assistant_ids({"role": "assistant", "content": "", "tool_calls": [call]})
    parsed = codec.parse_assistant(sampled, tools=TOOLS + [{"type": "function", "function": {"name": "search"}}])
    assert parsed.status == ToolCallParseStatus.OK
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("search", "{}")]


