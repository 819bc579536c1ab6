"""The Anthropic Messages dialect: `POST /sessions/{sid}/v1/messages` and
`/v1/messages/count_tokens`, for agents built on the `anthropic` SDK (Claude Code).

Request -> `ChatRequest` (the pipeline's input, the same one chat completions
produces), so both dialects write the same trajectory and a session may mix them:

    system (string or text blocks)        -> a leading `system` message
    a `system` message in `messages` (Claude Code's beta `mid-conversation-system-...`:
    string or text blocks)               -> a `system` message at that position
    user text blocks                      -> a `user` message (one block: its string)
    user tool_result blocks               -> `tool` messages (`tool_call_id` = `tool_use_id`),
                                             in order, before the user text that follows
    assistant thinking blocks             -> `reasoning_content` (joined)
    assistant text blocks                 -> `content` (joined)
    assistant tool_use blocks             -> `tool_calls` (id kept; `input` -> JSON `arguments`)
    tools [{name, description, input_schema}] -> OpenAI function tools
    tool_choice auto | any | tool | none  -> "auto" | "required" | named function | "none"
    stop_sequences, max_tokens, temperature, top_p, top_k -> the same sampling fields
    thinking enabled | disabled           -> chat_template_kwargs.enable_thinking True | False
                                             (adaptive: the template's default)
    output_config.format json_schema      -> response_format json_schema (structured output:
                                             the engine's constrained decoding; Claude Code's
                                             title side-request uses it)

A committed turn -> a `message`: content `[thinking?, text?, tool_use...]` in the
order the model wrote them (Qwen3-style reasoning comes first), which maps back to
exactly the stored assistant message, so the client's next request attaches to the
history (`trajectory.messages.match_returned`).

Thinking signatures: Anthropic's `ThinkingBlock.signature` is "an opaque field ...
pass them back exactly as received" (anthropic SDK `types/thinking_block.py`). Ours
is a digest of the thinking text (`_signature`): the same for a body and a stream of
one turn, and it is only passed through: the history match compares the thinking
text itself, which is what the model saw. `redacted_thinking` carries Anthropic's
encrypted reasoning that no template can render: refused with a 400.

Errors on these routes use Anthropic's shape `{"type": "error", "error": {"type",
"message"}}` with our HTTP status (`error_body`; types from
https://docs.claude.com/en/api/errors and the SDK's `types/shared/error_type.py`).
It keeps our `error.type`/`error.message` keys, so a client of our envelope reads it too.

The request models and the mapping above live in `anthropic_messages_request.py`;
this module is the dialect the routes call, and what a turn answers (body, stream,
errors).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import orjson

from ...errors import InternalInvariant, ServiceError
from ...turn.chat_request import ChatRequest
from ...turn.pipeline import TurnOutput
from ...turn.stream_events import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    TokensDelta,
    ToolArgumentsDelta,
    ToolCallStarted,
    TurnCommitted,
    TurnFailed,
    TurnStarted,
    replay,
)
from ..models import parse_json_model
from .anthropic_messages_request import CountTokensRequest, MessagesRequest, to_chat_request

__all__ = ["ANTHROPIC_MESSAGES", "AnthropicMessages", "MessagesRequest", "error_body", "owns_path"]

_MODEL = "tito-session"
MESSAGES_PATH_SUFFIXES = ("/v1/messages", "/v1/messages/count_tokens")


# -- committed turn -> message ----------------------------------------------------------


def _signature(thinking: str) -> str:
    """Our thinking signature: opaque to the client, the same for a body and a stream."""
    return base64.b64encode(hashlib.sha256(b"tito-thinking-v1\0" + thinking.encode()).digest()).decode()


def _input(arguments: Any) -> dict[str, Any]:
    """A committed call's arguments as the `tool_use.input` object. The parser accepted
    them as a JSON object; anything else is our bug, not the client's."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(value, dict):
        raise InternalInvariant(f"committed tool call arguments are not a JSON object: {arguments!r}")
    return value


