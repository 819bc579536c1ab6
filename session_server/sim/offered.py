"""The tools a request offers, read as an engine can read them: from the prompt text.

An engine receives token ids, never the request's `tools` list: the chat template has
rendered the tools into the prompt, each family in its own section and form. A real model
calls what it read there, so the simulator does too (`sampler.ScriptedPolicy`): it
decodes the episode's first prompt and reads the section its template prints tools in:

- `<tools>\\n...\\n</tools>`: one JSON object per tool (Qwen3, Qwen3.5, GLM; MiniMax M2
  wraps each in `<tool>`), or the XML form `<function><name>..</name>...<parameters>
  <parameter><name>..</name><type>..</type>...<required>[..]</required>` (Qwen3-Coder,
  Nemotron 3 Nano);
- `<functions>\\n...\\n</functions>` (DeepSeek V3.2) and `### Available Tool Schemas`
  (DeepSeek V4): one JSON object per line;
- `## Tools\\nYou have access to the following tools:` then `### NAME` / `Parameters:
  {json}` per tool (DeepSeek V3.1, the form its model card documents; the llama.cpp copy
  of its template in tests/fast/data/templates prints no tools at all);
- `tool_declare<|im_middle|>[...]` (Kimi K2): one JSON array;
- `Do not use variables.\\n\\n` then `tojson(indent=4)` objects, one after another
  (Llama 3.1/3.2, in the first user message or the system prompt);
- `<|tool>declaration:NAME{...}<tool|>` one after another (Gemma 4);
- `namespace functions { // desc  type NAME = (_: { param?: type, }) => any; }` (gpt-oss
  harmony, its TypeScript types read back to a schema).

Only that section is read: JSON shaped like a tool in a system or user message is text,
not an offer. When several forms appear, the section that starts first wins (templates
print tools before the conversation; a system prompt that mimics a tools section ahead of
the real one is read as the model would read it, ambiguously). A template that prints no
tools (Llama 3, the vendored DeepSeek V3.1 copy) yields none, and the simulated model
answers in plain text, as it does when no tool is offered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["OfferedTool", "arguments_for", "offered_tools"]

OfferedTool = tuple[str, dict[str, Any]]  # (name, its JSON-schema `parameters`)

_MAX_TOOLS = 256
# where a tool's JSON may start inside a section: `{"type": "function", ...}` (OpenAI's
# form) or `{"name": ..., "parameters": ...}` (a bare function)
_JSON_START = re.compile(r'\{\s*"(?:type|name)"\s*:')
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_FUNCTIONS = re.compile(r"<functions>\n(.*?)\n</functions>", re.DOTALL)
_DS4 = re.compile(r"### Available Tool Schemas\n\n(.*?)\n\nYou MUST strictly follow", re.DOTALL)
_KIMI = re.compile(r"tool_declare<\|im_middle\|>(.*?)<\|im_end\|>", re.DOTALL)
_LLAMA = re.compile(r"Do not use variables\.\n\n")
_DS31 = re.compile(r"## Tools\nYou have access to the following tools:\n(.*?)(?:\nIMPORTANT: ALWAYS adhere|\Z)",
                   re.DOTALL)
_DS31_TOOL = re.compile(r"^### (\S+)\n(?:.*?\n)??Parameters: ", re.DOTALL | re.MULTILINE)
_HARMONY = re.compile(r"namespace functions \{\n(.*?)\} // namespace functions", re.DOTALL)
_HARMONY_TOOL = re.compile(r"^type (\S+) = (?:\(_: \{\n(.*?)\n\}\) => any;|\(\) => any;)", re.DOTALL | re.MULTILINE)
_HARMONY_PARAM = re.compile(r"^([^\s?:/]+)(\?)?: (.*)$")
# Gemma 4's declaration (trajectory/codec/templates/gemma4.jinja, format_function_declaration)
_GEMMA = re.compile(r"<\|tool>declaration:([A-Za-z0-9_.:-]+)\{(.*?)<tool\|>", re.DOTALL)
_GEMMA_REQUIRED = re.compile(r"required:\[([^\]]*)\]")
_GEMMA_STR = re.compile(r'<\|"\|>(.*?)<\|"\|>', re.DOTALL)
_XML_FUNCTION = re.compile(r"<function>\n<name>(.*?)</name>(.*?)\n</function>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter>\n<name>(.*?)</name>(.*?)\n</parameter>", re.DOTALL)
_XML_TAG = r"<{0}>(.*?)</{0}>"


def offered_tools(text: str) -> tuple[OfferedTool, ...]:
    """The tools rendered in `text`'s tools section (see the module doc), in order, each
    name once; () when no section is there. O(len(text)) plus one JSON parse per tool."""
    best: tuple[int, list[OfferedTool]] | None = None
    for reader in _READERS:
        found = reader(text)
        if found is not None and found[1] and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        return ()
    out: dict[str, dict[str, Any]] = {}
    for name, params in best[1]:
        if len(out) >= _MAX_TOOLS:
            break
        out.setdefault(name, params)
    return tuple(out.items())


Section = tuple[int, list[OfferedTool]]  # (where the section starts, its tools)


def _tags(text: str) -> Section | None:
    """`<tools>` (Qwen, GLM, MiniMax: JSON; Qwen3-Coder, Nemotron: XML)."""
    m = _TOOLS.search(text)
    if m is None:
        return None
    body = m.group(1)
    if body.startswith("<function>\n<name>"):
        return m.start(), [_xml_tool(f.group(1), f.group(2)) for f in _XML_FUNCTION.finditer(body)]
    return m.start(), list(_json_tools(body))


def _json_section(pattern: re.Pattern[str]) -> Callable[[str], Section | None]:
    def read(text: str) -> Section | None:
        m = pattern.search(text)
        return None if m is None else (m.start(), list(_json_tools(m.group(1))))
    return read


def _json_tools(body: str) -> Iterator[OfferedTool]:
    """Every tool object in a section's body (lines, a JSON array, `<tool>` wrappers)."""
    decoder = json.JSONDecoder()
    pos = 0
    while (m := _JSON_START.search(body, pos)) is not None:
        try:
            obj, end = decoder.raw_decode(body, m.start())
        except ValueError:
            pos = m.start() + 1
            continue
        tool = _as_tool(obj)
        if tool is not None:
            yield tool
            pos = end
        else:
            pos = m.start() + 1  # an object around a tool (a wrapper): look inside it


