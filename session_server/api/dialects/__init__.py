"""Client API dialects: one module per API a client speaks (today OpenAI chat
completions). A dialect owns its request model and the respond phase; the turn
pipeline between them (`turns.py`) is shared.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel
from starlette.responses import Response

from .openai_chat import OpenAIChat, completion_body, stream_chunks

__all__ = ["Dialect", "OpenAIChat", "completion_body", "stream_chunks"]


class Dialect(Protocol):
    """What a dialect gives the app: its name, its request model, and a respond phase."""

    name: str
    request_model: type[BaseModel]

    async def respond(self, ctx: Any, req: Any, out: Any) -> Response: ...