def stop_reason(out: TurnOutput, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of `StopReason` (types/stop_reason.py) from our finish:
    tool_calls -> tool_use; length -> max_tokens; stop -> stop_sequence when the engine
    matched one of the request's stop strings, else end_turn; abort (the engine cut the
    turn short) -> max_tokens: the output is incomplete, as on a length cut."""
    if out.finish_reason == "tool_calls":
        return "tool_use", None
    if out.finish_reason in ("length", "abort"):
        return "max_tokens", None
    if isinstance(out.matched_stop, str) and out.matched_stop in stops:
        return "stop_sequence", out.matched_stop
    return "end_turn", None


def _usage(out: TurnOutput) -> dict[str, int]:
    """Anthropic counts cached input apart: total input = input_tokens +
    cache_creation_input_tokens + cache_read_input_tokens (types/usage.py)."""
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens,
        "output_tokens": out.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": out.cached_tokens,
    }


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": _signature(reasoning)})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for tc in message.get("tool_calls") or []:
        fn = tc["function"]
        blocks.append({"type": "tool_use", "id": tc["id"], "name": fn["name"], "input": _input(fn.get("arguments"))})
    return blocks


def message_body(out: TurnOutput, *, model: str | None, stops: tuple[str, ...]) -> bytes:
    reason, sequence = stop_reason(out, stops)
    return orjson.dumps({
        "id": f"msg_{out.request_id}",
        "type": "message",
        "role": "assistant",
        "model": model or _MODEL,
        "content": content_blocks(out.message),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(out),
    })


# -- stream -----------------------------------------------------------------------------


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps({"type": event, **data}) + b"\n\n"


class MessagesStreamEncoder:
    """One turn as Anthropic's SSE event sequence: `message_start`, `ping`, then per
    content block `content_block_start`, its deltas (`thinking_delta` and a closing
    `signature_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, then
    `message_delta` (stop_reason, usage) and `message_stop`; a failure is an `error`
    event. A new block opens whenever the kind of delta changes, so live events that
    interleave reasoning and content stream as the blocks a body would list."""

    def __init__(self, *, model: str | None, stops: tuple[str, ...]) -> None:
        self._model, self._stops = model or _MODEL, stops
        self._index = -1  # the open block's index; -1: none yet
        self._open: str | None = None  # "thinking" | "text" | "tool:<call index>"
        self._thinking: list[str] = []

    def _start(self, key: str, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._index += 1
        self._open = key
        return [*frames, _sse("content_block_start", {"index": self._index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"index": self._index, "delta": delta})

    def keepalive(self) -> bytes:
        """Anthropic's own keep-alive, `ping` (docs.claude.com streaming: "Event streams
        may also include any number of ping events"): the SDKs skip it."""
        return _sse("ping", {})

    def opening(self, request_id: str) -> list[bytes]:
        """Nothing: a `ping` may come before `message_start` (the anthropic SDKs drop every
        `ping` before parsing events: `anthropic/_streaming.py`), and `message_start`
        must carry the prompt's token count, unknown until the turn is rendered."""
        return []

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            sig = _signature("".join(self._thinking))
            frames.append(self._delta({"type": "signature_delta", "signature": sig}))
            self._thinking = []
        self._open = None
        return [*frames, _sse("content_block_stop", {"index": self._index})]

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TurnStarted):
            message: dict[str, Any] = {
                "id": f"msg_{event.request_id}", "type": "message", "role": "assistant", "model": self._model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": event.prompt_tokens, "output_tokens": 0},
            }
            return [_sse("message_start", {"message": message}), _sse("ping", {})]
        if isinstance(event, TokensDelta):
            return []  # Anthropic's stream carries no token ids or logprobs
        if isinstance(event, ReasoningDelta):
            frames = [] if self._open == "thinking" else self._start(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(event.text)
            return [*frames, self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ContentDelta):
            frames = [] if self._open == "text" else self._start("text", {"type": "text", "text": ""})
            return [*frames, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallStarted):
            return self._start(f"tool:{event.index}",
                               {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolArgumentsDelta):
            if self._open != f"tool:{event.index}":
                raise InternalInvariant(f"arguments of tool call {event.index} outside its block")
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        if isinstance(event, TurnCommitted):
            reason, sequence = stop_reason(event.out, self._stops)
            delta = {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": _usage(event.out)}
            return [*self._close(), _sse("message_delta", delta), _sse("message_stop", {})]
        assert isinstance(event, TurnFailed)
        return [_sse("error", {"error": {"type": anthropic_error_type(event.status), "message": event.message}})]


# -- errors -----------------------------------------------------------------------------

# https://docs.claude.com/en/api/errors: 400 invalid_request_error ("also ... other 4XX
# status codes not listed"), 401 authentication_error, 403 permission_error, 404
# not_found_error, 413 request_too_large, 429 rate_limit_error, 500 api_error, 529
# overloaded_error; the SDK's `ErrorType` adds timeout_error (504) and conflict_error (409)
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    502: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_body(exc: ServiceError) -> dict[str, Any]:
    """Our error in Anthropic's shape, the status unchanged; our own kind stays readable
    as `error.code` (e.g. `session_busy`, `history_mismatch`)."""
    return {"type": "error",
            "error": {"type": anthropic_error_type(exc.status), "message": exc.message, "code": exc.type}}


def owns_path(path: str) -> bool:
    """Whether an error on `path` is answered in this dialect's shape (its two routes)."""
    return path.startswith("/sessions/") and path.endswith(MESSAGES_PATH_SUFFIXES)


# -- the dialect ------------------------------------------------------------------------


class AnthropicMessages:
    """`POST .../v1/messages`: Anthropic's request in, a `message` (or its event stream) out."""

    name = "anthropic_messages"
    request_model = MessagesRequest

    def parse(self, body: bytes) -> ChatRequest:
        req: MessagesRequest = parse_json_model(body, MessagesRequest)
        return to_chat_request(req)

    def parse_count(self, body: bytes) -> ChatRequest:
        """A count_tokens body: the same mapping; `max_tokens` is not part of it."""
        req: CountTokensRequest = parse_json_model(body, CountTokensRequest)
        return to_chat_request(req)

    def body(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> bytes:
        return message_body(out, model=req.model, stops=req.stop_list())

    def encoder(self, req: ChatRequest, tokenizer: Any) -> MessagesStreamEncoder:
        return MessagesStreamEncoder(model=req.model, stops=req.stop_list())

    def stream(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> list[bytes]:
        enc = self.encoder(req, tokenizer)
        return [f for ev in replay(out) for f in enc.encode(ev)]


ANTHROPIC_MESSAGES = AnthropicMessages()
