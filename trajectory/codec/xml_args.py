"""Tool-call arguments in the `<function=NAME><parameter=K>V</parameter></function>` format
(Qwen3.5, Qwen3.6, Nemotron 3), read back the way the template wrote them.

Those templates render a value `V` as `v | tojson` when it is a mapping or a list and as
`v | string` otherwise, i.e. Python's `str()`: JSON `true`/`false`/`null` become `True`,
`False`, `None`, numbers their digits, strings their raw text. The `renderers` parser
(0.1.12) tries `json.loads` on each value and flags the call `invalid_json` when that
fails and the schema does not allow a string, so `True`, `None`, and any plain string
whose parameter the tools do not declare, never parse. `xml_arguments` inverts the
template's rule instead:

- a parameter the schema declares as a string only: the raw text;
- else JSON when the text is JSON (`3`, `1.5`, `{"a": [1, true]}`, `"x"`);
- else `True`/`False`/`None` as JSON true/false/null, where the schema allows that type;
- else the raw text, a string (what `| string` of a string gives), unless the schema
  declares only non-string types (then the call stays `invalid_json`).

Irreducible ambiguity (the template writes both the same way; pinned by
test_xml_arguments_ambiguity): without a schema saying "string", a string that is
JSON (`"75001"`, `"true"`, `"null"`, `'{"a": 1}'`) or reads `True`/`False`/`None` comes
back as the number / boolean / null / object; a string's leading and trailing whitespace
is lost (the parser strips the `\\n` the template puts around the value).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_PARAM = re.compile(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>]+)>")
# Python's str() of the JSON literals, as `| string` renders them
_PY_LITERALS: dict[str, tuple[Any, str]] = {"True": (True, "boolean"), "False": (False, "boolean"),
                                            "None": (None, "null")}


def param_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """tool name -> its parameters' `properties` (OpenAI envelope or flat spec)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            continue
        params = spec.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[spec["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _types(schema: Mapping[str, Any] | None) -> set[str] | None:
    """The JSON types a parameter allows (None: not declared, anything goes)."""
    if not isinstance(schema, Mapping):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {str(t) for t in declared}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        found = [_types(b) for b in branches]
        if any(t is None for t in found):
            return None
        return set().union(*(t for t in found if t is not None))
    return None


def xml_value(text: str, schema: Mapping[str, Any] | None) -> tuple[Any, bool]:
    """(value, ok) for one parameter's raw text (module doc for the rule)."""
    types = _types(schema)
    if types == {"string"}:
        return text, True
    try:
        return json.loads(text), True
    except ValueError:
        pass
    literal = _PY_LITERALS.get(text)
    if literal is not None and (types is None or literal[1] in types):
        return literal[0], True
    return text, types is None or "string" in types


def xml_arguments(raw: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one `<function=...>` block, or None when a value does not fit
    its declared type (or there is no function name)."""
    name = _FUNCTION.search(raw)
    if name is None:
        return None
    schemas = param_schemas(tools).get(name.group(1), {})
    args: dict[str, Any] = {}
    for m in _PARAM.finditer(raw):
        value, ok = xml_value(m.group(2).strip(), schemas.get(m.group(1)))
        if not ok:
            return None
        args[m.group(1)] = value
    return name.group(1), args
