"""The incremental streamer (covered families) decodes only the new ids and
splits fields with a marker state machine; for every split of a real codec output's ids
(inside multi-byte characters and markers too) the deltas plus the held-back rest are
exactly the parsed fields, and each chunk decodes a bounded window, not the whole output."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_server.turn.incremental import (
    FieldSplitter,
    IncrementalDecoder,
    IncrementalText,
    markup_for,
)
from trajectory.codec import load_codec
from trajectory.codec.parsing import tool_names

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "read", "arguments": {"path": "é/ß"}}\n</tool_call>'
TEXTS = [
    "<think>\nplan: 日本語 ✓ 🙂\n</think>\n\nAnswer 🙂 <b>ok</b>\n",
    f"<think>\nlook first\n</think>\n\nReading 日本 it.\n{CALL}",
    "plan it</think>done 🙂 <tool_ca",
    "  <thi",
    "no reasoning at all, émoji 🙂 and <tool_call> broken",
    "<think>\n\nunclosed 🙂 <",
]


def _fields(msg: dict[str, Any]) -> dict[str, str]:
    return {k: str(msg.get(k) or "") for k in ("reasoning_content", "content")}


class Counting:
    """A tokenizer whose `decode` counts the ids it is asked to decode."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids: Any, **kw: Any) -> str:
        self.decoded += len(ids)
        return str(self.tok.decode(ids, **kw))


def _stream(codec: Any, ids: list[int], cuts: list[int], tools: Any, kw: Any) -> tuple[dict[str, str], dict[str, str]]:
    markup = markup_for(codec, tools=bool(tool_names(tools)), template_kwargs=kw)
    assert markup is not None
    inc = IncrementalText(IncrementalDecoder(codec.tokenizer, codec.stop_token_ids), FieldSplitter(markup))
    sent = {"reasoning_content": "", "content": ""}
    for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        for name, text in inc.feed(ids[a:b]):
            sent[name] += text
    final = _fields(codec.parse_assistant(ids, tools=tools, template_kwargs=kw).to_message())
    return sent, final


@pytest.mark.parametrize("family", ["qwen3", "glm4moe"])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kw", [None, {"enable_thinking": False}])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_deltas_are_a_prefix_of_the_parsed_fields(
    load_tokenizer: Any, family: str, tools: Any, kw: Any, data: st.DataObject
) -> None:
    codec = load_codec(load_tokenizer(family))
    text = data.draw(st.sampled_from(TEXTS))
    ids = [int(t) for t in codec.tokenizer.encode(text, add_special_tokens=False)]
    ids += data.draw(st.sampled_from([[], [codec.stop_token_ids[0]]]))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids))))
    sent, final = _stream(codec, ids, cuts, tools, kw)
    for name in sent:
        assert final[name].startswith(sent[name]), (name, sent, final)


@pytest.mark.parametrize("family", ["qwen3", "glm4moe"])
def test_incremental_one_token_at_a_time_streams_most_text(load_tokenizer: Any, family: str) -> None:
    codec = load_codec(load_tokenizer(family))
    ids = codec.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    sent, final = _stream(codec, ids, list(range(1, len(ids))), None, None)
    assert sent["reasoning_content"] == final["reasoning_content"] == "plan: 日本語 ✓ 🙂"
    assert final["content"].startswith(sent["content"]) and "Answer 🙂 <b>ok</b>" in sent["content"]


def test_incremental_decodes_a_bounded_window_per_chunk(load_tokenizer: Any) -> None:
    """Per-chunk work follows the new tokens: ids decoded per chunk stay bounded."""
    codec = load_codec(load_tokenizer("qwen3"))
    tok = Counting(codec.tokenizer)
    ids = codec.tokenizer.encode("<think>\n" + "word 日本 " * 400 + "\n</think>\n\n" + "x 🙂 " * 400,
                                 add_special_tokens=False)
    inc = IncrementalText(IncrementalDecoder(tok, codec.stop_token_ids), FieldSplitter(markup_for(codec, tools=False, template_kwargs=None)))  # type: ignore[arg-type]
    worst = 0
    for t in ids:
        before = tok.decoded
        inc.feed([t])
        worst = max(worst, tok.decoded - before)
    assert len(ids) > 1000 and worst <= 20  # a whole re-decode would reach len(ids)
    assert tok.decoded <= 12 * len(ids)


def test_generic_template_without_markers_streams_everything(load_tokenizer: Any) -> None:
    from trajectory.codec.template import TemplateCodec

    codec = load_codec(load_tokenizer("qwen3"))
    markup = markup_for(TemplateCodec.__new__(TemplateCodec), tools=True, template_kwargs=None)
    assert markup is not None and not markup.think and not markup.tools
    inc = IncrementalText(IncrementalDecoder(codec.tokenizer), FieldSplitter(markup))
    ids = codec.tokenizer.encode("<think>a</think> 🙂 <tool_call>", add_special_tokens=False)
    assert "".join(t for _, t in (p for i in ids for p in inc.feed([i]))) == "<think>a</think> 🙂 <tool_call>"
