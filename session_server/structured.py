"""`tool_choice` and `response_format`: typed request models and the engine constraint they imply.

Both fields are honoured with the engines' constrained decoding on the token-in
path, never ignored (issue 16 item 3):

- `response_format` `json_schema` -> a `json_schema` constraint (the schema as JSON
  text); `json_object` -> the schema `{"type": "object"}`; `text` -> nothing.
- `tool_choice` `required` or a named function -> an EBNF grammar of the codec
  family's tool-call format wrapping each allowed tool's parameter schema; `auto`
  -> nothing; `none` -> nothing, and the output is content (no tool-call parsing).
- both a JSON `response_format` and a forcing `tool_choice`: 400 naming both (one
  constraint per request: SGLang `SamplingParams.verify` refuses more than one of
  `json_schema`/`regex`/`ebnf`; vLLM `StructuredOutputsParams` likewise).
- a family whose tool-call format we cannot express: 400 naming `tool_choice`.

Reasoning models (Qwen3) open with `<think>...</think>`: the tool-call grammar
allows an optional think block first (its text may not contain `<`), then
whitespace, then the call(s). A server that skips the grammar inside reasoning
(vLLM/SGLang reasoning parsers) sees the same grammar with the think block absent.

Parsing: with `required`/named, the output must parse as tool call(s) of the
allowed names; otherwise the engine did not honour the constraint and the turn is
a 502 with nothing committed (`check_tool_calls`). With `none`, tool-call markup
the model still writes is returned as content (`as_content`).

Grammar dialect: GBNF as xgrammar reads it (`root ::= ...`), the default grammar
backend of SGLang (`ebnf`) and vLLM (`structured_outputs.grammar`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import BadRequest, UpstreamInvalid

__all__ = [
    "Constraint",
    "NamedToolChoice",
    "OutputPolicy",
    "ResponseFormat",
    "ToolChoice",
    "as_content",
    "apply_output_policy",
    "check_tool_calls",
    "engine_refusal",
    "request_constraint",
    "derive_constraint",
    "hermes_tool_call_ebnf",
    "schema_to_ebnf",
]

# families whose tool calls are Hermes JSON in <tool_call> tags (trajectory/codec/parsing.py)
HERMES_FAMILIES = frozenset({"qwen3"})


class _Fn(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: _Fn


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaSpec | None = None


@dataclass(frozen=True)
class Constraint:
    """Engine-neutral constraint: adapters map `kind` to their own field."""

    kind: Literal["json_schema", "regex", "ebnf"]
    text: str


@dataclass(frozen=True)
class OutputPolicy:
    """What the constraint means for parsing the sampled output."""

    parse_tools: bool = True  # False for tool_choice none: the output is content
    require_tool: tuple[str, ...] | None = None  # names a tool call must use (required/named)


def _tool_fn(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) else {}


def derive_constraint(
    tool_choice: ToolChoice | None,
    response_format: ResponseFormat | None,
    tools: list[dict[str, Any]] | None,
    family: str,
) -> tuple[Constraint | None, OutputPolicy]:
    """The constraint and parse policy for one request; BadRequest (400) naming the field."""
    rf: Constraint | None = None
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            rf = Constraint("json_schema", '{"type": "object"}')
        else:
            if response_format.json_schema is None:
                raise BadRequest("response_format: type json_schema needs a json_schema object")
            rf = Constraint("json_schema", json.dumps(response_format.json_schema.schema_ or {"type": "object"}))
    if tool_choice is None or tool_choice == "auto":
        return rf, OutputPolicy()
    if tool_choice == "none":
        return rf, OutputPolicy(parse_tools=False)
    by_name: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = _tool_fn(t)
        if isinstance(fn.get("name"), str):
            by_name[fn["name"]] = fn
    if not by_name:
        raise BadRequest("tool_choice: requires a tool call but the request has no tools")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in by_name:
            raise BadRequest(f"tool_choice: function {name!r} is not among the request's tools {sorted(by_name)}")
        allowed = [name]
    else:
        allowed = sorted(by_name)
    if rf is not None:
        raise BadRequest(
            "response_format and tool_choice: only one constraint per request "
            "(a JSON response_format cannot be combined with a forced tool call)"
        )
    if family not in HERMES_FAMILIES:
        raise BadRequest(
            f"tool_choice: {tool_choice if isinstance(tool_choice, str) else 'a named function'} "
            f"cannot be enforced for the {family!r} chat-template family (no tool-call grammar); "
            "use tool_choice auto"
        )
    grammar = hermes_tool_call_ebnf([(n, by_name[n].get("parameters") or {}) for n in allowed])
    return Constraint("ebnf", grammar), OutputPolicy(require_tool=tuple(allowed))


def request_constraint(req: Any, family: str) -> Constraint | None:
    """The constraint of a `ChatRequest` (BadRequest names the field it cannot honour)."""
    return derive_constraint(req.tool_choice, req.response_format, req.tools, family)[0]


def apply_output_policy(parsed: Any, req: Any, codec: Any, valid: Any) -> Any:
    """Parse-side meaning of `tool_choice` (runs in the pool): `none` keeps markup as
    content; `required`/named must have produced an allowed call (else 502), unless the
    output was cut short (finish length/abort: an unfinished call is the budget's doing)."""
    sampled_ids = valid.ids.tolist()
    tc = req.tool_choice
    if tc is None or tc == "auto":
        return parsed
    if tc == "none":
        if not getattr(parsed, "tool_calls", None):
            return parsed
        ids = list(sampled_ids)
        if ids and ids[-1] in codec.stop_token_ids:
            ids = ids[:-1]
        text = codec.tokenizer.decode(ids, skip_special_tokens=False)
        reasoning = parsed.reasoning_content
        if reasoning is not None and "</think>" in text:
            text = text.split("</think>", 1)[1].lstrip("\n")
        return as_content(parsed, text)
    allowed = (tc.function.name,) if isinstance(tc, NamedToolChoice) else tuple(
        sorted(n for n in (_tool_fn(t).get("name") for t in req.tools or []) if n)
    )
    if valid.finish_reason == "stop":
        check_tool_calls(parsed, OutputPolicy(require_tool=allowed))
    return parsed


def engine_refusal(exc: Exception, constraint: Constraint | None, req: Any) -> BadRequest | None:
    """An engine's 4xx on a constrained request is the constraint it cannot compile:
    a 400 naming the request field, with the engine's words (never a silent retry)."""
    status = getattr(exc, "http_status", None)
    if constraint is None or not isinstance(status, int) or not 400 <= status < 500:
        return None
    field = "tool_choice" if constraint.kind == "ebnf" else "response_format"
    if field == "response_format" and req.response_format is None:
        field = "tool_choice"
    return BadRequest(f"{field}: the engine cannot enforce this constraint ({status}): {exc}")


def check_tool_calls(parsed: Any, policy: OutputPolicy) -> None:
    """A forced tool call must have been produced; else the engine ignored the constraint (502)."""
    if policy.require_tool is None:
        return
    calls = getattr(parsed, "tool_calls", None) or []
    if not calls:
        raise UpstreamInvalid("tool_choice forced a tool call but the engine output has none")
    bad = [c.name for c in calls if c.name not in policy.require_tool]
    if bad:
        raise UpstreamInvalid(f"tool_choice allowed {list(policy.require_tool)} but the output called {bad}")


def as_content(parsed: Any, text: str) -> Any:
    """tool_choice none: tool-call markup is content, never a call."""
    if not getattr(parsed, "tool_calls", None):
        return parsed
    from trajectory.codec.base import ParsedAssistant

    return ParsedAssistant(content=text, reasoning_content=parsed.reasoning_content)


# --- EBNF (GBNF, as xgrammar reads it) -------------------------------------------------


def _lit(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_BASE = r"""ws ::= [ \t\n]*
str ::= "\"" chr* "\""
chr ::= [^"\\\n] | "\\" ["\\/bfnrt]
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


class _Ebnf:
    def __init__(self, defs: dict[str, Any]) -> None:
        self.rules: dict[str, str] = {}
        self.defs = defs
        self.n = 0

    def rule(self, body: str) -> str:
        self.n += 1
        name = f"r{self.n}"
        self.rules[name] = body
        return name

    def of(self, schema: Any) -> str:
        """A rule (name or inline expression) for values of `schema`; unknown keywords: any JSON."""
        if not isinstance(schema, dict) or not schema:
            return "value"
        ref = schema.get("$ref")
        if isinstance(ref, str):
            key = ref.rsplit("/", 1)[-1]
            name = f"def_{''.join(c if c.isalnum() else '_' for c in key)}"
            if name not in self.rules:
                self.rules[name] = "value"  # placeholder against recursion
                self.rules[name] = self.of(self.defs.get(key, {}))
            return name
        if "const" in schema:
            return _lit(json.dumps(schema["const"]))
        if "enum" in schema:
            return "( " + " | ".join(_lit(json.dumps(v)) for v in schema["enum"]) + " )"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                return "( " + " | ".join(self.of(s) for s in schema[key]) + " )"
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            return self.of(schema["allOf"][0])
        t = schema.get("type")
        if isinstance(t, list):
            return "( " + " | ".join(self.of({**schema, "type": x}) for x in t) + " )"
        if t == "object":
            return self._object(schema)
        if t == "array":
            item = self.of(schema.get("items"))
            return self.rule(f'"[" ws ( {item} ws ( "," ws {item} ws )* )? "]"')
        return {"string": "str", "number": "num", "integer": "integer", "boolean": "boolean",
                "null": "null"}.get(str(t), "value")

    def _object(self, schema: dict[str, Any]) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return "object"
        required = [k for k in schema.get("required") or [] if k in props]
        optional = [k for k in props if k not in required]
        parts = [f"{_lit(json.dumps(k))} ws \":\" ws {self.of(props[k])}" for k in required]
        body = ' ws "," ws '.join(parts)
        # optional properties: any subset, in declaration order, after the required ones
        tail = " ".join(
            f'( "," ws {_lit(json.dumps(k))} ws ":" ws {self.of(props[k])} ws )?' for k in optional
        )
        if not parts:
            # without required keys a leading comma cannot be placed safely: only the first
            # optional key (or none) is allowed, then the others after a comma
            first = optional[0]
            rest = " ".join(
                f'( "," ws {_lit(json.dumps(k))} ws ":" ws {self.of(props[k])} ws )?' for k in optional[1:]
            )
            return self.rule(f'"{{" ws ( {_lit(json.dumps(first))} ws ":" ws {self.of(props[first])} ws {rest} )? "}}"')
        return self.rule(f'"{{" ws {body} ws {tail} "}}"')


def schema_to_ebnf(schema: Any, root: str = "root") -> str:
    """A GBNF grammar whose `root` matches JSON values of `schema` (common keywords)."""
    defs = dict((schema or {}).get("$defs") or (schema or {}).get("definitions") or {}) if isinstance(schema, dict) else {}
    g = _Ebnf(defs)
    top = g.of(schema)
    lines = [f"{root} ::= {top}"] + [f"{k} ::= {v}" for k, v in g.rules.items()]
    return "\n".join(lines) + "\n" + _BASE


def hermes_tool_call_ebnf(tools: list[tuple[str, Any]]) -> str:
    """`<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>` (one or more), optional think first."""
    g = _Ebnf({})
    alts = []
    for name, params in tools:
        if isinstance(params, dict):
            g.defs.update(params.get("$defs") or params.get("definitions") or {})
        args = g.of(params if isinstance(params, dict) and params else {"type": "object"})
        alts.append(
            f'"{{" ws "\\"name\\"" ws ":" ws {_lit(json.dumps(name))} ws "," ws "\\"arguments\\"" ws ":" ws {args} ws "}}"'
        )
    lines = [
        'root ::= think? ws call ( ws call )*',
        'think ::= "<think>" [^<]* "</think>"',
        'call ::= "<tool_call>" ws callbody ws "</tool_call>"',
        "callbody ::= " + " | ".join(f"( {a} )" for a in alts),
    ] + [f"{k} ::= {v}" for k, v in g.rules.items()]
    return "\n".join(lines) + "\n" + _BASE
