"""JSON schemas -> GBNF grammars, as xgrammar reads them (SGLang `ebnf`, vLLM
`structured_outputs.grammar`), with bounds so a client schema cannot make the
server recurse or build without limit (each bound is a 400 naming the field).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import BadRequest

__all__ = [
    "MAX_GRAMMAR_RULES",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "SchemaError",
    "check_schema_size",
    "hermes_tool_call_ebnf",
    "schema_to_ebnf",
]

MAX_SCHEMA_DEPTH = 32  # nesting of a schema (and of $ref chains) we turn into a grammar
MAX_GRAMMAR_RULES = 4096  # rules one request's grammar may need
MAX_SCHEMA_NODES = 20_000  # JSON nodes of one response_format schema


class SchemaError(ValueError):
    """A schema we cannot (or must not) turn into a constraint: the client's 400."""


def _lit(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _json_lit(v: Any) -> str:
    """A grammar literal of one JSON value, non-ASCII kept as text (what models write)."""
    return _lit(json.dumps(v, ensure_ascii=False))


# Whitespace between JSON tokens is bounded: enough for any gap a model writes (a newline
# and 7 levels of 2-space indent), never unbounded. With `[ \t\n]*` a model that prefers
# whitespace (seen: random weights under vLLM 0.32's xgrammar) fills the turn with it and
# never closes the call. Written as nested optionals: every backend's EBNF takes that.
WS_MAX = 16


def _bounded_ws(n: int) -> str:
    body = ""
    for _ in range(n):
        body = f"( [ \\t\\n] {body} )?" if body else "[ \\t\\n]?"
    return f"ws ::= {body}\n"


# JSON strings (RFC 8259 s7): no raw control characters, escapes include \uXXXX
_BASE = _bounded_ws(WS_MAX) + r"""str ::= "\"" chr* "\""
chr ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" hex hex hex hex )
hex ::= [0-9a-fA-F]
num ::= "-"? int frac? exp?
int ::= "0" | [1-9] [0-9]*
frac ::= "." [0-9]+
exp ::= [eE] [-+]? [0-9]+
integer ::= "-"? int
boolean ::= "true" | "false"
null ::= "null"
value ::= object | array | str | num | boolean | null
object ::= "{" ws ( str ws ":" ws value ws ( "," ws str ws ":" ws value ws )* )? "}"
array ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
"""

_SCALARS = {"string": "str", "number": "num", "integer": "integer", "boolean": "boolean", "null": "null"}
_TYPES = frozenset({*_SCALARS, "object", "array"})


def _pointer(root: Any, ref: str) -> Any:
    """Resolve a local JSON pointer `#/a/b~1c` inside `root` (RFC 6901)."""
    if not ref.startswith("#"):
        raise SchemaError(f"$ref {ref!r}: only local references (#/...) are supported")
    node = root
    for raw in [p for p in ref[1:].split("/") if p != ""]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"$ref {ref!r} does not resolve")
    return node


