"""At the codec: exact decoding, parsing
as the request that sampled the text (its tools, its thinking switch), tools compared
as the template renders them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from session_server.sim.tokenizers import build_tokenizer
from trajectory.codec import ToolCallParseStatus, decode_text, load_codec

EXACT = "Bonjour ! print(a , b)"


def cleanup_tokenizer_dir(root: Path, family: str = "llama3.1") -> Path:
    """An offline tokenizer whose config turns `clean_up_tokenization_spaces` on, as the
    real Llama 3.2 one does. transformers 4.x honours the flag; 5.x ignores it for BPE
    unless told to corrupt anyway, which the second key does, so both majors clean."""
    out = build_tokenizer(family, root / f"{family}-cleanup")
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["clean_up_tokenization_spaces"] = True
    cfg["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    cfg_path.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def cleanup_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cleanup_tokenizer_dir(tmp_path_factory.mktemp("cleanup"))


def tools(*names: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


def enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


# -- decoding never alters text --------------------------------------------------


class _Recorder:
    """A tokenizer stand-in that records the keyword arguments decode was called with."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.calls.append(kw)
        return "x"


def test_decode_text_pins_clean_up_off() -> None:
    rec = _Recorder()
    decode_text(rec, [1, 2])
    decode_text(rec, [3], skip_special_tokens=True)
    assert rec.calls == [
        {"skip_special_tokens": False, "clean_up_tokenization_spaces": False},
        {"skip_special_tokens": True, "clean_up_tokenization_spaces": False},
    ]


def test_cleanup_tokenizer_parse_keeps_spaces_before_punctuation(cleanup_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cleanup_dir))
    ids = enc(tok, EXACT)
    assert tok.decode(ids) != EXACT, "precondition: this tokenizer's own decode cleans up spaces"
    assert decode_text(tok, ids) == EXACT
    codec = load_codec(tok)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert codec.parse_assistant(ids + [eot]).content == EXACT


# -- parsed as the request ------------------------------------------------


@pytest.fixture(scope="module")
def codecs(tokenizer_dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {f: load_codec(AutoTokenizer.from_pretrained(str(d))) for f, d in tokenizer_dirs.items()}


def parse(codec: Any, text: str, **kw: Any) -> Any:
    return codec.parse_assistant(enc(codec.tokenizer, text), **kw)


def test_llama31_json_answer_is_content_unless_a_requested_tool(codecs: dict[str, Any]) -> None:
    codec = codecs["llama3.1"]
    answer = '{"name": "Alice", "age": 30}'
    for offered in (None, tools("get_weather")):
        p = parse(codec, answer, tools=offered)
        assert p.content == answer and p.tool_calls == [] and p.status == ToolCallParseStatus.OK
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    p = parse(codec, call, tools=tools("get_weather"))
    assert [c.name for c in p.tool_calls] == ["get_weather"] and p.content is None


@pytest.mark.parametrize("family", ["qwen3", "glm4moe", "llama3.1"])
def test_no_tools_in_the_request_means_content(codecs: dict[str, Any], family: str) -> None:
    codec = codecs[family]
    msg = {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}]}
    ids = codec.canonical_assistant_ids(msg)
    offered = codec.parse_assistant(ids, tools=tools("search"))
    assert [c.name for c in offered.tool_calls] == ["search"]
    plain = codec.parse_assistant(ids, tools=None)
    assert plain.tool_calls == [] and plain.status == ToolCallParseStatus.OK
    assert "search" in (plain.content or "")


def test_hermes_call_to_a_name_not_offered_is_not_a_call(codecs: dict[str, Any]) -> None:
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    p = parse(codecs["qwen3"], text, tools=tools("search"))
    assert p.tool_calls == [] and p.status == ToolCallParseStatus.INVALID_FORMAT
    assert "rm_rf" in p.status_detail and p.content == text


def test_qwen3_thinking_off_keeps_literal_think_close_as_content(codecs: dict[str, Any]) -> None:
    codec = codecs["qwen3"]
    text = "Use </think> to close a block."
    off = parse(codec, text, template_kwargs={"enable_thinking": False})
    assert off.content == text and off.reasoning_content is None
    on = parse(codec, text)  # thinking on: text before </think> is reasoning (missing <think>)
    assert on.reasoning_content == "Use " and off.content != on.content


def test_qwen3_truncated_think_is_reasoning(codecs: dict[str, Any]) -> None:
    p = parse(codecs["qwen3"], "<think>\nStill weighing the options")  # cut short: no </think>
    assert p.reasoning_content == "Still weighing the options"
    assert not p.content


def test_glm_thinking_off_keeps_literal_think_close(codecs: dict[str, Any]) -> None:
    p = parse(codecs["glm4moe"], "a </think> b", template_kwargs={"enable_thinking": False})
    assert p.content == "a </think> b" and p.reasoning_content is None


def test_hermes_call_with_tool_call_close_inside_an_argument(codecs: dict[str, Any]) -> None:
    codec = codecs["qwen3"]
    args = {"text": "wrap it in </tool_call> tags", "n": 1}
    text = f'<think>\nok\n</think>\n\n<tool_call>\n{json.dumps({"name": "write", "arguments": args})}\n</tool_call>'
    p = parse(codec, text, tools=tools("write"))
    assert p.status == ToolCallParseStatus.OK, p.status_detail
    assert [c.name for c in p.tool_calls] == ["write"]
    assert json.loads(p.tool_calls[0].arguments) == args
    two = text + '\n<tool_call>\n{"name": "write", "arguments": {"text": "</tool_call>"}}\n</tool_call>'
    assert [json.loads(c.arguments)["text"] for c in parse(codec, two, tools=tools("write")).tool_calls] == [
        args["text"], "</tool_call>"]


# -- tools compared as the template renders them -----------------------------------


def test_tools_are_the_same_when_they_render_the_same(codecs: dict[str, Any]) -> None:
    a = tools("search")
    swapped = [{"function": {"parameters": {"type": "object"}, "name": "search"}, "type": "function"}]
    qwen, plain = codecs["qwen3"], codecs["llama3"]
    assert qwen.same_tools(a, json.loads(json.dumps(a)))
    assert not qwen.same_tools(a, tools("search", "read"))
    assert not qwen.same_tools(a, None)
    # Qwen3 renders each tool with `tojson` (keys in order): a key reorder is what the model sees
    assert not qwen.same_tools(a, swapped)
    # plain Llama 3 renders no tools: no change of tools changes its prompt
    assert plain.same_tools(a, swapped) and plain.same_tools(a, tools("read"))
    # typed: 1 and 1.0 render differently, so they are different tools
    one = [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 1}}}]
    one_f = [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 1.0}}}]
    assert not qwen.same_tools(one, one_f)
