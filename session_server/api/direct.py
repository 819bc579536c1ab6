"""The turn routes served without FastAPI's routing: the hot path's HTTP layer.

A turn request crossed about fifteen framework layers (Starlette's exception and
routing middleware, a regex per registered route, FastAPI's request/response wrappers)
before reaching `TurnEndpoint`, and every resumption of the turn's coroutine ran back
through all of them. `DirectTurns` sits right outside `ContainErrors`, inside auth:
it recognises the turn routes by path (`routes/turns.py` `DIRECT`, the same functions
FastAPI registers, which still document them in /openapi.json) and calls them itself,
with the same error map (`error_map.mapped_error`) and the same containment of an
unexpected error. Any other request, or a turn path with another method, goes on to
FastAPI unchanged (its 405, 404 and validation answers included).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from .edge import ContainErrors
from .error_map import mapped_error
from .routes.turns import DIRECT

__all__ = ["DirectTurns", "direct_route"]


def direct_route(path: str) -> tuple[str, str] | None:
    """(session id, route suffix) when `path` is a turn route (`/sessions/{sid}/v1/<suffix>`);
    the session id matches as Starlette's `{sid}` does: one non-empty path segment."""
    parts = path.split("/", 4)  # "", "sessions", sid, "v1", suffix
    if len(parts) == 5 and parts[1] == "sessions" and parts[3] == "v1" and parts[2] and parts[4] in DIRECT:
        return parts[2], parts[4]
    return None


class DirectTurns:
    """ASGI middleware: turn routes straight to their function (see module doc)."""

    def __init__(self, app: ASGIApp, on_error: Callable[[], None] | None = None) -> None:
        self.app = app
        self.contained = ContainErrors(self._serve, on_error=on_error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            match = direct_route(scope["path"])
            if match is not None:
                scope["path_params"] = {"sid": match[0]}
                scope["endpoint"] = DIRECT[match[1]]  # as Starlette's routing sets them
                scope["tito_direct"] = match
                await self.contained(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _serve(scope: Scope, receive: Receive, send: Send) -> None:
        sid, suffix = scope["tito_direct"]
        request = Request(scope, receive, send)
        try:
            response = await DIRECT[suffix](sid, request)
        except Exception as exc:  # mapped as the app maps it; the rest is ContainErrors'
            mapped = await mapped_error(request, exc)
            if mapped is None:
                raise
            response = mapped
        # a failure while sending started the response already: ContainErrors re-raises it
        await response(scope, receive, send)
