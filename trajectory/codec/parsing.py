"""Parsing sampled assistant text into reasoning, content and tool calls.

Owns the family-specific tool-call grammars (Hermes/Qwen JSON in `<tool_call>`,
Llama 3.1 bare JSON, GLM `<arg_key>/<arg_value>` XML) and reasoning splitting.
Every parser is total: malformed markup becomes a status plus the raw text as
content, never an exception.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from typing import Any, NamedTuple

from trajectory.codec.base import ParsedAssistant, ParsedToolCall, ToolCallParseStatus

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    """A fresh `call_<hex>` id: unique per call, even for identical calls."""
    return "call_" + secrets.token_hex(12)


def tool_names(tools: Iterable[Any] | None) -> frozenset[str]:
    """Function names a request offers (`tools[i].function.name`); malformed entries are skipped.

    Empty means the request sent no tools: then nothing is parsed as a call."""
    names = set()
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            names.add(name)
    return frozenset(names)


def split_reasoning(text: str, *, thinking: bool = True) -> tuple[str | None, str]:
    """(reasoning, rest): text before `</think>` is reasoning, with or without `<think>`.

    A `<think>` never closed (the turn was cut short while thinking) is all reasoning.
    With thinking off (`enable_thinking: false`) the template closed the think block in
    the prompt, so a literal `</think>` the model writes is content."""
    if not thinking:
        return None, text
    if THINK_CLOSE not in text:
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            return stripped[len(THINK_OPEN) :], ""
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


_JSON = json.JSONDecoder()


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class _Fail(NamedTuple):
    status: ToolCallParseStatus
    detail: str


def _hermes_objects(text: str) -> tuple[str, list[Any], str] | _Fail:
    """(text before the first call, decoded call objects, trailing text), or (status, detail).

    Each call's JSON is read with a JSON decoder, not by searching for the closing tag,
    so a `</tool_call>` inside an argument string does not cut the call."""
    first = text.find(TOOL_OPEN)
    objs: list[Any] = []
    pos = first
    while True:
        start = _skip_ws(text, pos + len(TOOL_OPEN))
        if TOOL_CLOSE not in text[start:]:
            return _Fail(ToolCallParseStatus.INVALID_FORMAT, "unbalanced <tool_call>")
        try:
            obj, end = _JSON.raw_decode(text, start)
        except ValueError as exc:
            return _Fail(ToolCallParseStatus.INVALID_JSON, f"tool call: {exc}")
        close = _skip_ws(text, end)
        if not text.startswith(TOOL_CLOSE, close):
            return _Fail(ToolCallParseStatus.INVALID_JSON, "tool call: text after the JSON object")
        objs.append(obj)
        after = close + len(TOOL_CLOSE)
        nxt = _skip_ws(text, after)
        if not text.startswith(TOOL_OPEN, nxt):
            return text[:first], objs, text[after:]
        pos = nxt


def _unknown(name: str, names: frozenset[str]) -> str:
    return f"tool call names {name!r}, not one of the request's tools {sorted(names)}"


def _no_calls(text: str, reasoning: str | None, names: frozenset[str], *, content: str) -> ParsedAssistant | None:
    """The shared opening of the `<tool_call>` parsers: no tools offered or no call
    markup means the text is content (a stray closing tag is a parse failure);
    None means there are calls to parse."""
    if not names:
        return ParsedAssistant(content=content, reasoning_content=reasoning)
    if TOOL_OPEN not in text:
        if TOOL_CLOSE in text:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "stray </tool_call>")
        return ParsedAssistant(content=content, reasoning_content=reasoning)
    return None


def parse_hermes(text: str, reasoning: str | None, names: frozenset[str]) -> ParsedAssistant:
    """Qwen/Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    Only when the request offered tools (`names`), and only calls to those names."""
    early = _no_calls(text, reasoning, names, content=text)
    if early is not None:
        return early
    split = _hermes_objects(text)
    if isinstance(split, _Fail):
        return _bad(text, reasoning, split.status, split.detail)
    before, objs, trailing = split
    calls = []
    for obj in objs:
        call = _call_from_obj(obj, "arguments")
        if call is None:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call shape")
        if isinstance(call, str):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_JSON, call)
        if call.name not in names:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, _unknown(call.name, names))
        calls.append(call)
    if trailing.strip():
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "text after tool calls")
    content = before[:-1] if before.endswith("\n") else before
    return ParsedAssistant(content=content or None, reasoning_content=reasoning, tool_calls=calls)


def parse_xml_calls(text: str, reasoning: str | None, names: frozenset[str]) -> ParsedAssistant:
    """Qwen3-Coder style: `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n
    </function>\n</tool_call>`, values read back as the template wrote them (`xml_args`).

    Only when the request offered tools (`names`), and only calls to those names."""
    from trajectory.codec.xml_args import xml_arguments

    early = _no_calls(text, reasoning, names, content=text)
    if early is not None:
        return early
    split = _blocks(text)
    if split is None:
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unbalanced <tool_call> tags")
    before, bodies, trailing = split
    calls = []
    for body in bodies:
        inner = body.strip()
        if not (inner.startswith("<function=") and inner.endswith("</function>")):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call is not one <function=...> block")
        parsed = xml_arguments(inner, None)
        if parsed is None:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_JSON, "a parameter value does not fit")
        name, args = parsed
        if name not in names:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, _unknown(name, names))
        calls.append(ParsedToolCall(id=new_call_id(), name=name, arguments=_dump(args)))
    if trailing.strip():
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "text after tool calls")
    # the template writes `content | trim` then `\n` and `\n<tool_call>`: no content it
    # renders ends in a newline, so every newline before the first call is markup
    content = before.rstrip("\n")
    return ParsedAssistant(content=content or None, reasoning_content=reasoning, tool_calls=calls)


def _call_from_obj(obj: Any, args_key: str) -> ParsedToolCall | str | None:
    """A call from a decoded JSON object; a str is an INVALID_JSON detail (arguments
    that are not a JSON object, nor a string holding one); None a bad shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if not {args_key, "arguments", "parameters"} & obj.keys() and obj.keys() - {"name", "type", "id"}:
        return None  # no arguments key but other keys (`"args"`): a call of no arguments would lose them
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return "arguments string is not JSON"
    if not isinstance(args, dict):
        # a call whose arguments no client can receive (`tool_use.input` is an object):
        # a parse failure in every codec, never a call
        return "arguments are not a JSON object"
    return ParsedToolCall(id=new_call_id(), name=obj["name"], arguments=_dump(args))


