"""The OpenAI chat-completions dialect: request body -> `ChatRequest`, and a committed
turn -> a `chat.completion` JSON body, or stream events (`api/stream_events.py`) -> SSE
`chat.completion.chunk` frames.

All three are pure; the shared respond phase (`dialects.render`) runs them on the
CPU offload threads when large: a response carries per-token logprobs when asked,
which is proportional to the turn's output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from trajectory.codec.probe import decode_text

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
    TurnStarted,
    replay,
)
from ..models import parse_json_model

_MODEL = "tito-session"


def logprobs_content(
    ids: Sequence[int], logprobs: Sequence[float], top_logprobs: Sequence[Any] | None, tokenizer: Any, top_k: int
) -> list[dict[str, Any]]:
    """OpenAI's per-token entries (token, logprob, bytes, top_logprobs): chat's
    `logprobs.content` and Responses' `output_text.logprobs`."""
    content = []
    for i, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
        text = decode_text(tokenizer, [tid])
        top: list[dict[str, Any]] = []
        if top_k and top_logprobs is not None and i < len(top_logprobs):
            for alt_id, alt_lp in list(top_logprobs[i])[:top_k]:
                alt_text = decode_text(tokenizer, [int(alt_id)])
                top.append({"token": alt_text, "logprob": float(alt_lp), "bytes": list(alt_text.encode())})
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
    return content


def _usage(out: TurnOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def completion_body(out: TurnOutput, *, model: str | None, logprobs: bool, top_k: int, tokenizer: Any) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "message": out.message,
        "logprobs": {"content": logprobs_content(out.sampled_ids, out.logprobs, out.top_logprobs, tokenizer, top_k)}
        if logprobs else None,
        "finish_reason": out.finish_reason,
    }
    body = {
        "id": f"chatcmpl-{out.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model or _MODEL,
        "choices": [choice],
        "usage": _usage(out),
    }
    return orjson.dumps(body)


class ChatStreamEncoder:
    """One turn as `chat.completion.chunk` SSE frames, the way OpenAI streams them: the
    role first, then reasoning / content deltas, each tool call's id and name and then
    its argument deltas, the finish reason, a usage chunk (`choices: []`) and `[DONE]`.
    Logprobs ride on their own chunk per `TokensDelta` (16.6: a tool-only turn has
    them too); an error is `data: {"error": ...}` then `[DONE]`."""

    def __init__(self, *, model: str | None, logprobs: bool, top_k: int, tokenizer: Any) -> None:
        self._logprobs, self._top_k, self._tokenizer = logprobs, top_k, tokenizer
        self._base: dict[str, Any] = {"object": "chat.completion.chunk", "created": int(time.time()),
                                      "model": model or _MODEL}

    def _frame(self, delta: dict[str, Any], finish: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if extra:
            choice.update(extra)
        return b"data: " + orjson.dumps({**self._base, "choices": [choice]}) + b"\n\n"

    def keepalive(self) -> bytes:
        """An SSE comment: chat chunk parsers (the openai SDK, litellm) skip it, and the
        bytes reset an HTTP read timeout; a chunk would have to carry a choice."""
        return b": keep-alive\n\n"

    def opening(self, request_id: str) -> list[bytes]:
        """Nothing: an SSE comment is valid anywhere in the stream (chunk parsers skip it)."""
        return []

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TurnStarted):
            self._base = {"id": f"chatcmpl-{event.request_id}", **self._base}
            return [self._frame({"role": "assistant", "content": ""})]
        if isinstance(event, TokensDelta):
            if not self._logprobs or not event.ids:
                return []
            content = logprobs_content(event.ids, event.logprobs, event.top_logprobs, self._tokenizer, self._top_k)
            return [self._frame({}, extra={"logprobs": {"content": content}})]
        if isinstance(event, ReasoningDelta):
            return [self._frame({"reasoning_content": event.text})]
        if isinstance(event, ContentDelta):
            return [self._frame({"content": event.text})]
        if isinstance(event, ToolCallStarted):
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            return [self._frame({"tool_calls": [call]})]
        if isinstance(event, ToolArgumentsDelta):
            return [self._frame({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})]
        if isinstance(event, TurnCommitted):
            usage = b"data: " + orjson.dumps({**self._base, "choices": [], "usage": _usage(event.out)}) + b"\n\n"
            return [self._frame({}, event.out.finish_reason), usage, b"data: [DONE]\n\n"]
        error = {"error": {"type": event.type, "message": event.message, "code": event.status}}
        return [b"data: " + orjson.dumps(error) + b"\n\n", b"data: [DONE]\n\n"]


class OpenAIChat:
    """`POST .../v1/chat/completions`: OpenAI's request in, `chat.completion` out."""

    name = "openai_chat"
    request_model = ChatRequest

    def parse(self, body: bytes) -> ChatRequest:
        """orjson + pydantic; any failure is a 400 naming the problem."""
        req: ChatRequest = parse_json_model(body, ChatRequest)
        if isinstance(key := (req.model_extra or {}).get("prompt_cache_key"), str):  # api/lineage.py
            req._lineage_hints["prompt_cache_key"] = key
        return req

    def body(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> bytes:
        return completion_body(out, model=req.model, logprobs=req.logprobs, top_k=req.top_logprobs or 0,
                               tokenizer=tokenizer)

    def encoder(self, req: ChatRequest, tokenizer: Any) -> ChatStreamEncoder:
        return ChatStreamEncoder(model=req.model, logprobs=req.logprobs, top_k=req.top_logprobs or 0,
                                 tokenizer=tokenizer)

    def stream(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> list[bytes]:
        enc = self.encoder(req, tokenizer)
        return [f for ev in replay(out) for f in enc.encode(ev)]


OPENAI_CHAT = OpenAIChat()
