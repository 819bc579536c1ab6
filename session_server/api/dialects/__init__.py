"""Client API dialects: one module per API a client speaks (OpenAI chat completions,
`openai_chat.py`; Anthropic Messages, `anthropic_messages.py`; OpenAI Responses,
`openai_responses.py`). The turn pipeline between them (`turns.py`) is shared:

    body --dialect.parse--> ChatRequest --pipeline--> TurnOutput --dialect.body / .stream--> bytes

A dialect is three pure functions (run on the offload threads when large) and its
request model for the OpenAPI document; `render` here is the respond phase every
dialect shares (offloading, the `respond` phase timer) and gives bytes (`Rendered`),
which `idempotency.py` stores for replayed requests; `as_response` makes them HTTP.
A route runs its turn through the app's `dialect_turn`, which applies the replay rules.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from ...context import ServerContext
from ...turn.pipeline import TurnOutput
from ..models import ChatRequest
from ..stream_events import StreamEncoder
from .anthropic_messages import ANTHROPIC_MESSAGES, AnthropicMessages
from .openai_chat import OPENAI_CHAT, OpenAIChat
from .openai_responses import OPENAI_RESPONSES, OpenAIResponses

__all__ = ["ANTHROPIC_MESSAGES", "OPENAI_CHAT", "OPENAI_RESPONSES", "AnthropicMessages", "Dialect", "OpenAIChat",
           "OpenAIResponses", "Rendered", "as_response", "render", "respond"]


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


@dataclass(frozen=True)
class Rendered:
    """What the respond phase produced for one committed turn: a JSON body, or the SSE
    frames of a stream. Kept as bytes so that a replayed request (`idempotency.py`) gets
    exactly what the original got."""

    media_type: str
    body: bytes = b""
    frames: tuple[bytes, ...] | None = None  # set for a stream
    turn: tuple[int, int] | None = None  # the committed turn it answers (branch id, turn index)

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(f) for f in self.frames or ())


async def render(ctx: ServerContext, dialect: Dialect, req: ChatRequest, out: TurnOutput) -> Rendered:
    """The respond phase (timed as `respond`): a JSON body, or SSE frames when asked."""
    t0 = time.perf_counter()
    # per-token logprobs make a response proportional to the output: offloaded; else inline
    size = len(out.sampled_ids) * 64 if req.logprobs else 0
    rendered: Rendered
    if req.stream:
        frames = await ctx.offload.run_sized(size, dialect.stream, out, req, ctx.tokenizer)
        rendered = Rendered("text/event-stream", frames=tuple(frames))
    else:
        payload = await ctx.offload.run_sized(size, dialect.body, out, req, ctx.tokenizer)
        rendered = Rendered("application/json", body=payload)
    ctx.metrics.observe_phase("respond", time.perf_counter() - t0)
    return rendered


def as_response(rendered: Rendered) -> Response:
    """The HTTP response of a rendered turn (a fresh one per request: a replay reuses the bytes)."""
    if rendered.frames is not None:
        return StreamingResponse(_frames(rendered.frames), media_type=rendered.media_type)
    return Response(content=rendered.body, media_type=rendered.media_type)


async def respond(ctx: ServerContext, dialect: Dialect, req: ChatRequest, out: TurnOutput) -> Response:
    """The respond phase as one response: `render`, then `as_response`."""
    return as_response(await render(ctx, dialect, req, out))


async def _frames(frames: Sequence[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield f
