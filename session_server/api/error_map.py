"""The one map from an exception to an HTTP response, in the client's own shape.

`errors.py` types every error with its status and kind; this module turns one into the
response a client of that route understands: Anthropic's error shape on the Messages
routes, our envelope (`{"error": {"type", "message"}}`, which the OpenAI SDKs read)
everywhere else, with `Retry-After` and `x-should-retry` where the error sets them.
Framework errors (FastAPI's validation, Starlette's 404/405) and library errors
(`trajectory.errors.CodecError`) are first mapped to a `ServiceError`, so they take the
same path. An exception nothing maps is a 500 `internal_error` (`edge.ContainErrors`);
auth's 401 (auth.py) takes its body from `error_body` here too.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException

from trajectory.errors import CodecError

from ..context import log
from ..errors import BadRequest, ClientGone, ServiceError, from_http_status, from_library
from .dialects import anthropic_messages as anthropic
from .edge import ContainErrors, internal_error_body

__all__ = ["error_body", "count_error", "install_error_map", "mapped_error"]

_JSON = "application/json"


def error_body(path: str, exc: ServiceError) -> dict[str, Any]:
    """`exc` in the shape the client of `path` reads: Anthropic's on its routes, else ours."""
    return anthropic.error_body(exc) if anthropic.owns_path(path) else exc.to_body()


def count_error(state: State, kind: str) -> None:
    """One more `tito_errors_total{type=kind}`, once the lifespan has built the metrics."""
    ctx = getattr(state, "ctx", None)
    if ctx is not None:
        ctx.metrics.errors_total.labels(type=kind).inc()


async def service_error(request: Request, exc: ServiceError) -> Response:
    count_error(request.app.state, exc.type)
    if isinstance(exc, ClientGone):  # nobody is left to read a response
        log.info("%s %s: %s", request.method, request.url.path, exc.message)
    elif exc.status >= 500:
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status, exc.type, exc.message)
    resp = Response(content=orjson.dumps(error_body(request.url.path, exc)), status_code=exc.status,
                    media_type=_JSON)
    if exc.retry_after_s is not None:
        resp.headers["retry-after"] = str(exc.retry_after_s)
    if exc.should_retry is not None:
        resp.headers["x-should-retry"] = "true" if exc.should_retry else "false"
    return resp


async def _codec_error(request: Request, exc: CodecError) -> Response:
    return await service_error(request, from_library(exc) or BadRequest(str(exc)))


async def _framework_validation(request: Request, exc: RequestValidationError) -> Response:
    errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
    return await service_error(request, BadRequest(f"invalid request: {errs}"))


async def _framework_http(request: Request, exc: StarletteHTTPException) -> Response:
    resp = await service_error(request, from_http_status(exc.status_code, str(exc.detail)))
    resp.headers.update(exc.headers or {})  # e.g. Allow on a 405
    return resp


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Reached only by errors outside ContainErrors (another middleware): Starlette
    # re-raises after this response and uvicorn closes the socket, so say so.
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    count_error(request.app.state, "internal_error")
    return Response(internal_error_body(exc), 500, {"connection": "close"}, media_type=_JSON)


_MAPPED: tuple[tuple[type[Exception], Any], ...] = (
    (ServiceError, service_error), (CodecError, _codec_error),
    (RequestValidationError, _framework_validation), (StarletteHTTPException, _framework_http))


async def mapped_error(request: Request, exc: Exception) -> Response | None:
    """The map's response to `exc`, None for an exception it does not map (for a route
    served outside FastAPI's routing, `api/direct.py`; the same handlers as the app's)."""
    for kind, handler in _MAPPED:
        if isinstance(exc, kind):
            response: Response = await handler(request, exc)
            return response
    return None


def install_error_map(app: FastAPI) -> None:
    """Register the map on `app`, and contain what it does not map (`ContainErrors`:
    a 500 that keeps the connection). Call it before any other middleware is added:
    each one added later wraps it (auth answers its 401 outside it), and ContainErrors
    stays the innermost, right around the routes."""
    app.add_middleware(ContainErrors, on_error=lambda: count_error(app.state, "internal_error"))
    app.exception_handler(Exception)(_unexpected)
    for kind, handler in _MAPPED:
        app.exception_handler(kind)(handler)
