"""A committed turn as the OpenAI Responses dialect answers it: the `response` object
and its output items, and the Responses SSE events of a live turn.

The response side of `openai_responses.py`: it reads a `TurnOutput` (or the turn's
stream events) and the request's `Echo`, and writes the shapes of the `openai` SDK's
`openai/types/responses/` (`Response`, `ResponseReasoningItem`,
`ResponseOutputMessage`, `ResponseFunctionToolCall`, `ResponseUsage`, the
`Response*Event`s, each with its `sequence_number`). Kept apart from the request
side (`openai_responses_request.py`) so each stays one job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from trajectory.codec.probe import decode_text

from ...turn.chat_request import ChatRequest
from ...turn.pipeline import TurnOutput
from ...turn.stream_events import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    ToolArgumentsDelta,
    ToolCallStarted,
    TurnCommitted,
    TurnFailed,
    TurnStarted,
)
from .openai_chat import logprobs_content
from .openai_responses_request import _MODEL, Echo, ResponsesTurn, encode_reasoning

_THINK_END = "</think>"


@dataclass(frozen=True)
class Outcome:
    """What a committed turn puts in its response object: kept per stored response for
    `GET .../responses/{id}` (no ids or logprobs: those live in the trajectory)."""

    request_id: str
    message: dict[str, Any]
    finish_reason: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    text_logprobs: tuple[dict[str, Any], ...] = ()  # output_text's, when asked (never stored)


@dataclass(frozen=True)
class StoredResponse:
    """A response of this session: where its turn is in the tree, and its object's parts."""

    echo: Echo
    outcome: Outcome
    branch_id: int
    turn_index: int


# -- committed turn -> response object ---------------------------------------------------


def _reasoning_tokens(out: TurnOutput, tokenizer: Any) -> int:
    """Sampled tokens before the think block's end (`</think>`, one special token in
    the thinking families); 0 when the turn did not reason or has no such token."""
    if not out.message.get("reasoning_content"):
        return 0
    try:
        end = tokenizer.convert_tokens_to_ids(_THINK_END)
    except Exception:  # a tokenizer without the method: count nothing rather than fail a turn
        return 0
    ids = out.sampled_ids
    return ids.index(end) + 1 if isinstance(end, int) and end in ids else 0


def text_logprobs(out: TurnOutput, tokenizer: Any, top_k: int) -> tuple[dict[str, Any], ...]:
    """The logprobs of `output_text`'s tokens (`Logprob`: token, bytes, logprob,
    top_logprobs): the sampled tokens after the reasoning block whose text spells the
    message's content (whitespace-only tokens before it skipped; from where it ends on,
    a tool call or the end-of-turn token, left out). The end is found by bisection on
    the decoded length (O(log n) decodes; a character split across tokens decodes
    whole). Empty when no such run of tokens decodes to exactly the content: no guess."""
    content = str(out.message.get("content") or "").strip()
    if not content:
        return ()
    start = _reasoning_tokens(out, tokenizer)
    tops = out.top_logprobs[start:] if out.top_logprobs is not None else None
    entries = logprobs_content(out.sampled_ids[start:], out.logprobs[start:], tops, tokenizer, top_k)
    lead = next((i for i, e in enumerate(entries) if e["token"].strip()), len(entries))
    ids = out.sampled_ids[start + lead:]
    lo, hi = 1, len(ids)
    while lo < hi:  # the fewest tokens whose text is as long as the content
        mid = (lo + hi) // 2
        if len(decode_text(tokenizer, ids[:mid]).strip()) >= len(content):
            hi = mid
        else:
            lo = mid + 1
    for n in range(lo, min(lo + 4, len(ids) + 1)):  # a split last character needs its last bytes
        if decode_text(tokenizer, ids[:n]).strip() == content:
            return tuple(entries[lead:lead + n])
    return ()


def outcome(out: TurnOutput, tokenizer: Any, echo: Echo | None = None) -> Outcome:
    """A committed turn's response parts; with `echo`, the output_text logprobs it asked for."""
    lps = text_logprobs(out, tokenizer, echo.top_logprobs or 0) if echo is not None and echo.logprobs else ()
    return Outcome(out.request_id, out.message, out.finish_reason, out.prompt_tokens, out.completion_tokens,
                   out.cached_tokens, _reasoning_tokens(out, tokenizer), lps)


def response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def reasoning_item(rid: str, text: str, *, encrypted: bool, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": encode_reasoning(text) if encrypted else None, "status": status}


def message_item(rid: str, text: str, status: str = "completed",
                 logprobs: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}]}


