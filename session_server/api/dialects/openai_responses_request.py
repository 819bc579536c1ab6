"""A Responses request as the pipeline's `ChatRequest`: the request side of the
OpenAI Responses dialect (`openai_responses.py`, whose module doc says how items map
onto chat messages).

Validation of the body, `input` items -> chat messages, function tools and
`tool_choice` in chat form, `reasoning.effort` -> template switches,
`previous_response_id` -> the stored line's messages, and the `Echo` of what the
response object repeats. Kept apart from the response side
(`openai_responses_output.py`) because the two share only the `Echo`.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, ValidationError

from trajectory.errors import BranchError

from ...errors import BadRequest, NotFound, shown
from ...turn.chat_request import ChatRequest, SamplingFields, TemplateKwargs, TimeoutS, WeightLag
from ..models import parse_json_model

_log = logging.getLogger("session_server")
_MODEL = "tito-session"
# `include` value that asks for reasoning the client can send back with `store: false`
# (Codex does): ours is the reasoning text itself, tagged, not encrypted
ENCRYPTED_REASONING = "reasoning.encrypted_content"
TEXT_LOGPROBS = "message.output_text.logprobs"  # `include` value: output_text with its tokens' logprobs
_ENCRYPTED_TAG = "tito-reasoning-v1:"
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ReasoningConfig(BaseModel):
    """`reasoning: {effort, summary}` (`openai/types/shared/reasoning.py`)."""

    model_config = ConfigDict(extra="allow")
    effort: Effort | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """`POST /sessions/{sid}/v1/responses` (`response_create_params.py`). Unknown keys
    are accepted and ignored, like the chat request's; sampling bounds are the chat
    request's (checked once the request is mapped)."""

    model_config = ConfigDict(extra="allow")

    input: str | list[dict[str, Any]] = Field(
        description="a user message, or items: message, function_call, function_call_output, reasoning")
    model: str | None = None
    instructions: str | None = Field(default=None, description="a leading system message, this request only")
    tools: list[dict[str, Any]] | None = Field(default=None, description="function tools; other types are left out of the prompt")
    tool_choice: str | dict[str, Any] | None = None
    # strict: `"5"`, `true`, `"yes"` are a 400 (the SDK types: int, float, bool), never coerced
    max_output_tokens: int | None = Field(default=None, strict=True)
    temperature: float | None = Field(default=None, strict=True)
    top_p: float | None = Field(default=None, strict=True)
    reasoning: ReasoningConfig | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool = Field(default=True, description="keep the response for previous_response_id and GET")
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = Field(default=None, description="a stored response of this session")
    stream: StrictBool = False
    text: dict[str, Any] | None = Field(default=None, description="{format: text | json_object | json_schema}")
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=20,
                                     description="alternatives per output_text token")
    chat_template_kwargs: TemplateKwargs | None = None
    timeout_s: TimeoutS | None = None
    max_weight_lag: WeightLag | None = None


@dataclass(frozen=True)
class Echo:
    """What a response object repeats of its request (and what ids it needs)."""

    created_at: int
    model: str
    instructions: str | None = None
    n_instructions: int = 0  # leading messages that came from `instructions` (0 or 1)
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    encrypted_reasoning: bool = False
    logprobs: bool = False  # `message.output_text.logprobs` included (or top_logprobs asked)
    top_logprobs: int | None = None


class ResponsesTurn(ChatRequest):
    """The internal turn request of a Responses call, with what its response echoes."""

    _echo: Echo = PrivateAttr(default_factory=lambda: Echo(created_at=int(time.time()), model=_MODEL))

    @property
    def echo(self) -> Echo:
        return self._echo


# -- request -> ChatRequest -------------------------------------------------------------


def _bad(where: str, what: str) -> BadRequest:
    return BadRequest(f"{where}: {what}")


