"""The Anthropic Messages dialect (issue 12.1): `POST /sessions/{sid}/v1/messages` and
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
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from ...errors import BadRequest, InternalInvariant, ServiceError
from ...turn.pipeline import TurnOutput
from ..models import (
    MAX_STOPS,
    ChatRequest,
    StopStr,
    TemplateKwargs,
    TimeoutS,
    Tokens,
    WeightLag,
    parse_json_model,
)
from ..stream_events import (
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

__all__ = ["ANTHROPIC_MESSAGES", "AnthropicMessages", "MessagesRequest", "error_body", "owns_path"]

_MODEL = "tito-session"
_log = logging.getLogger(__name__)
MESSAGES_PATH_SUFFIXES = ("/v1/messages", "/v1/messages/count_tokens")


class MessagesRequest(BaseModel):
    """`POST .../v1/messages` (anthropic SDK `types/message_create_params.py`).

    Fields Anthropic defines that a self-hosted model has no use for (`service_tier`,
    `container`, `cache_control`, `speed`, `output_config.effort`, `context_management`,
    ...) are accepted and
    ignored, as OpenAI's extra fields are on chat completions. `chat_template_kwargs`,
    `timeout_s` and `max_weight_lag` are our extensions, as on chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # Anthropic requires it ("max_tokens: Required[int]"); 0 (cache pre-warm) has no
    # meaning here: at least 1, as chat completions
    max_tokens: Tokens
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[StopStr] | None = Field(default=None, max_length=MAX_STOPS)
    # the API documents temperature in [0, 1]; we keep the engines' range (as chat completions)
    temperature: float | None = Field(default=None, strict=True, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, strict=True, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, strict=True, ge=1)
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # {user_id}: accepted, not used
    stream: StrictBool = False  # `"yes"`, `1` are a 400 (the SDK's `bool`), never coerced
    chat_template_kwargs: TemplateKwargs | None = None
    timeout_s: TimeoutS | None = None
    max_weight_lag: WeightLag | None = None


class CountTokensRequest(MessagesRequest):
    """`POST .../v1/messages/count_tokens`: the same body without `max_tokens`
    (anthropic SDK `types/message_count_tokens_params.py`)."""

    max_tokens: Tokens | None = None  # type: ignore[assignment]


# -- request -> ChatRequest -------------------------------------------------------------


