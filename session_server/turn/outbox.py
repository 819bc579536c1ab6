"""Where a live stream's frames wait for its client: a bounded outbox, and the
keep-alives sent in its silences (`live.py` explains why both)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from .output import Rendered

__all__ = ["Frames", "Outbox", "drain", "with_keepalives"]


class Outbox:
    """The client's frames not yet taken by its response, bounded in bytes: past `limit`
    they are dropped and replaced by the cut frames (`cut`), then the end."""

    def __init__(self, limit: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.limit, self.waiting, self.cut = limit, 0, False

    def put(self, frame: bytes) -> bool:
        """Queue `frame`; False when it would pass the bound (nothing queued: cut it)."""
        if self.cut:
            return True  # the client's stream has ended; the turn's frames still go to `frames`
        if self.waiting > self.limit:
            return False  # the backlog is past the bound: the client stopped reading (a frame
            # larger than the bound still goes to a client that keeps up)
        self.waiting += len(frame)
        self.queue.put_nowait(frame)
        return True

    def cut_with(self, frames: Sequence[bytes]) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
        self.cut, self.waiting = True, 0
        for f in frames:
            self.queue.put_nowait(f)
        self.queue.put_nowait(None)

    def end(self) -> None:
        if not self.cut:
            self.queue.put_nowait(None)

    async def get(self) -> bytes | None:
        return self._taken(await self.queue.get())

    def get_nowait(self) -> bytes | None:
        """A waiting frame (asyncio.QueueEmpty when none): the streaming fast path."""
        return self._taken(self.queue.get_nowait())

    def _taken(self, frame: bytes | None) -> bytes | None:
        if frame is not None and not self.cut:
            self.waiting -= len(frame)
        return frame


class Frames(Protocol):
    """Where a stream's frames wait: the outbox, or a follower's queue."""

    async def get(self) -> bytes | None: ...

    def get_nowait(self) -> bytes | None: ...


async def with_keepalives(source: Frames, keepalive: Callable[[], bytes],
                           every: float, *, lead: bool = False) -> AsyncIterator[bytes]:
    """The frames `source` gives until its end (None), and the dialect's keep-alive whenever
    none came for `every` seconds (`lead`: one first, for a response that begins with
    nothing of its turn to send: the client has waited already). Why: a turn held by a
    weight-update pause or a long constrained sample sends nothing for minutes, and
    clients abort a stream that is silent too long (Claude Code, Codex's
    `stream_idle_timeout_ms`). Keep-alives are not part of the turn: never kept in
    `frames`, so a replay does not carry them."""
    if lead:
        yield keepalive()
    while True:
        try:  # a frame already waiting needs no timer (wait_for costs a task per frame)
            frame = source.get_nowait()
        except asyncio.QueueEmpty:
            try:
                frame = await asyncio.wait_for(source.get(), every)
            except TimeoutError:
                yield keepalive()
                continue
        if frame is None:
            return
        yield frame


async def drain(outbox: Outbox, task: asyncio.Future[Rendered], held: bool, keepalive: Callable[[], bytes],
                 every: float, lead: bool) -> AsyncIterator[bytes]:
    """The client's frames as they come (`LiveTurn.stream`), keep-alives in the silences.
    It holds the outbox, the encoder's keep-alive and, only while the turn runs, its task
    (to cancel it if the client leaves): never the LiveTurn, whose `frames` a stalled
    reader would otherwise keep alive after the turn ended."""
    running: list[asyncio.Future[Rendered]] = [task]
    task.add_done_callback(lambda _t: running.clear())
    del task
    ended = False
    try:
        async for frame in with_keepalives(outbox, keepalive, every, lead=lead):
            yield frame
        ended = True
    finally:
        if not ended and not held and running and not running[0].done():
            running[0].cancel()
