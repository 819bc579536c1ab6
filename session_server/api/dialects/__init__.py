"""Client API dialects: one module per API a client speaks (today OpenAI chat
completions, `openai_chat.py`; OpenAI Responses, `openai_responses.py`). The turn pipeline between them (`turns.py`) is shared:

    body --dialect.parse--> ChatRequest --pipeline--> TurnOutput --dialect.body / .stream--> bytes

A dialect is three pure functions (run on the offload threads when large) and its
request model for the OpenAPI document; `respond` here is the respond phase every
dialect shares: offloading, the response type, and the `respond` phase timer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from ...context import ServerContext
from ...turns import TurnOutput
from ..models import ChatRequest
from ..stream_events import StreamEncoder
from .openai_chat import OPENAI_CHAT, OpenAIChat
from .openai_responses import OPENAI_RESPONSES, OpenAIResponses

__all__ = ["OPENAI_CHAT", "OPENAI_RESPONSES", "Dialect", "OpenAIChat", "OpenAIResponses", "respond"]


class Dialect(Protocol):
    """What a dialect gives the app: its request model, parse, and the two response shapes."""

    @property
    def name(self) -> str: ...

    @property
    def request_model(self) -> type[BaseModel]:
        """The request's pydantic model, declared in the OpenAPI document."""
        ...

    def parse(self, body: bytes) -> ChatRequest:
        """The request body as the pipeline's input; bad input raises `BadRequest`."""
        ...

    def body(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> bytes:
        """A committed turn as one JSON response body."""
        ...

    def encoder(self, req: ChatRequest, tokenizer: Any) -> StreamEncoder:
        """A new encoder of one turn's stream events (`api/stream_events.py`) into this
        dialect's SSE frames: fed by `replay` of a committed turn, or live."""
        ...

    def stream(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> list[bytes]:
        """A committed turn as server-sent-event frames (its `replay` through `encoder`)."""
        ...


async def respond(ctx: ServerContext, dialect: Dialect, req: ChatRequest, out: TurnOutput) -> Response:
    """The respond phase (timed as `respond`): a JSON body, or an SSE stream when asked."""
    t0 = time.perf_counter()
    # per-token logprobs make a response proportional to the output: offloaded; else inline
    size = len(out.sampled_ids) * 64 if req.logprobs else 0
    response: Response
    if req.stream:
        frames = await ctx.offload.run_sized(size, dialect.stream, out, req, ctx.tokenizer)
        response = StreamingResponse(_frames(frames), media_type="text/event-stream")
    else:
        payload = await ctx.offload.run_sized(size, dialect.body, out, req, ctx.tokenizer)
        response = Response(content=payload, media_type="application/json")
    ctx.metrics.observe_phase("respond", time.perf_counter() - t0)
    return response


async def _frames(frames: list[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield f