def _text_of(block: Any, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise BadRequest(f"{where}.text must be a string")
    return str(block["text"])


def _block(block: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise BadRequest(f"{where} must be a content block object with a 'type'")
    return str(block["type"]), block


def _unsupported(kind: str, where: str) -> BadRequest:
    if kind == "redacted_thinking":
        return BadRequest(f"{where}: 'redacted_thinking' blocks hold Anthropic's encrypted reasoning, which no "
                          "chat template can render; this server never returns them, send 'thinking' blocks")
    return BadRequest(f"{where}: content block type {kind!r} is not supported (text models: 'text', "
                      "'tool_use', 'tool_result', 'thinking')")


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Top-level `system`: a string or text blocks (`Union[str, Iterable[TextBlockParam]]`)."""
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    texts = []
    for j, raw in enumerate(system):
        kind, block = _block(raw, f"system[{j}]")
        if kind != "text":
            raise BadRequest(f"system[{j}]: only 'text' blocks may form the system prompt, got {kind!r}")
        texts.append(_text_of(block, f"system[{j}]"))
    return [{"role": "system", "content": "".join(texts)}] if texts else []


def _tool_result_content(block: dict[str, Any], where: str) -> str:
    """`content: Union[str, Iterable[Content]]`; text blocks joined. `is_error` has no
    place in a chat template: the result's text (the error message) is what renders."""
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of text blocks")
    parts = []
    for k, raw in enumerate(content):
        kind, part = _block(raw, f"{where}.content[{k}]")
        if kind != "text":
            raise _unsupported(kind, f"{where}.content[{k}]")
        parts.append(_text_of(part, f"{where}.content[{k}]"))
    return "".join(parts)


def _user_content(texts: list[str]) -> str | list[dict[str, str]]:
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


def _user(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks in order: tool results become `tool` messages, runs of text
    a `user` message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, raw in enumerate(content):
        kind, block = _block(raw, f"{where}[{j}]")
        if kind == "text":
            texts.append(_text_of(block, f"{where}[{j}]"))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise BadRequest(f"{where}[{j}].tool_use_id must be a non-empty string")
            if texts:
                out.append({"role": "user", "content": _user_content(texts)})
                texts = []
            result = _tool_result_content(block, f"{where}[{j}]")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise _unsupported(kind, f"{where}[{j}]")
    if texts:
        out.append({"role": "user", "content": _user_content(texts)})
    return out


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn's blocks as one OpenAI assistant message (the inverse of `message_body`)."""
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        kind, block = _block(raw, f"{where}[{j}]")
        if kind == "text":
            texts.append(_text_of(block, f"{where}[{j}]"))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise BadRequest(f"{where}[{j}].thinking must be a string")
            reasoning.append(block["thinking"])  # the signature is passed through, not rendered
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"{where}[{j}]"))
        else:
            raise _unsupported(kind, f"{where}[{j}]")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be a non-empty string")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{where}.id must be a non-empty string")
    if not isinstance(args, dict):  # `input: Dict[str, object]` (types/tool_use_block.py)
        raise BadRequest(f"{where}.input must be an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out = _system(req.system)
    for i, m in enumerate(req.messages):
        role, content = m.get("role"), m.get("content")
        where = f"messages[{i}].content"
        if role not in ("user", "assistant", "system"):
            raise BadRequest(f"messages[{i}].role must be 'user', 'assistant' or 'system', got {role!r}")
        if role == "system":
            if not isinstance(content, str | list):
                raise BadRequest(f"{where} must be a string or a list of text blocks")
            out.extend(_system(content) or [{"role": "system", "content": ""}])
        elif isinstance(content, str):  # shorthand for one text block
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_user(content, where) if role == "user" else [_assistant(content, where)])
        else:
            raise BadRequest(f"{where} must be a string or a list of content blocks")
    if not out:
        raise BadRequest("messages: nothing to render (no text, tool result or system prompt)")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools (`ToolParam`: name, description, input_schema) as OpenAI function tools.
    Anthropic's server tools (`type` `web_search_...`, `bash_...`: run on Anthropic's side)
    have no runner here: left out of what the model sees with a logged warning, as the
    Responses dialect does with hosted tools, so a harness that always sends one still
    runs with its client tools; a `tool_choice` forcing one is a 400 (structured.py)."""
    if not tools:
        return None
    out = []
    dropped: list[str] = []
    for j, t in enumerate(tools):
        kind = t.get("type")
        if kind not in (None, "custom"):
            dropped.append(f"{kind}:{t['name']}" if isinstance(t.get("name"), str) else str(kind))
            continue
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{j}].name must be a non-empty string")
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{j}].input_schema must be a JSON schema object")
        # key order is what OpenAI clients send (name, description, parameters): the
        # template renders the tools as JSON text, so the same tools through chat
        # completions and through here render the same prompt (no fork on a dialect switch)
        fn: dict[str, Any] = {"name": name}
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise BadRequest(f"tools[{j}].description must be a string")  # `description: str` (ToolParam)
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    if dropped:
        _log.warning("messages: server tools the model cannot call here were left out of the prompt "
                     "(client tools only): %s", ", ".join(dropped))
    return out or None


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    """`ToolChoiceParam` (auto / any / tool / none). `disable_parallel_tool_use` is not
    enforced: the model's calls are returned as it wrote them."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise BadRequest("tool_choice.name must be a non-empty string")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


def _thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """`ThinkingConfigParam`: enabled (with `budget_tokens`, not enforced: the template
    has no budget), disabled, adaptive (the template decides: nothing set)."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise BadRequest("thinking.budget_tokens must be a positive integer")
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return {}
    raise BadRequest(f"thinking.type must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")


def _response_format(output_config: Any) -> dict[str, Any] | None:
    """`output_config.format` (`{"type": "json_schema", "schema"}`, Anthropic's structured
    outputs) as chat completions' `response_format`; the rest of `output_config`
    (`effort`) has no meaning for a self-hosted model."""
    if not isinstance(output_config, dict) or output_config.get("format") is None:
        return None
    fmt = output_config["format"]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise BadRequest("output_config.format must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat_request(req: MessagesRequest) -> ChatRequest:
    """The pipeline's request; its own validators (roles, tool calls, bounds) run too."""
    kwargs = {**(req.chat_template_kwargs or {}), **_thinking_kwargs(req.thinking)}
    data: dict[str, Any] = {
        "messages": _messages(req),
        "model": req.model,
        "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "response_format": _response_format((req.model_extra or {}).get("output_config")),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences or None,
        "stream": req.stream,
        "chat_template_kwargs": kwargs or None,
        "timeout_s": req.timeout_s,
        "max_weight_lag": req.max_weight_lag,
    }
    try:
        return ChatRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise BadRequest(f"invalid request: {errs}") from exc


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
