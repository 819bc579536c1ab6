"""What a streamed turn says, independent of the client's API.

A turn streams as a sequence of typed events; each dialect (`api/dialects/`) has a
`StreamEncoder` that turns them into its own SSE frames (chat completions chunks,
Anthropic message events, Responses events). The same events come from two places:

- `replay(out)`: a turn already committed (today's `stream: true`, and a retried
  request answered from the stored response), one event per message part;
- the engine's own stream (real streaming): deltas as they are sampled, parsed
  incrementally, and `TurnCommitted` only after the whole turn validated and
  committed, or `TurnFailed` (nothing committed) instead.

Invariant a dialect may rely on: for one turn, the concatenation of the
`ReasoningDelta`s is the committed message's `reasoning_content`, of the
`ContentDelta`s its `content`, and of each tool call's `ToolArgumentsDelta`s its
`arguments` (a call's `ToolCallStarted.id` is the committed call's id); `TurnCommitted`
comes last, or `TurnFailed` does. A call's `ToolArgumentsDelta`s come before any later
call's `ToolCallStarted`.

One exception, live streams only: a tool call streamed while sampled that the final
parse reads differently (cut at max_tokens mid-call, malformed JSON or a duplicate key
later in the call, text after it) is not a failure: the tokens are the truth, the turn
is committed as parsed and `TurnCommitted` follows. Then that call's `ToolCallStarted`
and deltas (and any later call streamed) may not be in the committed message, or may
not concatenate to its `arguments`; every field not yet sent is still sent as the
committed message has it (its content tail, which then carries the raw markup); the
turn record's `extra.stream_tool_divergence` is true and `tito_stream_tool_divergence_total`
counts it. `TurnCommitted.out.message` is the truth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .output import TurnOutput


@dataclass(frozen=True)
class TurnStarted:
    """The turn was accepted and routed; the first frame a dialect sends."""

    request_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class TokensDelta:
    """Sampled ids and their logprobs (a dialect that reports logprobs sends them; text
    comes separately, parsed). Live: per engine chunk; replay: all at once."""

    ids: Sequence[int]
    logprobs: Sequence[float]
    top_logprobs: Sequence[Any] | None = None


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    """A tool call begins: its index in the message, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgumentsDelta:
    """More of tool call `index`'s arguments (a JSON text, concatenated in order)."""

    index: int
    text: str


@dataclass(frozen=True)
class TurnCommitted:
    """The whole turn validated and committed; carries what the final frames report."""

    out: TurnOutput


@dataclass(frozen=True)
class TurnFailed:
    """The turn ended without a commit (a chunk failed validation, the engine failed):
    the dialect sends its error event. `type`/`message`/`status` are our error envelope's."""

    type: str
    message: str
    status: int


StreamEvent = (
    TurnStarted | TokensDelta | ReasoningDelta | ContentDelta | ToolCallStarted | ToolArgumentsDelta | TurnCommitted | TurnFailed
)


class StreamEncoder(Protocol):
    """One turn's SSE encoder of one dialect: events in, frames out, in order."""

    def encode(self, event: StreamEvent) -> list[bytes]:
        """The frames for `event` (possibly none: e.g. a dialect that sends usage only at the end)."""
        ...

    def keepalive(self) -> bytes:
        """A frame that says nothing about the turn but that the dialect's clients read
        as traffic: sent when the stream was silent `keepalive_s` (a pause, a long
        constrained sample), so idle watchdogs that count events, not bytes, see one."""
        ...

    def opening(self, request_id: str) -> list[bytes]:
        """The frames of a response that begins before its turn starts (a request queued
        for its session, see `live.py`): what the dialect's clients need first for its
        keep-alives to count (Responses: `response.created`, as `TurnStarted` would send
        it, which then sends nothing); none where a keep-alive may come first."""
        ...


def replay(out: TurnOutput) -> list[StreamEvent]:
    """A committed turn as the events a live stream of it would have sent."""
    msg: dict[str, Any] = out.message
    events: list[StreamEvent] = [
        TurnStarted(out.request_id, out.prompt_tokens),
        TokensDelta(out.sampled_ids, out.logprobs, out.top_logprobs),
    ]
    if msg.get("reasoning_content"):
        events.append(ReasoningDelta(str(msg["reasoning_content"])))
    if msg.get("content"):
        events.append(ContentDelta(str(msg["content"])))
    for i, tc in enumerate(msg.get("tool_calls") or []):
        fn = tc.get("function") or {}
        events.append(ToolCallStarted(i, str(tc.get("id", "")), str(fn.get("name", ""))))
        args = fn.get("arguments")
        if args:
            events.append(ToolArgumentsDelta(i, str(args)))
    events.append(TurnCommitted(out))
    return events
