"""The OpenAI model list: many clients call `/v1/models` first, globally or under a
session's base URL. The server serves exactly one model, named after its tokenizer;
any `model` a turn request names is echoed back.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...errors import NotFound
from ..edge import route_doc
from .common import ctx_of, json_response

__all__ = ["router", "served_model_name"]

router = APIRouter()

_STARTED = int(time.time())


def served_model_name(tokenizer: Any) -> str:
    """What `/v1/models` lists: the tokenizer's name or path, last component (the
    server serves exactly one model; any `model` a request names is echoed back)."""
    name = tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "name_or_path", "")
    return str(name).rstrip("/").rsplit("/", 1)[-1] or "tito-session"


def _model_name(request: Request) -> str:
    """The name `create_app` computed from its configured tokenizer."""
    name: str = request.app.state.model_name
    return name


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "tito-session-server"}


def _model_list(name: str) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(name)]}


@router.get("/v1/models", **route_doc(None))
async def list_models(request: Request) -> Response:
    return json_response(_model_list(_model_name(request)))


@router.get("/sessions/{sid}/v1/models", **route_doc(None, 404))
async def list_session_models(sid: str, request: Request) -> Response:
    ctx_of(request).store.get(sid)
    return json_response(_model_list(_model_name(request)))


@router.get("/sessions/{sid}/v1/models/{model_id:path}", **route_doc(None, 404))
async def get_session_model(sid: str, model_id: str, request: Request) -> Response:
    ctx_of(request).store.get(sid)
    name = _model_name(request)
    if model_id != name:
        raise NotFound(f"unknown model {model_id!r}; this server serves {name!r}")
    return json_response(_model_card(name))
