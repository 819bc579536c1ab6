"""Which renders run on the event loop: only those whose inputs are small, measured
over every field a template can render (reasoning under any of its names included)."""

from __future__ import annotations

from session_server.offload import INLINE_BYTES
from session_server.turn.prepare import RENDER_INLINE_CHARS, _inline_size, _render_size

SMALL = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]


def test_small_messages_render_on_the_loop() -> None:
    assert _inline_size(_render_size(SMALL, None)) < INLINE_BYTES


def test_reasoning_under_any_name_counts() -> None:
    """transformers aliases `reasoning` and `thinking` to `reasoning_content`, which
    templates render: a large one of any name sends the render off the loop."""
    for key in ("reasoning_content", "reasoning", "thinking", "an_unknown_field"):
        big = [{"role": "assistant", "content": "", key: "x" * RENDER_INLINE_CHARS}, SMALL[1]]
        assert _render_size(big, None) >= RENDER_INLINE_CHARS, key
        assert _inline_size(_render_size(big, None)) >= INLINE_BYTES, key


def test_tools_count() -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * RENDER_INLINE_CHARS}}]
    assert _inline_size(_render_size(SMALL, tools)) >= INLINE_BYTES


def test_content_parts_and_call_arguments_count() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "t" * 100}] * 50}]
    calls = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": "v" * RENDER_INLINE_CHARS}}}]}]
    assert _inline_size(_render_size(parts, None)) >= INLINE_BYTES
    assert _inline_size(_render_size(calls, None)) >= INLINE_BYTES


def test_measuring_stops_at_the_threshold() -> None:
    """A huge request is not walked to its end on the loop just to learn it is large."""
    seen = 0

    class Counting(list):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            nonlocal seen
            for item in super().__iter__():
                seen += 1
                yield item

    huge = Counting(["x" * 100] * 100_000)
    assert _render_size([{"role": "user", "content": huge}], None) >= RENDER_INLINE_CHARS
    assert seen <= RENDER_INLINE_CHARS // 100 + 1
