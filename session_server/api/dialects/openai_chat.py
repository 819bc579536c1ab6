"""The OpenAI chat-completions dialect: request body -> `ChatRequest`, and a committed
turn -> a `chat.completion` JSON body or SSE `chat.completion.chunk` frames.

All three are pure; the shared respond phase (`dialects.respond`) runs them on the
CPU offload threads when large: a response carries per-token logprobs when asked,
which is proportional to the turn's output.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from trajectory.codec.probe import decode_text

from ...turns import TurnOutput
from ..models import ChatRequest, parse_json_model

_MODEL = "tito-session"


def _logprobs_content(out: TurnOutput, tokenizer: Any, top_k: int) -> list[dict[str, Any]]:
    content = []
    for i, (tid, lp) in enumerate(zip(out.sampled_ids, out.logprobs, strict=True)):
        text = decode_text(tokenizer, [tid])
        top: list[dict[str, Any]] = []
        if top_k and out.top_logprobs is not None and i < len(out.top_logprobs):
            for alt_id, alt_lp in list(out.top_logprobs[i])[:top_k]:
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
        "logprobs": {"content": _logprobs_content(out, tokenizer, top_k)} if logprobs else None,
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


def stream_chunks(out: TurnOutput, *, model: str | None, logprobs: bool, top_k: int, tokenizer: Any) -> list[bytes]:
    """The whole turn as SSE frames: role, reasoning, content, tool calls, finish, usage, [DONE]."""
    base = {
        "id": f"chatcmpl-{out.request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model or _MODEL,
    }

    def frame(delta: dict[str, Any], finish: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if extra:
            choice.update(extra)
        return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"

    msg = out.message
    # every sampled token's logprob rides on the first delta, whatever the turn holds
    # (content, reasoning, tool calls only): a tool-only turn has no content frame (16.6)
    lp = {"logprobs": {"content": _logprobs_content(out, tokenizer, top_k)}} if logprobs else None
    frames = [frame({"role": "assistant", "content": ""}, extra=lp)]
    if msg.get("reasoning_content"):
        frames.append(frame({"reasoning_content": msg["reasoning_content"]}))
    if msg.get("content"):
        frames.append(frame({"content": msg["content"]}))
    for i, tc in enumerate(msg.get("tool_calls") or []):
        frames.append(frame({"tool_calls": [{"index": i, **tc}]}))
    frames.append(frame({}, out.finish_reason))
    frames.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": _usage(out)}) + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


class OpenAIChat:
    """`POST .../v1/chat/completions`: OpenAI's request in, `chat.completion` out."""

    name = "openai_chat"
    request_model = ChatRequest

    def parse(self, body: bytes) -> ChatRequest:
        """orjson + pydantic; any failure is a 400 naming the problem."""
        req: ChatRequest = parse_json_model(body, ChatRequest)
        return req

    def body(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> bytes:
        return completion_body(out, model=req.model, logprobs=req.logprobs, top_k=req.top_logprobs or 0,
                               tokenizer=tokenizer)

    def stream(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> list[bytes]:
        return stream_chunks(out, model=req.model, logprobs=req.logprobs, top_k=req.top_logprobs or 0,
                             tokenizer=tokenizer)


OPENAI_CHAT = OpenAIChat()
