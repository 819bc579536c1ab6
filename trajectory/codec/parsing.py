"""Parsing sampled assistant text into reasoning, content and tool calls (DESIGN.md s6).

Owns the family-specific tool-call grammars (Hermes/Qwen JSON in `<tool_call>`,
Llama 3.1 bare JSON, GLM `<arg_key>/<arg_value>` XML) and reasoning splitting.
Every parser is total: malformed markup becomes a status plus the raw text as
content, never an exception.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from trajectory.codec.base import ParsedAssistant, ParsedToolCall, ToolCallParseStatus

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    """A fresh `call_<hex>` id: unique per call, even for identical calls."""
    return "call_" + secrets.token_hex(12)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest): text before `</think>` is reasoning, with or without `<think>`."""
    if THINK_CLOSE not in text:
        return None, text
    head, rest = text.split(THINK_CLOSE, 1)
    if THINK_OPEN in head:
        head = head.split(THINK_OPEN, 1)[1]
    return head, rest


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _bad(content: str, reasoning: str | None, status: ToolCallParseStatus, detail: str):
    return ParsedAssistant(
        content=content, reasoning_content=reasoning, status=status, status_detail=detail
    )


def _blocks(text: str) -> tuple[str, list[str], str] | None:
    """(text before the first call, call bodies, trailing text); None if a tag is unbalanced."""
    first = text.find(TOOL_OPEN)
    bodies: list[str] = []
    pos = first
    trailing = ""
    while pos != -1:
        end = text.find(TOOL_CLOSE, pos)
        if end == -1:
            return None
        body = text[pos + len(TOOL_OPEN) : end]
        if TOOL_OPEN in body:
            return None
        bodies.append(body)
        nxt = text.find(TOOL_OPEN, end)
        between = text[end + len(TOOL_CLOSE) : nxt if nxt != -1 else len(text)]
        if nxt == -1:
            trailing = between
        elif between.strip():
            return None
        pos = nxt
    return text[:first], bodies, trailing


def parse_hermes(text: str, reasoning: str | None) -> ParsedAssistant:
    """Qwen/Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
    if TOOL_OPEN not in text:
        if TOOL_CLOSE in text:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "stray </tool_call>")
        return ParsedAssistant(content=text, reasoning_content=reasoning)
    split = _blocks(text)
    if split is None:
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unbalanced <tool_call>")
    before, bodies, trailing = split
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except ValueError as exc:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_JSON, f"tool call: {exc}")
        call = _call_from_obj(obj, "arguments")
        if call is None:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call shape")
        if isinstance(call, str):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_JSON, call)
        calls.append(call)
    if trailing.strip():
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "text after tool calls")
    content = before[:-1] if before.endswith("\n") else before
    return ParsedAssistant(content=content or None, reasoning_content=reasoning, tool_calls=calls)


def _call_from_obj(obj: Any, args_key: str) -> ParsedToolCall | str | None:
    """A call from a decoded JSON object; a str is an INVALID_JSON detail; None a bad shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return "arguments string is not JSON"
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(id=new_call_id(), name=obj["name"], arguments=_dump(args))


def parse_llama31(text: str) -> ParsedAssistant:
    """Llama 3.1: the whole reply is `{"name": ..., "parameters": {...}}` (one call)."""
    stripped = text.strip()
    if not (stripped.startswith("{") and '"name"' in stripped):
        return ParsedAssistant(content=text, reasoning_content=None)
    try:
        obj = json.loads(stripped)
    except ValueError as exc:
        return _bad(text, None, ToolCallParseStatus.INVALID_JSON, f"tool call: {exc}")
    call = _call_from_obj(obj, "parameters")
    if call is None:
        return ParsedAssistant(content=text, reasoning_content=None)  # JSON, but not a call
    if isinstance(call, str):
        return _bad(text, None, ToolCallParseStatus.INVALID_JSON, call)
    return ParsedAssistant(content=None, reasoning_content=None, tool_calls=[call])


_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_glm(text: str, reasoning: str | None) -> ParsedAssistant:
    """GLM: `<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>`."""
    if TOOL_OPEN not in text:
        if TOOL_CLOSE in text:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "stray </tool_call>")
        return ParsedAssistant(content=text.strip(), reasoning_content=reasoning)
    split = _blocks(text)
    if split is None:
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unbalanced <tool_call>")
    before, bodies, trailing = split
    calls = []
    for body in bodies:
        cut = body.find("<arg_key>")
        name = (body if cut == -1 else body[:cut]).strip()
        rest = "" if cut == -1 else body[cut:]
        if not name or "<" in name or "\n" in name:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call name")
        args: dict[str, Any] = {}
        pos = 0
        for m in _GLM_PAIR.finditer(rest):
            if rest[pos : m.start()].strip():
                return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call args")
            args[m.group(1).strip()] = _glm_value(m.group(2))
            pos = m.end()
        if rest[pos:].strip():
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call args")
        calls.append(ParsedToolCall(id=new_call_id(), name=name, arguments=_dump(args)))
    if trailing.strip():
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "text after tool calls")
    return ParsedAssistant(
        content=before.strip() or None, reasoning_content=reasoning, tool_calls=calls
    )
