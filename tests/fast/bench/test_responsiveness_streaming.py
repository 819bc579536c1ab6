"""The responsiveness bench's streamed chats read every SSE frame
and count a stream cut before `[DONE]` as an error, not as a served chat."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from bench.responsiveness import _read_sse


class _Resp:
    """What `_read_sse` uses of an aiohttp response: `content`, iterated by line."""

    def __init__(self, lines: list[bytes]) -> None:
        self._lines = lines

    @property
    def content(self) -> AsyncIterator[bytes]:
        async def it() -> AsyncIterator[bytes]:
            for line in self._lines:
                yield line

        return it()


async def test_responsiveness_reads_every_frame() -> None:
    lines = [b'data: {"a": 1}\n', b"\n", b'data: {"a": 2}\n', b"\n", b"data: [DONE]\n", b"\n"]
    resp: Any = _Resp(lines)
    assert await _read_sse(resp) == 3


async def test_responsiveness_stream_without_done_is_an_error() -> None:
    resp: Any = _Resp([b'data: {"a": 1}\n', b"\n"])
    assert await _read_sse(resp) == -1