def call_item(rid: str, index: int, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{rid}_{index}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(o: Outcome, echo: Echo) -> list[dict[str, Any]]:
    """The committed assistant message as output items: reasoning, message, calls (the
    order a live stream opens them). A turn without calls always has a message."""
    msg, rid = o.message, o.request_id
    status = "incomplete" if o.finish_reason in ("length", "abort") else "completed"  # abort: cut short
    items = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(rid, str(msg["reasoning_content"]), encrypted=echo.encrypted_reasoning))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        items.append(message_item(rid, str(msg.get("content") or ""), status, o.text_logprobs))
    for i, tc in enumerate(calls):
        fn = tc.get("function") or {}
        args = fn.get("arguments", "")
        items.append(call_item(rid, i, str(tc.get("id", "")), str(fn.get("name", "")),
                               args if isinstance(args, str) else orjson.dumps(args).decode()))
    return items


def usage(o: Outcome) -> dict[str, Any]:
    return {"input_tokens": o.input_tokens, "output_tokens": o.output_tokens,
            "total_tokens": o.input_tokens + o.output_tokens,
            "input_tokens_details": {"cached_tokens": o.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": o.reasoning_tokens}}


def response_object(rid: str, echo: Echo, *, status: str, output: list[dict[str, Any]],
                    o: Outcome | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `Response` (`openai/types/responses/response.py`) in any state."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id(rid), "object": "response", "created_at": echo.created_at, "status": status,
        "error": error, "incomplete_details": incomplete, "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens, "model": echo.model, "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls, "previous_response_id": echo.previous_response_id,
        "reasoning": echo.reasoning, "store": echo.store, "temperature": echo.temperature,
        "text": echo.text or {"format": {"type": "text"}}, "tool_choice": echo.tool_choice, "tools": echo.tools,
        "top_p": echo.top_p, "top_logprobs": echo.top_logprobs, "truncation": "disabled", "usage": usage(o) if o is not None else None,
        "metadata": echo.metadata,
    }


def final_object(o: Outcome, echo: Echo) -> dict[str, Any]:
    status = "incomplete" if o.finish_reason in ("length", "abort") else "completed"  # abort: cut short
    return response_object(o.request_id, echo, status=status, output=output_items(o, echo), o=o)


def echo_of(req: ChatRequest) -> Echo:
    return req.echo if isinstance(req, ResponsesTurn) else Echo(created_at=int(time.time()), model=req.model or _MODEL)


# -- stream events -> Responses SSE ------------------------------------------------------


class ResponsesStreamEncoder:
    """One turn as Responses SSE events (`event: NAME` + `data: {..., sequence_number}`):
    `response.created`, `response.in_progress`; per output item `output_item.added`, its
    content part, the text / reasoning / argument deltas, their `.done`s and
    `output_item.done` (an item closes when the next opens, the last at commit);
    `response.completed` (or `response.incomplete`) with the same object the JSON body
    has. A failure is an `error` event, then `response.failed` when the response began."""

    def __init__(self, echo: Echo, tokenizer: Any) -> None:
        self._echo, self._tokenizer = echo, tokenizer
        self._seq = 0
        self._rid: str | None = None
        self._items: list[dict[str, Any]] = []  # streamed items, in output order (text accumulated)
        self._open: int | None = None  # output index of the item whose deltas flow
        self._calls: dict[int, int] = {}  # tool-call index -> output index
        self._started: dict[str, Any] | None = None  # the in-progress response object, once started

    def _event(self, kind: str, /, **data: Any) -> bytes:
        payload = orjson.dumps({"type": kind, "sequence_number": self._seq, **data})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._items.append(item)
        self._open = idx = len(self._items) - 1
        frames.append(self._event("response.output_item.added", output_index=idx, item=_in_progress(item)))
        part = _part(item)
        if part is not None:
            frames.append(self._event("response.content_part.added", item_id=item["id"], output_index=idx,
                                      content_index=0, part=part))
        return frames

    def _close(self, final: dict[str, Any] | None = None) -> list[bytes]:
        """The open item's `.done` events (`final`: the committed item, at the end)."""
        if self._open is None:
            return []
        idx, self._open = self._open, None
        item = final or self._finished(self._items[idx])
        self._items[idx] = item
        ids = {"item_id": item["id"], "output_index": idx}
        frames = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            frames.append(self._event("response.reasoning_text.done", **ids, content_index=0, text=text))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            frames.append(self._event("response.output_text.done", **ids, content_index=0, text=text,
                                      logprobs=item["content"][0]["logprobs"]))
        else:
            frames.append(self._event("response.function_call_arguments.done", **ids, name=item["name"],
                                      arguments=item["arguments"]))
        part = _part(item, done=True)
        if part is not None:
            frames.append(self._event("response.content_part.done", **ids, content_index=0, part=part))
        frames.append(self._event("response.output_item.done", output_index=idx, item=item))
        return frames

    def _finished(self, item: dict[str, Any]) -> dict[str, Any]:
        """A streamed item closed before the commit (the next item began): as committed."""
        if item["type"] == "reasoning":
            return reasoning_item(self._rid or "", item["content"][0]["text"], encrypted=self._echo.encrypted_reasoning)
        return {**item, "status": "completed"}

    def _current(self, kind: str) -> dict[str, Any] | None:
        return self._items[self._open] if self._open is not None and self._items[self._open]["type"] == kind else None

    def keepalive(self) -> bytes:
        """`response.in_progress` again: an event the Responses clients know and pass
        over (the openai SDK types it, Codex ignores it), and an event is what Codex's
        `stream_idle_timeout_ms` waits for (an SSE comment never reaches it)."""
        if self._started is None:
            return b": keep-alive\n\n"
        return self._event("response.in_progress", response=self._started)

    def opening(self, request_id: str) -> list[bytes]:
        """`response.created` and `response.in_progress` now, for the turn to come
        (`request_id` is its id): the keep-alives after them are events Codex counts, and
        no client sees an event before `response.created` (the openai SDK's stream
        helper raises on one: `Expected to have received response.created`). The turn's
        `TurnStarted` then adds nothing."""
        return self.encode(TurnStarted(request_id, 0))

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TurnStarted):
            if self._rid == event.request_id:  # opened already (`opening`)
                return []
            self._rid = event.request_id
            obj = response_object(event.request_id, self._echo, status="in_progress", output=[])
            self._started = obj
            return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]
        rid = self._rid or ""
        if isinstance(event, ReasoningDelta):
            frames = [] if self._current("reasoning") else self._open_item(
                reasoning_item(rid, "", encrypted=False, status="in_progress"))
            item = self._items[self._open or 0]
            item["content"][0]["text"] += event.text
            frames.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                      output_index=self._open, content_index=0, delta=event.text))
            return frames
        if isinstance(event, ContentDelta):
            frames = [] if self._current("message") else self._open_item(message_item(rid, "", "in_progress"))
            item = self._items[self._open or 0]
            item["content"][0]["text"] += event.text
            frames.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                                      content_index=0, delta=event.text, logprobs=[]))
            return frames
        if isinstance(event, ToolCallStarted):
            frames = self._open_item(call_item(rid, event.index, event.id, event.name, "", "in_progress"))
            self._calls[event.index] = len(self._items) - 1
            return frames
        if isinstance(event, ToolArgumentsDelta):
            idx = self._calls[event.index]
            self._items[idx]["arguments"] += event.text
            return [self._event("response.function_call_arguments.delta", item_id=self._items[idx]["id"],
                                output_index=idx, delta=event.text)]
        if isinstance(event, TurnCommitted):
            return self._finish(outcome(event.out, self._tokenizer, self._echo))
        if isinstance(event, TurnFailed):
            return self._fail(event)
        return []  # TokensDelta: ids and logprobs stay in the trajectory

    def _finish(self, o: Outcome) -> list[bytes]:
        """Close what is open with its committed form, send (added + done) any item the
        deltas did not open (an empty answer), then the terminal event."""
        final = final_object(o, self._echo)
        items = final["output"]
        frames = self._close(items[self._open]) if self._open is not None and self._open < len(items) else self._close()
        for item in items[len(self._items):]:
            frames += self._open_item(item)
            frames += self._close(item)
        final["output"] = items
        name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return frames + [self._event(name, response=final)]

    def _fail(self, event: TurnFailed) -> list[bytes]:
        frames = [self._event("error", code=event.type, message=event.message, param=None)]
        if self._rid is not None:
            obj = response_object(self._rid, self._echo, status="failed", output=self._items,
                                  error={"code": "server_error", "message": event.message})
            frames.append(self._event("response.failed", response=obj))
        return frames


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    """An item as `output_item.added` shows it: no content yet."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "reasoning":
        return {**item, "status": "in_progress", "content": [], "encrypted_content": None}
    return {**item, "status": "in_progress", "arguments": ""}


def _part(item: dict[str, Any], *, done: bool = False) -> dict[str, Any] | None:
    if item["type"] == "message":
        return {"type": "output_text", "text": item["content"][0]["text"] if done else "", "annotations": [],
                "logprobs": []}
    if item["type"] == "reasoning":
        return {"type": "reasoning_text", "text": item["content"][0]["text"] if done else ""}
    return None