class _Ebnf:
    """Builds grammar rules for JSON schemas. Each schema root gets its own namespace, so
    `$ref`s of two tools never collide; `$ref` chains and nesting are bounded."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self._refs: dict[tuple[str, str], str] = {}
        self.n = 0

    def rule(self, body: str) -> str:
        if len(self.rules) >= MAX_GRAMMAR_RULES:
            raise SchemaError(f"the schema needs more than {MAX_GRAMMAR_RULES} grammar rules")
        self.n += 1
        name = f"r{self.n}"
        self.rules[name] = body
        return name

    def root(self, schema: Any, ns: str) -> str:
        return self.of(schema, schema, ns, 0)

    def of(self, schema: Any, root: Any, ns: str, depth: int) -> str:
        """A rule (name or inline expression) for the values of `schema`."""
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if schema is True or schema == {}:
            return "value"
        if schema is False:
            raise SchemaError("a `false` schema admits no value")
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object or a boolean, not {type(schema).__name__}")
        d = depth + 1
        ref = schema.get("$ref")
        if ref is not None:
            if not isinstance(ref, str):
                raise SchemaError("$ref must be a string")
            return self._ref(ref, root, ns, d)
        if "const" in schema:
            return _json_lit(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError("enum must be a non-empty array")
            return "( " + " | ".join(_json_lit(v) for v in values) + " )"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                alts = schema[key]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError(f"{key} must be a non-empty array")
                return "( " + " | ".join(self.of(a, root, ns, d) for a in alts) + " )"
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and len(all_of) == 1:
            return self.of(all_of[0], root, ns, d)
        t = schema.get("type")
        if isinstance(t, list):
            if not t or not all(isinstance(x, str) for x in t):
                raise SchemaError("type must be a string or a non-empty array of strings")
            return "( " + " | ".join(self.of({**schema, "type": x}, root, ns, d) for x in t) + " )"
        if t is not None and t not in _TYPES:
            raise SchemaError(f"unknown type {t!r}")
        if t == "object" or (t is None and "properties" in schema):
            return self._object(schema, root, ns, d)
        if t == "array":
            items = schema.get("items")
            item = "value" if items is None or isinstance(items, list) else self.of(items, root, ns, d)
            return self.rule(f'"[" ws ( {item} ws ( "," ws {item} ws )* )? "]"')
        return _SCALARS.get(str(t), "value")

    def _ref(self, ref: str, root: Any, ns: str, depth: int) -> str:
        key = (ns, ref)
        name = self._refs.get(key)
        if name is None:
            name = self.rule("value")  # reserved first: a recursive $ref names itself
            self._refs[key] = name
            self.rules[name] = self.of(_pointer(root, ref), root, ns, depth)
        return name

    def _object(self, schema: dict[str, Any], root: Any, ns: str, depth: int) -> str:
        props = schema.get("properties")
        if props is None or props == {}:
            return "object"
        if not isinstance(props, dict):
            raise SchemaError("properties must be an object")
        req = schema.get("required", [])
        if not isinstance(req, list) or not all(isinstance(k, str) for k in req):
            raise SchemaError("required must be an array of strings")
        required = [k for k in props if k in req]  # declaration order, as models write them
        optional = [k for k in props if k not in req]
        pair = {k: f"{_json_lit(k)} ws \":\" ws {self.of(props[k], root, ns, depth)}" for k in props}
        body = ' ws "," ws '.join(pair[k] for k in required)
        # any ordered subset of the optional keys: sub_i = pair_i ( "," sub_{i+1} )? | sub_{i+1}
        sub: str | None = None
        for k in reversed(optional):
            sub = self.rule(pair[k] if sub is None else f'{pair[k]} ( ws "," ws {sub} )? | {sub}')
        if not required:
            inner = f"( {sub} )?" if sub else ""
        else:
            inner = body + (f' ( ws "," ws {sub} )?' if sub else "")
        return self.rule(f'"{{" ws {inner} ws "}}"')


def schema_to_ebnf(schema: Any, root: str = "root") -> str:
    """A GBNF grammar whose `root` matches JSON values of `schema` (common keywords)."""
    g = _Ebnf()
    top = g.root(schema, "s")
    lines = [f"{root} ::= {top}"] + [f"{k} ::= {v}" for k, v in g.rules.items()]
    return "\n".join(lines) + "\n" + _BASE


def hermes_tool_call_ebnf(tools: list[tuple[str, Any]], *, single: bool = False) -> str:
    """`<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>` (one or more; exactly one
    when `single`), optional think first."""
    g = _Ebnf()
    alts = []
    for i, (name, params) in enumerate(tools):
        args = g.root(params if params else {"type": "object"}, f"t{i}")
        alts.append(
            f'"{{" ws "\\"name\\"" ws ":" ws {_json_lit(name)} ws "," ws "\\"arguments\\"" ws ":" ws {args} ws "}}"'
        )
    lines = [
        'root ::= think? ws call' + ('' if single else ' ( ws call )*'),
        'think ::= "<think>" [^<]* "</think>"',
        'call ::= "<tool_call>" ws callbody ws "</tool_call>"',
        "callbody ::= " + " | ".join(f"( {a} )" for a in alts),
    ] + [f"{k} ::= {v}" for k, v in g.rules.items()]
    return "\n".join(lines) + "\n" + _BASE


def check_schema_size(schema: Any, where: str) -> None:
    """Bound a client schema's nesting and size before anything recurses over it (400)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise BadRequest(f"{where}: the schema has more than {MAX_SCHEMA_NODES} nodes")
        if depth > 2 * MAX_SCHEMA_DEPTH:
            raise BadRequest(f"{where}: the schema nests deeper than {2 * MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
