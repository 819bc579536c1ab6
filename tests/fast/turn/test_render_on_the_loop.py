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


def test_what_is_not_json_is_offloaded() -> None:
    assert _inline_size(_render_size([{"role": "user", "content": object()}], None)) >= INLINE_BYTES
