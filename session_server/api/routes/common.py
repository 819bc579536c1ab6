"""What every router shares: the app's state, the body reader, JSON answers.

Handlers read raw bytes and hand parsing to the CPU offload threads, so the event loop
only moves bytes; `read_body` enforces the size limit while reading, before a byte is
parsed. The shared objects live on `app.state` (set by the app's lifespan), so a route
module holds no state and needs no closure over the app.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from ...context import ServerContext
from ...control.relay import PeerRelay
from ...errors import ClientGone, PayloadTooLarge

__all__ = ["JSON", "OCTETS", "PARTIAL", "client_gone", "ctx_of", "json_response", "read_body", "relay_of"]

JSON = "application/json"
OCTETS = "application/octet-stream"
PARTIAL = {207: "some engines or peer instances failed; the report names them"}


def ctx_of(request: Request) -> ServerContext:
    """The context the lifespan built (`lifecycle.build_context`)."""
    ctx: ServerContext = request.app.state.ctx
    return ctx


def relay_of(request: Request) -> PeerRelay:
    """This instance's client to its peers (`control/relay.py`), opened by the lifespan."""
    relay: PeerRelay = request.app.state.relay
    return relay


def json_response(body: Any, status: int = 200) -> Response:
    return Response(content=orjson.dumps(body), status_code=status, media_type=JSON)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to exceed `limit`: by its
    declared length before reading, else once the bytes read pass it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone("client disconnected while sending the body") from None
    return b"".join(chunks)


def client_gone(request: Request) -> Callable[[], Coroutine[Any, Any, None]]:
    """An awaitable that returns when the client hangs up (ASGI `http.disconnect`).

    Only for after the body was read: then the server's `receive` has nothing left
    to deliver but the disconnect, and waits for it without polling."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait
