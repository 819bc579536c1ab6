"""The HTTP edge around the routes: reading a body, unexpected errors, and what
/openapi.json declares.

Routes read raw bytes (parsing runs on the CPU offload threads), so FastAPI cannot see their
request models; `route_doc` declares them and the error responses by hand, and
`install_openapi` puts the models' JSON schemas into the document's components.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..context import log
from ..errors import ClientGone, PayloadTooLarge
from .models import ErrorBody

_REF = "#/components/schemas/{model}"

ERROR_DESCRIPTIONS = {
    400: "invalid request (body, field bounds, template kwargs, history)",
    401: "missing or wrong bearer token (only when the server runs with an admin token)",
    404: "unknown session, engine or route",
    405: "method not allowed on this route",
    409: "session busy (a turn was still in flight after busy_wait_s of waiting; Retry-After: 2) or closed "
         "during the turn; a wait pause resumed between its drain and its freeze (pause_superseded)",
    413: "body larger than the configured limit",
    421: "the session id names another instance of the cluster (wrong_instance): the proxy misrouted it; "
         "only on an instance with peers (elsewhere an unknown id is a 404)",
    429: "a capacity limit was reached (session cap: over_capacity; branches per session: branch_limit; live viewers: too_many_viewers)",
    502: "the engine failed or answered invalid output; nothing was committed",
    503: "no healthy engine, paused past the deadline, the engine aborted, a peer instance is down "
         "(instance_unavailable), or the reply worker died with the turn's request (reply_worker_lost)",
    504: "the engine did not finish within the turn's deadline, or a wait pause's turns outlived its drain "
         "timeout (drain_timeout: no engine paused, the gate stays closed)",
}

RETRY_AFTER_CODES = (409, 429, 503)
RETRY_AFTER_HEADER: dict[str, Any] = {
    "description": "seconds to wait before retrying (session_busy 2, over_capacity 5, branch_limit 60, "
    "no_healthy_engine 5, paused 10, engine_aborted 1, instance_unavailable 5, reply_worker_lost 1; none on "
    "session_closed)",
    "schema": {"type": "integer", "minimum": 0},
}


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 past `limit` bytes (declared or as it arrives)."""
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


def internal_error_body(exc: BaseException) -> bytes:
    return orjson.dumps({"error": {"type": "internal_error", "message": type(exc).__name__}})


def route_doc(
    body: type[BaseModel] | None,
    *codes: int,
    required: bool = True,
    ok: dict[int, str] | None = None,
    media: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Keyword arguments for a route decorator: its JSON request model, error responses
    (401 everywhere: auth is optional), other success statuses (`ok`), and the media
    types a 200 may carry besides JSON (`media`: Prometheus text, SSE, npz)."""
    responses: dict[int | str, dict[str, Any]] = {
        c: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[c]} for c in (*codes, 401)
    }
    for c in codes:
        if c in RETRY_AFTER_CODES:
            responses[c]["headers"] = {"Retry-After": RETRY_AFTER_HEADER}
    if media:
        responses[200] = {"description": "OK", "content": {m: {} for m in media}}
    for code, description in (ok or {}).items():
        responses[code] = {"description": description}
    doc: dict[str, Any] = {"responses": responses}
    if body is not None:
        schema = {"$ref": _REF.format(model=body.__name__)}
        doc["openapi_extra"] = {
            "requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}
        }
    return doc


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add the request models to the schema's components and drop FastAPI's 422
    responses: its own validation errors are answered 400 in our envelope."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            js = model.model_json_schema(ref_template=_REF)
            comps.update(js.pop("$defs", {}))
            comps[model.__name__] = js
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        wrong_instance = {"description": ERROR_DESCRIPTIONS[421],
                          "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorBody")}}}}
        for route, path in schema.get("paths", {}).items():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
                if "{sid}" in route:  # any session route may meet a misrouted id
                    op.setdefault("responses", {})["421"] = wrong_instance
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class ContainErrors:
    """Answer an unexpected exception with the 500 envelope, and do not re-raise it.

    Starlette's ServerErrorMiddleware sends its handler's response and then re-raises
    (so servers can log it); uvicorn's protocol, seeing an exception after the
    response started, closes the transport. The client's next request on that
    keep-alive connection, maybe another agent's, then meets a reset.
    Contained here, the response is complete and uvicorn keeps the connection. An
    error after the response started is re-raised: closing is the only honest end
    of a half-sent body."""

    def __init__(self, app: ASGIApp, on_error: Callable[[], None] | None = None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if self.on_error is not None:
                self.on_error()
            if started:
                raise
            body = internal_error_body(exc)
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
