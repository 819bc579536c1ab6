"""The OpenAI Responses dialect (issue 12.1): `POST .../v1/responses` -> `ChatRequest`, and
a committed turn -> a `response` object, or stream events -> Responses SSE events.

Field facts are the `openai` SDK's (2.54, `openai/types/responses/`): `Response`
(`response.py`), output items `ResponseReasoningItem` / `ResponseOutputMessage` /
`ResponseFunctionToolCall`, input items (`response_input_item_param.py`: `message`,
`function_call`, `function_call_output`, `reasoning`), `ResponseUsage` and the stream
events `Response*Event` (each carries `sequence_number`).

How items map onto the internal chat messages, so that every dialect writes the same
trajectory (a session may mix them):

- `instructions` -> a leading `system` message (not carried over by
  `previous_response_id`, as OpenAI documents on `Response.instructions`);
- `message` items -> messages of their role (text parts joined);
- consecutive `reasoning`, assistant `message` and `function_call` items -> ONE
  assistant message (`reasoning_content`, `content`, `tool_calls` with `id = call_id`):
  exactly the message the turn committed, so the history attaches where it was
  sampled (`trajectory.history.attach`);
- `function_call_output` -> a `tool` message (`tool_call_id = call_id`).

`previous_response_id` resolves against the session: a stored response is its branch
and turn in the trajectory tree, so the conversation up to it is that line's committed
messages (nothing copied per response), and the new request attaches at that turn's
checkpoint (a later response is rolled back from, not appended to).
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

from trajectory.codec.probe import decode_text
from trajectory.errors import BranchError

from ...errors import BadRequest, NotFound, shown
from ...turn.pipeline import TurnOutput
from ..models import (
    ChatRequest,
    SamplingFields,
    TemplateKwargs,
    TimeoutS,
    WeightLag,
    parse_json_model,
)
from ..stream_events import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    ToolArgumentsDelta,
    ToolCallStarted,
    TurnCommitted,
    TurnFailed,
    TurnStarted,
    replay,
)
from .openai_chat import logprobs_content

_log = logging.getLogger("session_server")
_MODEL = "tito-session"
# `include` value that asks for reasoning the client can send back with `store: false`
# (Codex does): ours is the reasoning text itself, tagged, not encrypted
ENCRYPTED_REASONING = "reasoning.encrypted_content"
TEXT_LOGPROBS = "message.output_text.logprobs"  # `include` value: output_text with its tokens' logprobs
_ENCRYPTED_TAG = "tito-reasoning-v1:"
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_THINK_END = "</think>"
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


@dataclass(frozen=True)
class Outcome:
    """What a committed turn puts in its response object: kept per stored response for
    `GET .../responses/{id}` (no ids or logprobs: those live in the trajectory)."""

    request_id: str
    message: dict[str, Any]
    finish_reason: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    text_logprobs: tuple[dict[str, Any], ...] = ()  # output_text's, when asked (never stored)


@dataclass(frozen=True)
class StoredResponse:
    """A response of this session: where its turn is in the tree, and its object's parts."""

    echo: Echo
    outcome: Outcome
    branch_id: int
    turn_index: int


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
    return req


# -- committed turn -> response object ---------------------------------------------------


def _reasoning_tokens(out: TurnOutput, tokenizer: Any) -> int:
    """Sampled tokens before the think block's end (`</think>`, one special token in
    the thinking families); 0 when the turn did not reason or has no such token."""
    if not out.message.get("reasoning_content"):
        return 0
    try:
        end = tokenizer.convert_tokens_to_ids(_THINK_END)
    except Exception:  # a tokenizer without the method: count nothing rather than fail a turn
        return 0
    ids = out.sampled_ids
    return ids.index(end) + 1 if isinstance(end, int) and end in ids else 0


