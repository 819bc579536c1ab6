"""Unknown templates: probed and verified, or refused with TemplateNotSupported."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trajectory.codec import GenericCodec, ToolCallParseStatus, detect_family, load_codec
from trajectory.errors import TemplateNotSupported

CHATML_NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites every earlier turn (numbers them from the end): never append-only.
REWRITING = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ messages|length - loop.index0 }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _with_template(load_tokenizer: Any, template: str) -> Any:
    tok = load_tokenizer("qwen3")
    clone = type(tok).from_pretrained(tok.name_or_path)
    clone.chat_template = template
    return clone


def test_unknown_append_only_template_is_verified(load_tokenizer: Any) -> None:
    tok = _with_template(load_tokenizer, CHATML_NO_TOOLS)
    assert detect_family(tok).family == "generic"
    codec = load_codec(tok)
    assert isinstance(codec, GenericCodec)
    assert tok.decode(list(codec.eot_ids)) == "<|im_end|>"


def test_rewriting_template_is_refused(load_tokenizer: Any) -> None:
    tok = _with_template(load_tokenizer, REWRITING)
    with pytest.raises(TemplateNotSupported):
        load_codec(tok)


def test_forced_family_is_validated(load_tokenizer: Any) -> None:
    with pytest.raises(TemplateNotSupported):
        load_codec(load_tokenizer("llama3"), family="qwen3")


def test_qwen3_coder_xml_calls_parse_through_the_generic_prober(load_renderer_tokenizer: Any) -> None:
    """Qwen3-Coder: no family of ours, its renderer refuses the template, so the generic
    prober serves it; it reads the template's `<function=...>` calls back (was: content)."""
    from trajectory.codec.verify import verify_template

    tok = load_renderer_tokenizer("qwen3-coder")
    codec = load_codec(tok)
    assert codec.family == "generic"
    report = verify_template(tok)
    assert report.ok and all(p.ok is not False for p in report.parses), report.format_text()
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "n": 3, "ok": true, "x": null}'}}
    msg = {"role": "assistant", "content": "Checking.", "tool_calls": [call]}
    parsed = codec.parse_assistant(codec.canonical_assistant_ids(msg), tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    assert parsed.status == ToolCallParseStatus.OK and parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "n": 3, "ok": True, "x": None})]


@pytest.mark.parametrize(("text", "status"), [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", "invalid_format"),
    ("<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>", "invalid_format"),
    ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", "invalid_format"),
    ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>\ntrailing", "invalid_format"),
])
def test_xml_call_failures_are_typed(text: str, status: str) -> None:
    from trajectory.codec.parsing import parse_xml_calls

    parsed = parse_xml_calls(text, None, frozenset({"get_weather"}))
    assert parsed.status == status and parsed.content == text and not parsed.tool_calls