def _llama(text: str) -> Section | None:
    """Llama 3.x: the objects right after the instructions, one after another; the
    first thing that is not a tool object (the user's own text) ends the section."""
    m = _LLAMA.search(text)
    if m is None:
        return None
    decoder, pos, tools = json.JSONDecoder(), m.end(), []
    while pos < len(text) and text[pos] == "{":
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        tool = _as_tool(obj)
        if tool is None:
            break
        tools.append(tool)
        while pos < len(text) and text[pos] in " \n":
            pos += 1
    return m.start(), tools


def _deepseek31(text: str) -> Section | None:
    """DeepSeek V3.1: `### NAME` then `Parameters: {json}` per tool."""
    m = _DS31.search(text)
    if m is None:
        return None
    body, decoder, tools = m.group(1), json.JSONDecoder(), []
    for t in _DS31_TOOL.finditer(body):
        try:
            params, _ = decoder.raw_decode(body, t.end())
        except ValueError:
            continue
        if isinstance(params, dict):
            tools.append((t.group(1), params))
    return m.start(), tools


def _harmony(text: str) -> Section | None:
    """gpt-oss: the `functions` namespace's TypeScript types, read back to a schema
    (openai-gpt-oss-120b.jinja, render_tool_namespace / render_typescript_type)."""
    m = _HARMONY.search(text)
    if m is None:
        return None
    tools = []
    for t in _HARMONY_TOOL.finditer(m.group(1)):
        props: dict[str, Any] = {}
        required: list[str] = []
        depth = 0
        for line in (t.group(2) or "").split("\n"):
            p = _HARMONY_PARAM.match(line) if depth == 0 else None
            depth += line.count("{") - line.count("}")
            if p is None:
                continue
            props[p.group(1)] = _ts_schema(p.group(3))
            if not p.group(2):
                required.append(p.group(1))
        tools.append((t.group(1), {"type": "object", "properties": props, "required": required}))
    return m.start(), tools


def _ts_schema(ts: str) -> dict[str, Any]:
    """A TypeScript type as the harmony template prints it, as a JSON schema."""
    ts = ts.split(" // ", 1)[0].split("//", 1)[0].strip().rstrip(",").strip()
    ts = re.sub(r"\s*\|\s*null$", "", ts)
    if ts.endswith("[]"):
        return {"type": "array"}
    if ts.startswith("{"):
        return {"type": "object"}
    if ts.startswith('"'):
        return {"type": "string", "enum": re.findall(r'"([^"]*)"', ts)}
    first = ts.split("|", 1)[0].strip()
    return {"type": first if first in ("number", "boolean", "object") else "string"}


def _gemma(text: str) -> Section | None:
    """Gemma 4: declarations one after another (the first one starts the section)."""
    first = _GEMMA.search(text)
    if first is None:
        return None
    tools, pos = [], first.start()
    while (g := _GEMMA.match(text, pos)) is not None:
        req = _GEMMA_REQUIRED.search(g.group(2))
        names = _GEMMA_STR.findall(req.group(1)) if req else []
        tools.append((g.group(1), {"type": "object", "properties": {n: {"type": "string"} for n in names},
                                   "required": names}))
        pos = g.end()
    return first.start(), tools


def _xml_tool(name: str, body: str) -> OfferedTool:
    """Qwen3-Coder / Nemotron: `<parameter><name>..</name><type>..</type>[<enum>[..]</enum>]`
    per property, then the tool's `<required>[..]</required>` (extra keys as JSON)."""
    props: dict[str, Any] = {}
    for p in _XML_PARAM.finditer(body):
        schema: dict[str, Any] = {}
        kind = re.search(_XML_TAG.format("type"), p.group(2))
        if kind:
            schema["type"] = re.sub(r"[\[\]'\" ]", "", kind.group(1)).split(",")[0] or "string"
        enum = _json_of(re.search(_XML_TAG.format("enum"), p.group(2)))
        if isinstance(enum, list) and enum:
            schema["enum"] = enum
        props[p.group(1)] = schema
    required = _json_of(re.search(_XML_TAG.format("required"), _XML_PARAM.sub("", body)))
    return name, {"type": "object", "properties": props,
                  "required": [r for r in required if isinstance(r, str)] if isinstance(required, list) else []}


def _json_of(m: re.Match[str] | None) -> Any:
    if m is None:
        return None
    try:
        return json.loads(m.group(1))
    except ValueError:
        return None


_READERS: tuple[Callable[[str], Section | None], ...] = (
    _tags, _json_section(_FUNCTIONS), _json_section(_DS4), _json_section(_KIMI), _llama, _deepseek31,
    _harmony, _gemma)


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
