"""`tool_choice` and `response_format`: typed request models and the engine constraint they imply.

Both fields are honoured with the engines' constrained decoding on the token-in
path, never ignored:

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

Grammars (`grammar.py`): GBNF as xgrammar reads it (`root ::= ...`), the default grammar
backend of SGLang (`ebnf`) and vLLM (`structured_outputs.grammar`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trajectory.codec.families import ToolCallFormat, ours_with
from trajectory.codec.probe import decode_text

from .errors import BadRequest, UpstreamInvalid
from .grammar import SchemaError, check_schema_size, hermes_tool_call_ebnf, schema_to_ebnf

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
    "SchemaError",
    "check_schema_size",
]

# families whose tool calls are Hermes JSON in <tool_call> tags (the family registry's)
HERMES_FAMILIES = ours_with(ToolCallFormat.HERMES)


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
    *,
    single_call: bool = False,
) -> tuple[Constraint | None, OutputPolicy]:
    """The constraint and parse policy for one request; BadRequest (400) naming the field.
    `single_call` (`parallel_tool_calls: false`): a forced call is exactly one call.

    Work is proportional to the schemas: callers run it off the event loop."""
    rf: Constraint | None = None
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            rf = Constraint("json_schema", '{"type": "object"}')
        else:
            if response_format.json_schema is None:
                raise BadRequest("response_format: type json_schema needs a json_schema object")
            schema = response_format.json_schema.schema_ or {"type": "object"}
            check_schema_size(schema, "response_format")
            rf = Constraint("json_schema", json.dumps(schema))
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
    params = [(n, by_name[n].get("parameters") or {}) for n in allowed]
    for n, p in params:
        check_schema_size(p, f"tools: {n!r} parameters")
    try:
        grammar = hermes_tool_call_ebnf(params, single=single_call)
    except SchemaError as exc:
        raise BadRequest(f"tool_choice: cannot build the tool-call grammar from the tools' parameters: {exc}") from exc
    return Constraint("ebnf", grammar), OutputPolicy(require_tool=tuple(allowed))


def request_constraint(req: Any, family: str) -> Constraint | None:
    """The constraint of a `ChatRequest` (BadRequest names the field it cannot honour)."""
    single = getattr(req, "parallel_tool_calls", None) is False
    return derive_constraint(req.tool_choice, req.response_format, req.tools, family, single_call=single)[0]


def apply_output_policy(parsed: Any, req: Any, codec: Any, valid: Any) -> Any:
    """Parse-side meaning of `tool_choice` (runs on the offload threads): `none` keeps markup as
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
        text = decode_text(codec.tokenizer, ids)
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


# words the engines' constraint errors use: SGLang "Invalid grammar request", xgrammar
# compile errors, vLLM "structured outputs" / "guided decoding" / "grammar" messages
_GRAMMAR_WORDS = re.compile(r"grammar|schema|json|ebnf|regex|structured|guided|constraint|xgrammar", re.I)


def engine_refusal(exc: Exception, constraint: Constraint | None, req: Any) -> BadRequest | None:
    """An engine's 4xx on a constrained request is the constraint it cannot compile:
    a 400 naming the request field, with the engine's words (never a silent retry)."""
    status = getattr(exc, "http_status", None)
    if constraint is None or not isinstance(status, int) or not 400 <= status < 500:
        return None
    if not _GRAMMAR_WORDS.search(str(exc)):
        return None  # a 4xx about something else (length, auth, a bad id) is not the constraint's
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
