"""A turn the client does not stream, watched (turn/watch.py): its segments are streamed
to the watchers alone, and watching must never make such a turn fail, or differ, where
an unwatched one would not.

Only adapters whose stream frames are deltas are peeked at (`EngineCapabilities.
incremental_stream`, resilient.py): SGLang's default cumulative frames would move O(L^2)
for an L-token answer. A peeked stream that fails (a malformed frame, one ending without
a result, a chunk the watchers refused, whose joined answer would carry it) showed the
client nothing, so the segment is aborted and sent again unstreamed (`peeked`, `resend`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Protocol

from session_server.engines.base import (
    EngineAdapter,
    GenerateRequest,
    GenerateResult,
    StreamItem,
    TokenDelta,
)
from session_server.engines.base import streaming as streaming_of
from session_server.errors import UpstreamInvalid

from .lag import LagBound, SegmentWatch
from .plane import ControlPlane
from .segment import new_request_id, streamed

__all__ = ["Peek", "peek_stream", "peeked", "resend"]

log = logging.getLogger(__name__)


class Peek(Protocol):
    """A non-streamed turn's watchers (turn/watch.py `Peeker`)."""

    def __call__(self) -> Callable[[TokenDelta], None] | None:
        """The watchers' callback for the segment being dispatched, if one watches now
        (it raises `UpstreamInvalid` on a chunk it will not show)."""

    def restart(self, unseen: bool = False) -> None:
        """What the watchers saw of this attempt is void: it is generated afresh
        (`unseen`: its segment is sent again unstreamed)."""


def peek_stream(adapter: EngineAdapter) -> Callable[[GenerateRequest], AsyncIterator[StreamItem]] | None:
    """The adapter's stream where its frames are deltas, else None (not watched live)."""
    streamer = streaming_of(adapter)
    return streamer.generate_stream if streamer is not None and adapter.capabilities.incremental_stream else None


async def peeked(items: AsyncIterator[StreamItem], watcher: Callable[[TokenDelta], None], seg_rid: str, peek: Peek,
                 resend: Callable[[str], Awaitable[GenerateResult]], abort: Callable[[], None]) -> GenerateResult:
    """One segment streamed to the watchers alone; on a stream that fails, `abort` it at
    the engine, restart the watchers and `resend` it unstreamed under a fresh request id
    (the failed one may still be live at the engine: an id is never sent twice)."""
    try:
        return await streamed(items, watcher, None, seg_rid)
    except UpstreamInvalid as exc:
        log.info("segment %s: its watched stream failed (%s); sent again unstreamed", seg_rid, exc)
        abort()
        peek.restart(unseen=True)
        return await resend(new_request_id())


async def resend(adapter: EngineAdapter, control: ControlPlane, lag: LagBound, seg: GenerateRequest,
                 watch: SegmentWatch, rid: str) -> GenerateResult:
    """`seg` again, unstreamed, as an unwatched turn sends it (same input, budget, seed),
    as `rid`: tracked by the plane (a pause aborts it) and lag-watched as `seg` was; its
    answer carries the segment's own id, as the unwatched segment's would."""
    with (control.track_flight(rid, engine=str(adapter.base_url), lora=seg.lora),
          lag.watch(control, adapter, rid, watch.versions[-1]) as again):
        result = await adapter.generate(replace(seg, request_id=rid))
    watch.versions += again.versions[1:]
    watch.cut |= again.cut
    return replace(result, request_id=seg.request_id)