def _text(where: str, content: Any) -> str:
    """Message content: a string, or text parts (`input_text`, `output_text`) joined.
    Images, files and audio are refused by their type: this server serves text models."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of input_text/output_text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise _bad(f"{where}[{j}]", f"content part type {kind!r} is not supported (text models: input_text, "
                                        "output_text)")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _str_field(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise _bad(f"{where}.{key}", "must be a non-empty string" if key != "arguments" else "must be a string")
    return value


def encode_reasoning(text: str) -> str:
    """`encrypted_content` of our reasoning items: the text, tagged (nothing to hide
    from the trainer that owns the server; the tag tells ours from another server's)."""
    return _ENCRYPTED_TAG + base64.b64encode(text.encode()).decode()


def _reasoning_text(item: Mapping[str, Any], where: str) -> str | None:
    """The reasoning an item carries: its `reasoning_text` parts, else our
    `encrypted_content`. A summary is not what was sampled, so it is never used."""
    parts = item.get("content")
    if isinstance(parts, list) and parts:
        return _text(f"{where}.content", [{**p, "type": "text"} if isinstance(p, dict) and
                                          p.get("type") == "reasoning_text" else p for p in parts])
    blob = item.get("encrypted_content")
    if isinstance(blob, str) and blob.startswith(_ENCRYPTED_TAG):
        try:
            return base64.b64decode(blob[len(_ENCRYPTED_TAG):], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise _bad(f"{where}.encrypted_content", "is not reasoning this server returned") from None
    return None


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages. Consecutive reasoning / assistant message /
    function_call items are one assistant turn (see the module doc)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled

    def assistant(starts_new: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        nonlocal turn
        if turn is None or starts_new(turn):
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _text(f"{where}.content", item.get("content"))
            if role == "assistant":
                assistant(lambda t: bool(t["content"] or t.get("tool_calls")))["content"] = text
                continue
            if role not in ("user", "system", "developer"):
                raise _bad(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}")
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": _str_field(item, "arguments", where)}}
            assistant(lambda t: False).setdefault("tool_calls", []).append(call)
            continue
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                        "content": _text(f"{where}.output", output)})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
            msg = assistant(lambda t: bool(t["content"] or t.get("tool_calls") or t.get("reasoning_content")))
            if reasoning:
                msg["reasoning_content"] = reasoning
            continue
        else:
            raise _bad(f"{where}.type", f"item type {kind!r} is not supported (this server runs function tools "
                                        "only: message, function_call, function_call_output, reasoning)")
        turn = None
    return out


# `FunctionToolParam` (`openai/types/responses/function_tool_param.py`): description
# Optional[str], parameters Optional[Dict[str, object]], strict Optional[bool]
_FUNCTION_TOOL_FIELDS: tuple[tuple[str, type, str], ...] = (
    ("description", str, "a string"), ("parameters", dict, "a JSON schema object"), ("strict", bool, "a boolean"))


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat form. Other tool types (hosted `web_search`, `file_search`,
    Codex's `namespace` groups and freeform `custom` tools, ...) have no function-call
    form a chat template renders, and hosted ones run on OpenAI's side: they are left
    out of what the model sees, with a logged warning, so an agent that always sends
    them (Codex CLI) still runs with its function tools. Forcing one through
    `tool_choice` is a 400 (`chat_tool_choice`)."""
    if not tools:
        return None
    out = []
    dropped: list[str] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}]", "must be a tool object")
        kind = t.get("type")
        if not isinstance(kind, str) or not kind:  # `type` is Required in every `ToolParam`
            raise _bad(f"tools[{i}].type", "must be a tool type string (function, web_search, custom, ...)")
        if kind != "function":
            dropped.append(f"{kind}:{t['name']}" if isinstance(t.get("name"), str) else kind)
            continue
        fn: dict[str, Any] = {"name": _str_field(t, "name", f"tools[{i}]")}
        for key, kinds, what in _FUNCTION_TOOL_FIELDS:
            if t.get(key) is None:
                continue
            if not isinstance(t[key], kinds) or (kinds is dict and isinstance(t[key], bool)):
                raise _bad(f"tools[{i}].{key}", f"must be {what}, got {type(t[key]).__name__}")
            fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    if dropped:
        _log.warning("responses: tools the model cannot call here were left out of the prompt "
                     "(function tools only): %s", ", ".join(dropped))
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None,
                     tools: list[dict[str, Any]] | None) -> tuple[Any, list[dict[str, Any]] | None]:
    """`tool_choice` in chat form: a mode, `{type: function, name}`, or `allowed_tools`
    (the tools narrowed to those named, with its mode)."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": _str_field(choice, "name", "tool_choice")}}, tools
    if kind == "allowed_tools":
        listed = choice.get("tools")
        if not isinstance(listed, list):
            raise _bad("tool_choice.tools", "must be a list of {type: function, name}")
        names = {t.get("name") for t in listed if isinstance(t, dict) and isinstance(t.get("name"), str)}
        kept = [t for t in tools or [] if t["function"]["name"] in names]
        return choice.get("mode", "auto"), kept or None
    raise _bad("tool_choice.type", f"{kind!r} is not supported (function tools only)")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` (`response_format_text_config_param.py`) in chat form."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


TEMPLATE_SWITCHES = ("enable_thinking", "thinking", "reasoning_effort")


def template_switches(tokenizer: Any) -> frozenset[str]:
    """The reasoning switches a chat template reads (`reasoning.effort` maps onto them)."""
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else str(template or "")
    return frozenset(k for k in TEMPLATE_SWITCHES if re.search(rf"(?<![\w.]){k}\b", text))


def reasoning_kwargs(effort: str | None, switches: frozenset[str]) -> dict[str, Any]:
    """`reasoning.effort` as template kwargs: none/minimal turn a thinking switch off,
    any other effort on; a template that reads `reasoning_effort` (gpt-oss) gets it."""
    if effort is None:
        return {}
    on = effort not in ("none", "minimal")
    kwargs: dict[str, Any] = {k: on for k in ("enable_thinking", "thinking") if k in switches}
    if "reasoning_effort" in switches:
        kwargs["reasoning_effort"] = {"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort)
    return kwargs


def resolve_previous(session: Any, previous_id: str) -> list[dict[str, Any]]:
    """The conversation up to a stored response of `session`, its own instructions
    left out: the committed messages of its branch's line through its turn (a copy)."""
    stored = session.responses.get(previous_id) if session is not None else None
    if stored is None:
        raise NotFound(f"previous_response_id {shown(previous_id)} is not a stored response of this session "
                       "(unknown, another session's, or created with store: false)")
    try:
        traj = session.tree.get(stored.branch_id).trajectory
    except BranchError:
        raise NotFound(f"previous_response_id {shown(previous_id)}: its branch is gone") from None
    end = traj.message_counts_view()[stored.turn_index + 1]
    msgs = [traj.message(i) for i in range(stored.echo.n_instructions, end)]
    copied: list[dict[str, Any]] = orjson.loads(orjson.dumps(msgs))
    return copied


def parse_responses(body: bytes, *, session: Any = None, switches: frozenset[str] = frozenset()) -> ResponsesTurn:
    """A Responses body as the pipeline's `ChatRequest` (runs on the offload threads)."""
    spec: ResponsesRequest = parse_json_model(body, ResponsesRequest)
    tools = chat_tools(spec.tools)
    tool_choice, tools = chat_tool_choice(spec.tool_choice, tools)
    history = resolve_previous(session, spec.previous_response_id) if spec.previous_response_id else []
    head = [{"role": "system", "content": spec.instructions}] if spec.instructions else []
    effort = spec.reasoning.effort if spec.reasoning else None
    kwargs = {**reasoning_kwargs(effort, switches), **(spec.chat_template_kwargs or {})}
    extra = spec.model_extra or {}
    logprobs = TEXT_LOGPROBS in (spec.include or ()) or bool(spec.top_logprobs)
    chat: dict[str, Any] = {
        **{k: extra[k] for k in SamplingFields.model_fields if k in extra},  # top_k, seed, stop, ...
        "messages": head + history + input_messages(spec.input),
        "model": spec.model, "tools": tools, "tool_choice": tool_choice,
        "max_tokens": spec.max_output_tokens, "temperature": spec.temperature, "top_p": spec.top_p,
        "response_format": _response_format(spec.text), "stream": spec.stream,
        "logprobs": logprobs or None, "top_logprobs": spec.top_logprobs if logprobs else None,
        "chat_template_kwargs": kwargs or None, "timeout_s": spec.timeout_s,
        "max_weight_lag": spec.max_weight_lag, "parallel_tool_calls": spec.parallel_tool_calls,
    }
    try:
        req = ResponsesTurn.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise BadRequest(f"invalid request: {errs}") from exc
    req._echo = Echo(
        created_at=int(time.time()), model=spec.model or _MODEL, instructions=spec.instructions,
        n_instructions=len(head), previous_response_id=spec.previous_response_id, tools=spec.tools or [],
        tool_choice=spec.tool_choice or "auto", temperature=spec.temperature, top_p=spec.top_p,
        max_output_tokens=spec.max_output_tokens, metadata=spec.metadata or {},
        parallel_tool_calls=True if spec.parallel_tool_calls is None else spec.parallel_tool_calls,
        reasoning=spec.reasoning.model_dump(exclude_none=True) if spec.reasoning else None, store=spec.store,
        text=spec.text, encrypted_reasoning=ENCRYPTED_REASONING in (spec.include or ()),
        logprobs=logprobs, top_logprobs=spec.top_logprobs,
    )
    if isinstance(key := extra.get("prompt_cache_key"), str):  # Codex: its thread id (api/lineage.py)
        req._lineage_hints["prompt_cache_key"] = key
    return req