def parse_llama31(text: str, names: frozenset[str]) -> ParsedAssistant:
    """Llama 3.1: the whole reply is `{"name": ..., "parameters": {...}}` (one call).

    The format has no markup, so a JSON *answer* looks like a call: only a name among
    the request's tools (`names`) makes one; anything else is content."""
    stripped = text.strip()
    if not names or not (stripped.startswith("{") and '"name"' in stripped):
        return ParsedAssistant(content=text, reasoning_content=None)
    try:
        obj = json.loads(stripped)
    except ValueError as exc:
        return _bad(text, None, ToolCallParseStatus.INVALID_JSON, f"tool call: {exc}")
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return ParsedAssistant(content=text, reasoning_content=None)  # JSON, but not a call
    call = _call_from_obj(obj, "parameters")
    if call is None:
        return ParsedAssistant(content=text, reasoning_content=None)
    if isinstance(call, str):
        return _bad(text, None, ToolCallParseStatus.INVALID_JSON, call)
    return ParsedAssistant(content=None, reasoning_content=None, tool_calls=[call])


_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_glm(text: str, reasoning: str | None, names: frozenset[str]) -> ParsedAssistant:
    """GLM: `<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>`.

    Only when the request offered tools (`names`), and only calls to those names."""
    early = _no_calls(text, reasoning, names, content=text.strip())
    if early is not None:
        return early
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
        if name not in names:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, _unknown(name, names))
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