def text_logprobs(out: TurnOutput, tokenizer: Any, top_k: int) -> tuple[dict[str, Any], ...]:
    """The logprobs of `output_text`'s tokens (`Logprob`: token, bytes, logprob,
    top_logprobs): the sampled tokens after the reasoning block whose text spells the
    message's content (whitespace-only tokens before it skipped; from where it ends on,
    a tool call or the end-of-turn token, left out). The end is found by bisection on
    the decoded length (O(log n) decodes; a character split across tokens decodes
    whole). Empty when no such run of tokens decodes to exactly the content: no guess."""
    content = str(out.message.get("content") or "").strip()
    if not content:
        return ()
    start = _reasoning_tokens(out, tokenizer)
    tops = out.top_logprobs[start:] if out.top_logprobs is not None else None
    entries = logprobs_content(out.sampled_ids[start:], out.logprobs[start:], tops, tokenizer, top_k)
    lead = next((i for i, e in enumerate(entries) if e["token"].strip()), len(entries))
    ids = out.sampled_ids[start + lead:]
    lo, hi = 1, len(ids)
    while lo < hi:  # the fewest tokens whose text is as long as the content
        mid = (lo + hi) // 2
        if len(decode_text(tokenizer, ids[:mid]).strip()) >= len(content):
            hi = mid
        else:
            lo = mid + 1
    for n in range(lo, min(lo + 4, len(ids) + 1)):  # a split last character needs its last bytes
        if decode_text(tokenizer, ids[:n]).strip() == content:
            return tuple(entries[lead:lead + n])
    return ()


def outcome(out: TurnOutput, tokenizer: Any, echo: Echo | None = None) -> Outcome:
    """A committed turn's response parts; with `echo`, the output_text logprobs it asked for."""
    lps = text_logprobs(out, tokenizer, echo.top_logprobs or 0) if echo is not None and echo.logprobs else ()
    return Outcome(out.request_id, out.message, out.finish_reason, out.prompt_tokens, out.completion_tokens,
                   out.cached_tokens, _reasoning_tokens(out, tokenizer), lps)


def response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def reasoning_item(rid: str, text: str, *, encrypted: bool, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": encode_reasoning(text) if encrypted else None, "status": status}


def message_item(rid: str, text: str, status: str = "completed",
                 logprobs: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}]}


def call_item(rid: str, index: int, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{rid}_{index}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(o: Outcome, echo: Echo) -> list[dict[str, Any]]:
    """The committed assistant message as output items: reasoning, message, calls (the
    order a live stream opens them). A turn without calls always has a message."""
    msg, rid = o.message, o.request_id
    status = "incomplete" if o.finish_reason in ("length", "abort") else "completed"  # abort: cut short
    items = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(rid, str(msg["reasoning_content"]), encrypted=echo.encrypted_reasoning))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        items.append(message_item(rid, str(msg.get("content") or ""), status, o.text_logprobs))
    for i, tc in enumerate(calls):
        fn = tc.get("function") or {}
        args = fn.get("arguments", "")
        items.append(call_item(rid, i, str(tc.get("id", "")), str(fn.get("name", "")),
                               args if isinstance(args, str) else orjson.dumps(args).decode()))
    return items


