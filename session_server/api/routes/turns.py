"""The turn routes: chat completions, Anthropic Messages (and its token count), OpenAI
Responses, each under its session. Thin on purpose: every turn goes through
`TurnEndpoint` (`api/turn_endpoint.py`), which the app builds at its start."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..dialects import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES
from ..dialects import anthropic_messages as anthropic
from ..edge import route_doc
from ..turn_endpoint import TurnEndpoint
from .common import ctx_of

__all__ = ["DIRECT", "router"]

router = APIRouter()

_MEDIA = ("application/json", "text/event-stream")
_TURN_ERRORS = (400, 404, 409, 413, 429, 502, 503, 504)


def _turns(request: Request) -> TurnEndpoint:
    endpoint: TurnEndpoint = request.app.state.turns
    return endpoint


@router.post("/sessions/{sid}/v1/chat/completions", **route_doc(OPENAI_CHAT.request_model, *_TURN_ERRORS, media=_MEDIA))
async def chat(sid: str, request: Request) -> Response:
    return await _turns(request).handle(sid, request, OPENAI_CHAT)


@router.post("/sessions/{sid}/v1/messages", **route_doc(ANTHROPIC_MESSAGES.request_model, *_TURN_ERRORS, media=_MEDIA))
async def messages(sid: str, request: Request) -> Response:
    return await _turns(request).handle(sid, request, ANTHROPIC_MESSAGES)


@router.post("/sessions/{sid}/v1/messages/count_tokens", **route_doc(anthropic.CountTokensRequest, 400, 404, 413))
async def count_tokens(sid: str, request: Request) -> Response:
    return await _turns(request).count_tokens(sid, request, ANTHROPIC_MESSAGES.parse_count)


@router.post("/sessions/{sid}/v1/responses", **route_doc(OPENAI_RESPONSES.request_model, *_TURN_ERRORS, media=_MEDIA))
async def responses(sid: str, request: Request) -> Response:
    return await _turns(request).handle(sid, request, OPENAI_RESPONSES)


@router.get("/sessions/{sid}/v1/responses/{response_id}", **route_doc(None, 404))
async def get_response(sid: str, response_id: str, request: Request) -> Response:
    """A stored Responses object of this session (`previous_response_id` names one)."""
    store = ctx_of(request).store
    s = store.get(sid)
    store.touch(s)
    return Response(content=OPENAI_RESPONSES.stored_body(s, response_id), media_type=_MEDIA[0])


DIRECT: dict[str, Callable[[str, Request], Awaitable[Response]]] = {
    "chat/completions": chat,
    "messages": messages,
    "messages/count_tokens": count_tokens,
    "responses": responses,
}
"""The POST routes above by their path after `/sessions/{sid}/v1/`: `api/direct.py` serves
them without FastAPI's routing (the hot path), calling these same functions."""
