"""The simulator's constrained decoding: a minimal deterministic instance of a constraint.

Reads the constraint as the engines receive it (SGLang `json_schema`/`regex`/`ebnf`
sampling params, vLLM `structured_outputs.{json, regex, grammar}`) and produces the
shortest text it accepts: for a JSON schema, objects with their required properties,
the first enum/const value, `minimum`-or-zero numbers, `minItems` arrays; for a GBNF
grammar, the shortest derivation of `root`. Unsupported constraints raise
`ConstraintError`, which the server answers as the engine would (HTTP 400).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["ConstraintError", "constrained_text", "ebnf_shortest", "schema_instance"]


class ConstraintError(ValueError):
    """The constraint is invalid or beyond the simulator (the engine's 400)."""


def constrained_text(kind: str, text: Any) -> str:
    """Shortest text satisfying a constraint of `kind` json_schema | ebnf (regex: refused)."""
    if kind == "json_schema":
        try:
            schema = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"Invalid grammar request: json_schema is not JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise ConstraintError("Invalid grammar request: json_schema must be an object")
        return json.dumps(schema_instance(schema, schema), ensure_ascii=False)
    if kind == "ebnf":
        if not isinstance(text, str):
            raise ConstraintError("Invalid grammar request: ebnf must be a string")
        return ebnf_shortest(text)
    raise ConstraintError(f"the simulator cannot generate for a {kind} constraint")


def schema_instance(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """A minimal value valid under `schema` (common keywords; `$ref` into `$defs`)."""
    if depth > 32:
        raise ConstraintError("Invalid grammar request: schema nests too deeply")
    if not isinstance(schema, dict):
        return {}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        node: Any = root
        for part in ref.lstrip("#/").split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise ConstraintError(f"Invalid grammar request: unresolvable $ref {ref!r}")
        return schema_instance(node, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return schema_instance(schema[key][0], root, depth + 1)
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), t[0] if t else None)
    if t == "object" or (t is None and "properties" in schema):
        props = schema.get("properties") or {}
        return {k: schema_instance(props.get(k, {}), root, depth + 1) for k in schema.get("required") or []}
    if t == "array":
        n = int(schema.get("minItems") or 0)
        return [schema_instance(schema.get("items") or {}, root, depth + 1) for _ in range(n)]
    if t == "string":
        return "a" * int(schema.get("minLength") or 0)
    if t in ("number", "integer"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        v = 0 if low is None else (low + 1 if "exclusiveMinimum" in schema and "minimum" not in schema else low)
        return int(v) if t == "integer" else v
    if t == "boolean":
        return False
    if t == "null":
        return None
    return {}


# --- GBNF shortest derivation -----------------------------------------------------------

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])|(?P<name>[A-Za-z_][\w-]*)|(?P<op>[()|?*+]))'
)
_ESC = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "/": "/", "]": "]", "[": "[", "-": "-", "^": "^"}
_INF = 10**9


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            out.append(_ESC.get(s[i + 1], s[i + 1]))
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _class_char(cls: str) -> str:
    body = cls[1:-1]
    if body.startswith("^"):
        banned = _unescape(body[1:])
        return next(c for c in "abcdefghijklmnopqrstuvwxyz0123456789 " if c not in banned)
    return _unescape(body[:2] if body.startswith("\\") else body[:1])


def _parse_expr(tokens: list[tuple[str, str]], i: int) -> tuple[Any, int]:
    alts: list[list[Any]] = [[]]
    while i < len(tokens):
        kind, val = tokens[i]
        if kind == "op" and val == ")":
            break
        if kind == "op" and val == "|":
            alts.append([])
            i += 1
            continue
        if kind == "op" and val == "(":
            item, i = _parse_expr(tokens, i + 1)
            if i >= len(tokens) or tokens[i] != ("op", ")"):
                raise ConstraintError("Invalid grammar request: unbalanced parenthesis")
            i += 1
        elif kind == "op":
            raise ConstraintError(f"Invalid grammar request: unexpected {val!r}")
        else:
            item = (kind, val)
            i += 1
        if i < len(tokens) and tokens[i][0] == "op" and tokens[i][1] in "?*+":
            item = ("rep", (tokens[i][1], item))
            i += 1
        alts[-1].append(item)
    return ("alt", alts), i


def _parse(grammar: str) -> dict[str, Any]:
    rules: dict[str, Any] = {}
    for line in grammar.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "::=" not in line:
            raise ConstraintError(f"Invalid grammar request: not a rule: {line[:60]!r}")
        name, body = (x.strip() for x in line.split("::=", 1))
        tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(body):
            m = _TOKEN.match(body, pos)
            if m is None or m.end() == pos:
                if body[pos:].strip() == "":
                    break
                raise ConstraintError(f"Invalid grammar request: cannot parse {body[pos:pos + 30]!r}")
            kind = m.lastgroup or ""
            tokens.append((kind, m.group(kind)))
            pos = m.end()
        expr, end = _parse_expr(tokens, 0)
        if end != len(tokens):
            raise ConstraintError("Invalid grammar request: unbalanced parenthesis")
        rules[name] = expr
    if "root" not in rules:
        raise ConstraintError("Invalid grammar request: no root rule")
    return rules


def ebnf_shortest(grammar: str) -> str:
    """The shortest string derived from `root` (ties: the first alternative)."""
    rules = _parse(grammar)
    length = dict.fromkeys(rules, _INF)

    def size(e: Any) -> int:
        kind, val = e
        if kind == "str":
            return len(_unescape(val[1:-1]))
        if kind == "cls":
            return 1
        if kind == "name":
            if val not in rules:
                raise ConstraintError(f"Invalid grammar request: undefined rule {val!r}")
            return length[val]
        if kind == "rep":
            return 0 if val[0] in "?*" else size(val[1])
        return min((min(_INF, sum(size(x) for x in seq)) for seq in val), default=0)

    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            n = size(expr)
            if n < length[name]:
                length[name], changed = n, True
    if length["root"] >= _INF:
        raise ConstraintError("Invalid grammar request: root derives no finite string")

    def derive(e: Any) -> str:
        kind, val = e
        if kind == "str":
            return _unescape(val[1:-1])
        if kind == "cls":
            return _class_char(val)
        if kind == "name":
            return derive(rules[val])
        if kind == "rep":
            return "" if val[0] in "?*" else derive(val[1])
        best = min(val, key=lambda seq: min(_INF, sum(size(x) for x in seq)))
        return "".join(derive(x) for x in best)

    return derive(rules["root"])
