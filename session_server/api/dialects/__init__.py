"""Client API dialects: one module per API a client speaks (OpenAI chat completions,
`openai_chat.py`; Anthropic Messages, `anthropic_messages.py`; OpenAI Responses,
`openai_responses.py`). The turn pipeline between them (`turn/pipeline.py`) is shared:

    body --dialect.parse--> ChatRequest --pipeline--> TurnOutput --dialect.body / .stream--> bytes

A dialect is three pure functions (run on the offload threads when large) and its
request model for the OpenAPI document; `render` here is the respond phase every
dialect shares (offloading, the `respond` phase timer) and gives bytes (`Rendered`),
which the replay log (`turn/replay.py`) stores for replayed requests; `as_response`
makes them HTTP. A route runs its turn through `TurnEndpoint.handle`
(`api/turn_endpoint.py`), which applies the replay rules.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from ...context import ServerContext
from ...sessions import Session
from ...turn.chat_request import ChatRequest
from ...turn.output import Rendered, TurnOutput
from ...turn.stream_events import StreamEncoder
from .anthropic_messages import ANTHROPIC_MESSAGES, AnthropicMessages
from .openai_chat import OPENAI_CHAT, OpenAIChat
from .openai_responses import OPENAI_RESPONSES, OpenAIResponses

__all__ = ["ANTHROPIC_MESSAGES", "OPENAI_CHAT", "OPENAI_RESPONSES", "AnthropicMessages", "Dialect", "OpenAIChat",
           "OpenAIResponses", "Rendered", "SessionBound", "as_response", "render"]


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


@runtime_checkable
class SessionBound(Protocol):
    """A dialect whose requests read the session and whose turns leave it more than the
    trajectory (Responses: `previous_response_id` names a response stored here)."""

    def parser(self, session: Session, tokenizer: Any) -> Callable[[bytes], ChatRequest]:
        """`parse` bound to the session."""
        ...

    def remember(self, session: Session, req: ChatRequest, out: TurnOutput, tokenizer: Any) -> tuple[str, Any] | None:
        """Once per committed turn (not for a replay), before its response is rendered:
        what it kept in the session, as (key, value) for the journal (None: nothing)."""
        ...


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


async def _frames(frames: Sequence[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield f
