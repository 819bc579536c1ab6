"""What every router shares: the app's state, the body reader (`api/edge.py`), JSON answers.

Handlers read raw bytes and hand parsing to the CPU offload threads, so the event loop
only moves bytes; `read_body` enforces the size limit while reading, before a byte is
parsed. The shared objects live on `app.state` (set by the app's lifespan), so a route
module holds no state and needs no closure over the app.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from ...auth import is_viewer
from ...context import ServerContext
from ...control.relay import PeerRelay
from ..edge import read_body

__all__ = ["JSON", "OCTETS", "PARTIAL", "ctx_of", "json_response", "read_body", "read_use", "relay_of"]

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


def read_use(request: Request, session: Any) -> None:
    """A read of `session` counts as use (its TTL restarts), unless the trajectory viewer
    reads it (its cookie, or its page's `x-tito-viewer` header): a viewer left open must
    not keep a session alive that its trainer and agent have left."""
    if not is_viewer(request.scope):
        ctx_of(request).store.touch(session)
