"""`TextStreamer` sends only text that is certainly in the committed message
(held back: partial markers, possible tool calls, content that may turn into reasoning),
and its deltas plus `tail` are exactly the final fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from session_server.turn.stream_events import ContentDelta, ReasoningDelta
from session_server.turn.text_stream import TextStreamer
from trajectory.codec.parsing import parse_hermes, split_reasoning

CLOSE = [ord(c) for c in "</think>"]


def _parser(names: frozenset[str]) -> Any:
    def parse(ids: Sequence[int]) -> dict[str, Any]:
        reasoning, rest = split_reasoning("".join(map(chr, ids)))
        if reasoning is not None:
            reasoning = reasoning.strip("\n") or None
        return parse_hermes(rest, reasoning, names).to_message()
    return parse


def _run(text: str, names: frozenset[str]) -> tuple[list[tuple[int, Any]], dict[str, Any], TextStreamer]:
    s = TextStreamer(_parser(names), CLOSE, tools=bool(names))
    ids = [ord(c) for c in text]
    events = [(i, e) for i in range(1, len(ids) + 1) for e in s.feed(ids[:i])]
    return events, _parser(names)(ids), s


def test_reasoning_then_content_stream_and_a_tool_call_is_held() -> None:
    call = '<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>'
    text = f"<think>\nlook first\n</think>\n\nReading it.\n{call}"
    events, final, s = _run(text, frozenset({"read"}))
    assert final["tool_calls"] and final["content"] == "\n\nReading it."
    reasoning = [(i, e.text) for i, e in events if isinstance(e, ReasoningDelta)]
    content = "".join(e.text for _, e in events if isinstance(e, ContentDelta))
    assert reasoning and reasoning[0][0] < text.index("</think>")  # before the block closed
    assert "<" not in content and content == "\n\nReading it."
    tail = s.tail(final)
    assert "".join(e.text for e in tail if isinstance(e, ReasoningDelta)) == ""
    assert "".join(r for _, r in reasoning) == final["reasoning_content"]


def test_without_tools_tags_in_content_stream_but_a_partial_one_waits() -> None:
    text = "<think>x</think>use <b> here and a <par"
    events, final, s = _run(text, frozenset())
    content = "".join(e.text for _, e in events if isinstance(e, ContentDelta))
    assert content == "use <b> here and a"
    rest = "".join(e.text for e in s.tail(final) if isinstance(e, ContentDelta))
    assert content + rest == final["content"]


def test_content_waits_while_a_reasoning_block_may_still_close() -> None:
    """Thinking on, no `<think>`: text before a later `</think>` is reasoning."""
    events, final, s = _run("plan it</think>done", frozenset())
    first_content = next(i for i, e in events if isinstance(e, ContentDelta))
    assert first_content > len("plan it</think>") - 1
    assert not any(isinstance(e, ContentDelta) and "plan" in e.text for _, e in events)
    joined = {k: "".join(e.text for _, e in events if isinstance(e, t)) for k, t in
              (("reasoning_content", ReasoningDelta), ("content", ContentDelta))}
    for e in s.tail(final):
        joined["reasoning_content" if isinstance(e, ReasoningDelta) else "content"] += e.text
    assert joined == {"reasoning_content": final["reasoning_content"], "content": final["content"]}
