"""Engine streams: SSE lines out of a byte stream, and a fold of their payloads into
deltas and a final result, with the large payloads decoded off the event loop.

Also `Offload`, the seam through which adapters run their parsers (the server passes
its `ReplyDecoder`; tests and tools run them inline).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

__all__ = ["OFFLOAD_FRAME_BYTES", "STREAM_FRAME_MAX", "Offload", "StreamFold", "fold_stream", "run_inline",
           "sse_lines"]


# the largest SSE line read from an engine. aiohttp's own line reader stops at twice
# its read buffer (8 MiB here), below a streamed R3 turn's last frame (4K positions x
# 60 layers x top-8 as base64 int32 is ~10 MiB), so lines are split here instead
STREAM_FRAME_MAX = 256 * 1024 * 1024


async def sse_lines(chunks: AsyncIterator[bytes], max_line: int) -> AsyncIterator[bytes]:
    """The lines (without their newline) of a byte stream arriving in `chunks`, each
    byte scanned once; a line longer than `max_line` is `ValueError`."""
    buf = bytearray()
    async for chunk in chunks:
        scan = len(buf)
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", scan)) >= 0:
            yield bytes(buf[start:nl])
            start = scan = nl + 1
        del buf[:start]
        if len(buf) > max_line:
            raise ValueError(f"a line of more than {max_line} bytes")
    if buf:
        yield bytes(buf)


class StreamFold(Protocol):
    """An adapter's fold of one streamed generation (SGLangStream, VLLMStream)."""

    done: bool

    def add(self, payload: bytes) -> Any: ...

    def result(self) -> Any: ...


Offload = Callable[..., Awaitable[Any]]
"""Runs `fn(*args, **kwargs)` somewhere and awaits it (the server passes its CPU offload)."""


async def run_inline(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Default `Offload`: call on the event loop (fine for small replies and tests)."""
    return fn(*args, **kwargs)


# a stream frame at least this large is decoded on the offload pool: a streamed turn's
# final frame carries its routed experts (R3), megabytes of base64 at 60 layers x top-8
OFFLOAD_FRAME_BYTES = 256 * 1024


async def fold_stream(payloads: AsyncIterator[bytes], fold: StreamFold, offload: Offload = run_inline,
                      big: int = OFFLOAD_FRAME_BYTES) -> AsyncIterator[Any]:
    """The deltas `fold` makes of each SSE payload as it arrives, then its final result.
    A payload of `big` bytes or more, and the final result after one, are made on
    `offload` (the fold is only ever touched by one call at a time; its bound methods
    must run in this process: the server's `ReplyDecoder` sends them to threads)."""
    large = False
    async for data in payloads:
        if len(data) >= big:
            large = True
            delta = await offload(fold.add, data)
        else:
            delta = fold.add(data)
        if delta is not None:
            yield delta
        if fold.done:
            break
    yield await offload(fold.result) if large else fold.result()