def usage(o: Outcome) -> dict[str, Any]:
    return {"input_tokens": o.input_tokens, "output_tokens": o.output_tokens,
            "total_tokens": o.input_tokens + o.output_tokens,
            "input_tokens_details": {"cached_tokens": o.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": o.reasoning_tokens}}


def response_object(rid: str, echo: Echo, *, status: str, output: list[dict[str, Any]],
                    o: Outcome | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `Response` (`openai/types/responses/response.py`) in any state."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id(rid), "object": "response", "created_at": echo.created_at, "status": status,
        "error": error, "incomplete_details": incomplete, "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens, "model": echo.model, "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls, "previous_response_id": echo.previous_response_id,
        "reasoning": echo.reasoning, "store": echo.store, "temperature": echo.temperature,
        "text": echo.text or {"format": {"type": "text"}}, "tool_choice": echo.tool_choice, "tools": echo.tools,
        "top_p": echo.top_p, "top_logprobs": echo.top_logprobs, "truncation": "disabled", "usage": usage(o) if o is not None else None,
        "metadata": echo.metadata,
    }


def final_object(o: Outcome, echo: Echo) -> dict[str, Any]:
    status = "incomplete" if o.finish_reason in ("length", "abort") else "completed"  # abort: cut short
    return response_object(o.request_id, echo, status=status, output=output_items(o, echo), o=o)


def echo_of(req: ChatRequest) -> Echo:
    return req.echo if isinstance(req, ResponsesTurn) else Echo(created_at=int(time.time()), model=req.model or _MODEL)


# -- stream events -> Responses SSE ------------------------------------------------------


class ResponsesStreamEncoder:
    """One turn as Responses SSE events (`event: NAME` + `data: {..., sequence_number}`):
    `response.created`, `response.in_progress`; per output item `output_item.added`, its
    content part, the text / reasoning / argument deltas, their `.done`s and
    `output_item.done` (an item closes when the next opens, the last at commit);
    `response.completed` (or `response.incomplete`) with the same object the JSON body
    has. A failure is an `error` event, then `response.failed` when the response began."""

    def __init__(self, echo: Echo, tokenizer: Any) -> None:
        self._echo, self._tokenizer = echo, tokenizer
        self._seq = 0
        self._rid: str | None = None
        self._items: list[dict[str, Any]] = []  # streamed items, in output order (text accumulated)
        self._open: int | None = None  # output index of the item whose deltas flow
        self._calls: dict[int, int] = {}  # tool-call index -> output index
        self._started: dict[str, Any] | None = None  # the in-progress response object, once started

    def _event(self, kind: str, /, **data: Any) -> bytes:
        payload = orjson.dumps({"type": kind, "sequence_number": self._seq, **data})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._items.append(item)
        self._open = idx = len(self._items) - 1
        frames.append(self._event("response.output_item.added", output_index=idx, item=_in_progress(item)))
        part = _part(item)
        if part is not None:
            frames.append(self._event("response.content_part.added", item_id=item["id"], output_index=idx,
                                      content_index=0, part=part))
        return frames

    def _close(self, final: dict[str, Any] | None = None) -> list[bytes]:
        """The open item's `.done` events (`final`: the committed item, at the end)."""
        if self._open is None:
            return []
        idx, self._open = self._open, None
        item = final or self._finished(self._items[idx])
        self._items[idx] = item
        ids = {"item_id": item["id"], "output_index": idx}
        frames = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            frames.append(self._event("response.reasoning_text.done", **ids, content_index=0, text=text))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            frames.append(self._event("response.output_text.done", **ids, content_index=0, text=text,
                                      logprobs=item["content"][0]["logprobs"]))
        else:
            frames.append(self._event("response.function_call_arguments.done", **ids, name=item["name"],
                                      arguments=item["arguments"]))
        part = _part(item, done=True)
        if part is not None:
            frames.append(self._event("response.content_part.done", **ids, content_index=0, part=part))
        frames.append(self._event("response.output_item.done", output_index=idx, item=item))
        return frames

    def _finished(self, item: dict[str, Any]) -> dict[str, Any]:
        """A streamed item closed before the commit (the next item began): as committed."""
        if item["type"] == "reasoning":
            return reasoning_item(self._rid or "", item["content"][0]["text"], encrypted=self._echo.encrypted_reasoning)
        return {**item, "status": "completed"}

    def _current(self, kind: str) -> dict[str, Any] | None:
        return self._items[self._open] if self._open is not None and self._items[self._open]["type"] == kind else None

    def keepalive(self) -> bytes:
        """`response.in_progress` again: an event the Responses clients know and pass
        over (the openai SDK types it, Codex ignores it), and an event is what Codex's
        `stream_idle_timeout_ms` waits for (an SSE comment never reaches it)."""
        if self._started is None:
            return b": keep-alive\n\n"
        return self._event("response.in_progress", response=self._started)

    def opening(self, request_id: str) -> list[bytes]:
        """`response.created` and `response.in_progress` now, for the turn to come
        (`request_id` is its id): the keep-alives after them are events Codex counts, and
        no client sees an event before `response.created` (the openai SDK's stream
        helper raises on one: `Expected to have received response.created`). The turn's
        `TurnStarted` then adds nothing."""
        return self.encode(TurnStarted(request_id, 0))

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TurnStarted):
            if self._rid == event.request_id:  # opened already (`opening`)
                return []
            self._rid = event.request_id
            obj = response_object(event.request_id, self._echo, status="in_progress", output=[])
            self._started = obj
            return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]
        rid = self._rid or ""
        if isinstance(event, ReasoningDelta):
            frames = [] if self._current("reasoning") else self._open_item(
                reasoning_item(rid, "", encrypted=False, status="in_progress"))
            item = self._items[self._open or 0]
            item["content"][0]["text"] += event.text
            frames.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                      output_index=self._open, content_index=0, delta=event.text))
            return frames
        if isinstance(event, ContentDelta):
            frames = [] if self._current("message") else self._open_item(message_item(rid, "", "in_progress"))
            item = self._items[self._open or 0]
            item["content"][0]["text"] += event.text
            frames.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                                      content_index=0, delta=event.text, logprobs=[]))
            return frames
        if isinstance(event, ToolCallStarted):
            frames = self._open_item(call_item(rid, event.index, event.id, event.name, "", "in_progress"))
            self._calls[event.index] = len(self._items) - 1
            return frames
        if isinstance(event, ToolArgumentsDelta):
            idx = self._calls[event.index]
            self._items[idx]["arguments"] += event.text
            return [self._event("response.function_call_arguments.delta", item_id=self._items[idx]["id"],
                                output_index=idx, delta=event.text)]
        if isinstance(event, TurnCommitted):
            return self._finish(outcome(event.out, self._tokenizer, self._echo))
        if isinstance(event, TurnFailed):
            return self._fail(event)
        return []  # TokensDelta: ids and logprobs stay in the trajectory

    def _finish(self, o: Outcome) -> list[bytes]:
        """Close what is open with its committed form, send (added + done) any item the
        deltas did not open (an empty answer), then the terminal event."""
        final = final_object(o, self._echo)
        items = final["output"]
        frames = self._close(items[self._open]) if self._open is not None and self._open < len(items) else self._close()
        for item in items[len(self._items):]:
            frames += self._open_item(item)
            frames += self._close(item)
        final["output"] = items
        name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return frames + [self._event(name, response=final)]

    def _fail(self, event: TurnFailed) -> list[bytes]:
        frames = [self._event("error", code=event.type, message=event.message, param=None)]
        if self._rid is not None:
            obj = response_object(self._rid, self._echo, status="failed", output=self._items,
                                  error={"code": "server_error", "message": event.message})
            frames.append(self._event("response.failed", response=obj))
        return frames


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    """An item as `output_item.added` shows it: no content yet."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "reasoning":
        return {**item, "status": "in_progress", "content": [], "encrypted_content": None}
    return {**item, "status": "in_progress", "arguments": ""}


def _part(item: dict[str, Any], *, done: bool = False) -> dict[str, Any] | None:
    if item["type"] == "message":
        return {"type": "output_text", "text": item["content"][0]["text"] if done else "", "annotations": [],
                "logprobs": []}
    if item["type"] == "reasoning":
        return {"type": "reasoning_text", "text": item["content"][0]["text"] if done else ""}
    return None


# -- the dialect -------------------------------------------------------------------------


class OpenAIResponses:
    """`POST .../v1/responses`: OpenAI's Responses request in, a `response` object out."""

    name = "openai_responses"
    request_model = ResponsesRequest

    def parse(self, body: bytes, *, session: Any = None, switches: frozenset[str] = frozenset()) -> ChatRequest:
        """Without a session a `previous_response_id` is a 404 (it names nothing)."""
        return parse_responses(body, session=session, switches=switches)

    def parser(self, session: Any, tokenizer: Any) -> Callable[[bytes], ChatRequest]:
        """`parse` bound to a session (its stored responses) and the template's switches."""
        switches = template_switches(tokenizer)
        return lambda body: parse_responses(body, session=session, switches=switches)

    def body(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> bytes:
        echo = echo_of(req)
        return orjson.dumps(final_object(outcome(out, tokenizer, echo), echo))

    def encoder(self, req: ChatRequest, tokenizer: Any) -> ResponsesStreamEncoder:
        return ResponsesStreamEncoder(echo_of(req), tokenizer)

    def stream(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> list[bytes]:
        enc = self.encoder(req, tokenizer)
        return [f for ev in replay(out) for f in enc.encode(ev)]

    def remember(self, session: Any, req: ChatRequest, out: TurnOutput, tokenizer: Any) -> None:
        """Keep a committed response (unless `store: false`) for `previous_response_id`
        and GET: its tree position and object parts, not its tokens."""
        echo = echo_of(req)
        if echo.store:
            session.responses[response_id(out.request_id)] = StoredResponse(
                echo, outcome(out, tokenizer), out.branch_id, out.turn_index)

    def stored_body(self, session: Any, rid: str) -> bytes:
        stored: StoredResponse | None = session.responses.get(rid)
        if stored is None:
            raise NotFound(f"response {shown(rid)} is not stored in this session")
        return orjson.dumps(final_object(stored.outcome, stored.echo))


OPENAI_RESPONSES = OpenAIResponses()

__all__ = ["OPENAI_RESPONSES", "OpenAIResponses", "ResponsesRequest", "ResponsesStreamEncoder"]
