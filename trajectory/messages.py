"""Message normalisation and tolerant matching of OpenAI chat messages.

Owns deciding whether a message a client sends back is "the same" as the one we
stored (message matching): role, content (content parts flattened
to text), tool_calls (arguments compared as parsed JSON, ids compared),
tool_call_id and name. `reasoning_content` is compared only when both sides
carry it, because clients routinely drop it or echo it back.

Equality is typed JSON equality: `true`, `1` and `1.0` are three different values
(the template renders them differently, so the model saw different tokens); only
object key order is tolerated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = [
    "flatten_content",
    "inlined_reasoning",
    "match_returned",
    "messages_equal",
    "normalize_message",
    "parse_arguments",
]


def flatten_content(content: Any) -> str:
    """Content as text: strings as-is, text parts joined, None as empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        return str(content.get("text", "")) if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                out.append(str(part.get("text", "")))
        return "".join(out)
    return str(content)


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value; a string that is not JSON stays a string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _normalize_tool_call(tc: Mapping[str, Any]) -> dict[str, Any]:
    inner = tc.get("function")
    fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else tc
    return {
        "id": tc.get("id"),
        "name": fn.get("name"),
        "arguments": parse_arguments(fn.get("arguments", {})),
    }


def normalize_message(msg: Mapping[str, Any]) -> dict[str, Any]:
    """A canonical, comparable form of one message (see module doc)."""
    out: dict[str, Any] = {
        "role": msg.get("role"),
        "content": flatten_content(msg.get("content")),
    }
    tool_calls = msg.get("tool_calls") or []
    if tool_calls:
        out["tool_calls"] = [_normalize_tool_call(tc) for tc in tool_calls]
    for key in ("tool_call_id", "name"):
        if msg.get(key) is not None:
            out[key] = msg[key]
    reasoning = msg.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning != "":
        out["reasoning_content"] = reasoning
    return out


def _comparable(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    na, nb = normalize_message(a), normalize_message(b)
    if "reasoning_content" not in na or "reasoning_content" not in nb:
        na.pop("reasoning_content", None)
        nb.pop("reasoning_content", None)
    return na, nb


def _same(na: Mapping[str, Any], nb: Mapping[str, Any]) -> bool:
    return na == nb and _canonical(na) == _canonical(nb)


_IDENTICAL_DEPTH = 32  # deeper values are left to the tolerant comparison (no recursion limit)


def _identical(a: Any, b: Any, depth: int = 0) -> bool:
    """Equal with the same JSON type at every level, string keys, key order aside: then
    they normalise to the same form, so the tolerant comparison is not needed. False is
    only "not shown here" (a float, whose `==` calls 0.0 and -0.0 equal; a value nested
    deeper than `_IDENTICAL_DEPTH`), left to the tolerant comparison."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is str or kind is int or kind is bool or a is None:
        return bool(a == b)
    if depth >= _IDENTICAL_DEPTH:
        return False
    if kind is dict:
        return len(a) == len(b) and all(
            type(k) is str and k in b and _identical(v, b[k], depth + 1) for k, v in a.items())
    if kind is list:
        return len(a) == len(b) and all(_identical(x, y, depth + 1) for x, y in zip(a, b, strict=True))
    return False


def _no_text(content: Any) -> bool:
    return content is None or (type(content) is str and not content)


def _identical_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """The fields `normalize_message` reads, `_identical` as it reads them: content None
    or "", tool calls absent or empty, an id or name None or absent, reasoning compared
    only when both carry it (clients drop it). Other keys (a client's `refusal: null`)
    it ignores. True: both normalise to the same form, so they compare equal."""
    ca, cb = a.get("content"), b.get("content")
    ta, tb = a.get("tool_calls"), b.get("tool_calls")
    ra, rb = a.get("reasoning_content"), b.get("reasoning_content")
    compared = isinstance(ra, str) and ra and isinstance(rb, str) and rb  # else both dropped
    return (_identical(a.get("role"), b.get("role"))
            and (_identical(ca, cb) or (_no_text(ca) and _no_text(cb)))
            and ((not ta and not tb) or (type(ta) is list and all(type(tc) is dict for tc in ta)
                                         and _identical(ta, tb)))
            and _identical(a.get("tool_call_id"), b.get("tool_call_id"))
            and _identical(a.get("name"), b.get("name"))
            and (not compared or (type(ra) is str and type(rb) is str and ra == rb)))


def messages_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """True when `a` and `b` are the same message up to tolerated client differences.
    Most messages of a request are the very ones committed: checked first, cheaply."""
    return _identical_fields(a, b) or _same(*_comparable(a, b))


def match_returned(returned: Mapping[str, Any], requested: Mapping[str, Any]) -> dict[str, Any] | None:
    """Match an assistant message *we returned* with what the client sent back.

    Same as `messages_equal`, except that tool-call ids may differ: many SDKs
    mint their own ids for the calls they receive. What the model produced is
    its content and its calls (names and arguments, in order); the ids are ours
    and were never sampled. Returns None when the messages differ, else the
    renames ``{client id: our id}`` (empty when the ids were kept)."""
    if _identical_fields(returned, requested):
        return {}
    na, nb = _comparable(returned, requested)
    calls_a, calls_b = na.get("tool_calls"), nb.get("tool_calls")
    if not calls_a or not calls_b or len(calls_a) != len(calls_b):
        return {} if _same(na, nb) else None
    renames = {}
    for ca, cb in zip(calls_a, calls_b, strict=True):
        if ca["id"] != cb["id"]:
            if isinstance(cb["id"], str):  # a dropped id (None) matches too, with nothing to record
                renames[cb["id"]] = ca["id"]
            cb["id"] = ca["id"]
    return renames if _same(na, nb) else None


def _canonical(value: Any) -> bytes:
    """JSON text with sorted keys: `true`, `1` and `1.0` serialise differently, where
    Python's `==` calls them equal."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an int beyond 64 bits: the standard encoder takes any int
        return json.dumps(value, sort_keys=True).encode()


THINK_CLOSE = "</think>"


def inlined_reasoning(committed: Mapping[str, Any], sent: Mapping[str, Any]) -> bool:
    """Whether `sent` is the assistant message we returned as `committed`, except that the
    client inlined the reasoning into its content as `<think>...</think>` (some agent
    frameworks do, as the raw model text reads). Such a message does not match (the
    content differs), so the request forks or rolls back; this names the cause for the
    session's diagnostics. What follows `</think>` must be our content (whitespace
    aside) and the tool calls ours (ids aside), so an unrelated edit is not blamed."""
    if committed.get("role") != "assistant" or sent.get("role") != "assistant":
        return False
    text = flatten_content(sent.get("content"))
    at = text.find(THINK_CLOSE)
    if at < 0 or text[at + len(THINK_CLOSE) :].strip() != flatten_content(committed.get("content")).strip():
        return False
    a = {k: v for k, v in committed.items() if k != "reasoning_content"}
    b = {k: v for k, v in sent.items() if k != "reasoning_content"}
    a["content"] = b["content"] = ""
    return match_returned(a, b) is not None
