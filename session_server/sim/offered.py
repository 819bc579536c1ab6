"""The tools a request offers, read as an engine can read them: from the prompt text.

An engine receives token ids, never the request's `tools` list: the chat template has
rendered the tools into the prompt (Qwen3 and GLM one JSON object per tool inside
`<tools>`, Llama 3.1 `tojson(indent=4)` objects in the first user message, Gemma 4
`<|tool>declaration:NAME{...}<tool|>`). A real model calls what it read there, so the
simulator does too (`sampler.ScriptedPolicy`): it decodes the episode's first prompt
and collects every tool schema it finds, in order. A template that renders tools in
another form (harmony's TypeScript namespaces, DeepSeek's `### name` sections) yields
none, and the simulated model answers in plain text, as it does when no tool is offered.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["OfferedTool", "arguments_for", "offered_tools"]

OfferedTool = tuple[str, dict[str, Any]]  # (name, its JSON-schema `parameters`)

# where a tool's JSON may start: `{"type": "function", ...}` (OpenAI's form, which Qwen3,
# GLM and Llama 3.1 print) or `{"name": ..., "parameters": ...}` (a bare function)
_JSON_START = re.compile(r'\{\s*"(?:type|name)"\s*:')
# Gemma 4's declaration (trajectory/codec/templates/gemma4.jinja, format_function_declaration)
_GEMMA = re.compile(r"<\|tool>declaration:([A-Za-z0-9_.:-]+)\{(.*?)<tool\|>", re.DOTALL)
_GEMMA_REQUIRED = re.compile(r"required:\[([^\]]*)\]")
_GEMMA_STR = re.compile(r'<\|"\|>(.*?)<\|"\|>', re.DOTALL)
_MAX_TOOLS = 256


def offered_tools(text: str) -> tuple[OfferedTool, ...]:
    """Every tool schema rendered in `text`, in order, each name once. O(len(text)) plus
    one JSON parse per candidate object start."""
    found: dict[str, dict[str, Any]] = {}
    decoder = json.JSONDecoder()
    pos = 0
    while len(found) < _MAX_TOOLS and (m := _JSON_START.search(text, pos)) is not None:
        try:
            obj, end = decoder.raw_decode(text, m.start())
        except ValueError:
            pos = m.start() + 1
            continue
        tool = _as_tool(obj)
        if tool is not None:
            found.setdefault(*tool)
            pos = end
        else:
            pos = m.start() + 1  # an object around a tool (a wrapper): look inside it
    for g in _GEMMA.finditer(text):
        req = _GEMMA_REQUIRED.search(g.group(2))
        names = _GEMMA_STR.findall(req.group(1)) if req else []
        found.setdefault(g.group(1), {"type": "object", "properties": {n: {"type": "string"} for n in names},
                                      "required": names})
    return tuple(found.items())


def _as_tool(obj: Any) -> OfferedTool | None:
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function") if obj.get("type") == "function" else obj
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return None
    params = fn.get("parameters", fn.get("input_schema"))
    if not isinstance(params, dict):
        return None
    return fn["name"], params


# values a canned call gives a parameter of one of these names (a coding agent's tools)
_VALUES = {
    "path": ("src/app.py", "README.md", "setup.cfg", "tests/test_core.py"),
    "file_path": ("src/app.py", "README.md", "setup.cfg", "tests/test_core.py"),
    "command": ("ls -la", "pytest -q", "git status", "cat setup.py"),
    "cmd": ("ls -la", "pytest -q", "git status", "cat setup.py"),
    "query": ("config loader", "retry logic", "parse error", "unit tests"),
    "pattern": ("TODO", "def main", "import os", "raise"),
}
_TEXT = ("check the config", "run the tests", "fix the parser", "read the logs")


def arguments_for(params: dict[str, Any], h: int) -> dict[str, Any]:
    """Arguments a canned call passes: one value per *required* parameter, of its
    schema's type (its first `enum` value when it has one), drawn from `h`."""
    props_raw, required_raw = params.get("properties"), params.get("required")
    props: dict[str, Any] = props_raw if isinstance(props_raw, dict) else {}
    required: list[Any] = required_raw if isinstance(required_raw, list) else []
    out: dict[str, Any] = {}
    for k, name in enumerate(n for n in required if isinstance(n, str)):
        schema = props.get(name)
        out[name] = _value(name, schema if isinstance(schema, dict) else {}, h >> (4 * k))
    return out


def _value(name: str, schema: dict[str, Any], h: int) -> Any:
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[h % len(enum)]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), "string")
    kind = str(kind or "string").lower()
    if kind in ("integer", "number"):
        return 1 + h % 9
    if kind == "boolean":
        return bool(h % 2)
    if kind == "array":
        return []
    if kind == "object":
        return {}
    values = _VALUES.get(name, _TEXT)
    return values[h % len(values)]
