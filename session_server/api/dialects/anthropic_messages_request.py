"""An Anthropic Messages request as the pipeline's `ChatRequest`: the request side of
the Messages dialect (`anthropic_messages.py`, whose module doc tables how each
field and content block maps onto chat messages and sampling fields).

The request models (`MessagesRequest`, `CountTokensRequest`) and the mapping
itself (system, user/tool_result, assistant thinking/text/tool_use blocks, tools,
tool_choice, thinking, output_config.format). Kept apart from the response side
(message body, SSE stream, error shape), which never reads a request body.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from ...errors import BadRequest
from ...turn.chat_request import (
    MAX_STOPS,
    ChatRequest,
    StopStr,
    TemplateKwargs,
    TimeoutS,
    Tokens,
    WeightLag,
)

_log = logging.getLogger(__name__)


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
    metadata: dict[str, Any] | None = None  # {user_id}: read for the turn's lineage only
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
        chat = ChatRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise BadRequest(f"invalid request: {errs}") from exc
    user_id = (req.metadata or {}).get("user_id")
    if isinstance(user_id, str):  # Claude Code: a JSON string naming its session (api/lineage.py)
        chat._lineage_hints["metadata.user_id"] = user_id
    return chat
