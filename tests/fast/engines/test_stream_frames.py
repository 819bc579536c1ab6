"""Routing replay (R3), streamed turns: the final SSE frame carries the routed experts.

That frame can be megabytes (4K positions x 60 layers x top-8 is ~10 MiB of base64
int32): it is read whole (past aiohttp's 8 MiB line limit) and decoded on the
offload pool, not on the event loop (`fold_stream`, `OFFLOAD_FRAME_BYTES`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from session_server.engines.http import EngineHTTP
from session_server.engines.streams import OFFLOAD_FRAME_BYTES, fold_stream, sse_lines
from session_server.loopback import serving_aiohttp


async def _aiter(items: list[bytes]) -> AsyncIterator[bytes]:
    for x in items:
        yield x


async def test_sse_lines_split_any_chunking_and_bound_a_line() -> None:
    data = b"data: a\n\ndata: " + b"x" * 1000 + b"\ndata: [DONE]\n"
    want = data.split(b"\n")[:-1]
    for size in (1, 3, 7, 64, len(data)):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        assert [line async for line in sse_lines(_aiter(chunks), 10_000)] == want
    with pytest.raises(ValueError):
        _ = [line async for line in sse_lines(_aiter([b"y" * 5000]), 100)]


async def test_a_stream_frame_over_aiohttps_line_limit_arrives_whole() -> None:
    big = b"data: " + b"A" * (12 * 1024 * 1024) + b"\n\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {}\n\n")
        for i in range(0, len(big), 1 << 20):
            await resp.write(big[i : i + (1 << 20)])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/generate", handler)
    async with serving_aiohttp(app) as url:
        http = EngineHTTP(url, protocol="sglang")
        try:
            got = [p async for p in http.stream("/generate", b"{}", timeout_s=30)]
        finally:
            await http.aclose()
    assert [len(p) for p in got] == [2, 12 * 1024 * 1024, 6]


class _Fold:
    def __init__(self) -> None:
        self.done = False
        self.seen: list[int] = []

    def add(self, payload: bytes) -> Any:
        if payload == b"[DONE]":
            self.done = True
            return None
        self.seen.append(len(payload))
        return len(payload)

    def result(self) -> str:
        return "result"


async def test_large_frames_and_the_result_after_them_are_folded_on_the_offload() -> None:
    offloaded: list[str] = []

    async def offload(fn: Any, /, *args: Any) -> Any:
        offloaded.append(fn.__name__)
        return fn(*args)

    small, large = b"s" * 10, b"L" * OFFLOAD_FRAME_BYTES
    got = [x async for x in fold_stream(_aiter([small, small, large, b"[DONE]"]), _Fold(), offload)]
    assert got == [10, 10, OFFLOAD_FRAME_BYTES, "result"]
    assert offloaded == ["add", "result"]  # the small frames stayed on the loop
    offloaded.clear()
    got = [x async for x in fold_stream(_aiter([small, b"[DONE]"]), _Fold(), offload)]
    assert got == [10, "result"] and offloaded == []
