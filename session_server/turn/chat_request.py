"""The chat request every dialect translates its client's body into (OpenAI chat's
shape): messages, tools, sampling. It is the turn's input, so it lives with the turn;
the dialects (`api/dialects/`) build it and the turn phases read it. Validated on the
CPU offload threads; unknown OpenAI fields are accepted and ignored (agents send many),
fields we act on are typed strictly so bad input is a clear 400, never a 500.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    field_validator,
)

from trajectory.lineage import Lineage

from ..structured import ResponseFormat, ToolChoice

_ROLES = {"system", "developer", "user", "assistant", "tool"}

# What a message looks like in /openapi.json (messages are validated further by the
# turn pipeline; unknown keys pass): enough shape for generated clients and fuzzers.
_MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": sorted(_ROLES)},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}},
                {"type": "null"},
            ]
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "reasoning_content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "tool_calls": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "type": {"enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name", "arguments"],
                        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
                    },
                },
            },
        },
    },
}

# -- bounds (docs/api.md "Request limits"); each is defined once and shared by the chat
# request and the session's `sampling` defaults, so both reject the same values --
MAX_TOKENS_LIMIT = 1 << 20  # more than any served context; beyond it an engine fails, blamed on it
TIMEOUT_S_MIN = 0.1  # below this a turn cannot even reach the engine: a 504 would blame it
TIMEOUT_S_MAX = 86_400.0
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
INT64_MAX = 2**63 - 1

TEMPLATE_KWARGS_RESERVED = frozenset(
    {
        # arguments of `apply_chat_template` the server sets itself (a second value is a TypeError)
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
        "sanitize_control_tokens", "conversations",
        # template variables transformers fills from the tokenizer: overriding them would
        # render tokens other than the ones the codec verified at start-up
        "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
        "additional_special_tokens", "raise_exception", "strftime_now",
    }
)


# the reasoning switches chat templates read, and the type each must have: a template
# tests them with Jinja truthiness, so `"no"` or `"false"` would silently turn thinking ON
# (Qwen3/GLM `enable_thinking`, DeepSeek-V3.1 `thinking`: booleans; gpt-oss
# `reasoning_effort`: "low" | "medium" | "high", rendered as text)
TEMPLATE_SWITCH_TYPES: dict[str, tuple[type, str]] = {
    "enable_thinking": (bool, "a boolean (true or false)"),
    "thinking": (bool, "a boolean (true or false)"),
    "reasoning_effort": (str, "a string"),
}


def _template_kwargs(v: dict[str, Any]) -> dict[str, Any]:
    owned = sorted(TEMPLATE_KWARGS_RESERVED.intersection(v))
    if owned:
        raise ValueError(f"keys {owned} are set by the server, not by chat_template_kwargs")
    for key, (kind, what) in TEMPLATE_SWITCH_TYPES.items():
        if key in v and v[key] is not None and not isinstance(v[key], kind):
            raise ValueError(f"chat_template_kwargs.{key} must be {what}, got {v[key]!r}")
    return v


def _stop_list(v: str | list[str]) -> list[str]:
    """One stop string is a list of one, never its characters."""
    return [v] if isinstance(v, str) else v


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_template_kwargs)]
Tokens = Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS_LIMIT)]
# weight versions one turn's sampled tokens may span (control/lag.py); None: unbounded
WeightLag = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
# `strict`: a JSON number only (an integer is a number); `true`, `"0.5"` are a 400, never
# read as 1.0 / 0.5 (pydantic's lax mode would): OpenAI and Anthropic type these `float`
Penalty = Annotated[float, Field(strict=True, ge=-2.0, le=2.0, allow_inf_nan=False)]
TimeoutS = Annotated[float, Field(strict=True, ge=TIMEOUT_S_MIN, le=TIMEOUT_S_MAX, allow_inf_nan=False)]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Annotated[StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOPS)], AfterValidator(_stop_list)]

# a LoRA adapter's name: pause/resume address adapters by it, and "" names none of them
LoraName = Annotated[str, Field(min_length=1, max_length=256)]


class FunctionDefinition(BaseModel):
    """`function` of a chat tool (openai SDK `shared_params/function_definition.py`:
    `name: Required[str]`, `description: str`, `parameters: Dict[str, object]`,
    `strict: Optional[bool]`); other keys pass, as OpenAI's extra fields do."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(BaseModel):
    """`ChatCompletionFunctionToolParam`; a missing `type` is a function, as vLLM reads it."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class CustomToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)


class CustomTool(BaseModel):
    """`ChatCompletionCustomToolParam` (`{type: custom, custom: {name, ...}}`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["custom"]
    custom: CustomToolDefinition


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool checked against OpenAI's types; the dicts are kept as sent (the template
    renders them as JSON text: a re-serialised model could reorder keys and change the prompt)."""
    for i, tool in enumerate(tools):
        model: type[BaseModel] = CustomTool if tool.get("type") == "custom" else FunctionTool
        try:
            model.model_validate(tool)
        except ValidationError as exc:
            e = exc.errors()[0]
            where = ".".join(str(p) for p in (f"tools[{i}]", *e["loc"]))
            raise ValueError(f"{where}: {e['msg']}") from None
    return tools


class SamplingFields(BaseModel):
    """Sampling fields a session may default and a chat request may override.

    Bounds are the engines' own where they document one (OpenAI/vLLM: penalties in
    [-2, 2]; top_k -1 = off) so that bad values are a 400 here, not a 502 there."""

    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: float | None = Field(default=None, strict=True, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, strict=True, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, strict=True, ge=-1, le=MAX_TOKENS_LIMIT)
    min_p: float | None = Field(default=None, strict=True, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, strict=True, gt=0.0, le=2.0, allow_inf_nan=False)
    stop: Stop | None = None
    # non-negative: -1 is "a random seed" to llama.cpp-style clients, but an engine reads it as
    # a fixed seed (torch maps -1 to 2**64 - 1): a client wanting randomness omits `seed`
    seed: int | None = Field(default=None, strict=True, ge=0, le=INT64_MAX)

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


PINNED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed")
"""What `pinned` takes from the session alone: the fields that shape the distribution a
token is drawn from (and the seed that draws it). A field the session leaves unset is
the engine's default, never the client's. The budget is capped, not pinned, and stop
strings stay the client's: both only say where a sample ends, not how it is drawn."""

CLIENT_SAMPLING_FIELDS = (*PINNED_FIELDS, "max_tokens", "max_completion_tokens")
"""The sampling fields a turn records as its client sent them (the turn's `sampling.client`)."""


class SessionSampling(SamplingFields):
    """`POST /sessions` `sampling`: per-session defaults, validated at creation."""

    model_config = ConfigDict(extra="forbid")


class ChatRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": _MESSAGE_SCHEMA})
    model: str | None = None
    tools: Annotated[list[dict[str, Any]], AfterValidator(_chat_tools)] | None = None
    tool_choice: ToolChoice | None = None
    # false: a forced call (`tool_choice` required or named) is exactly one call in the grammar
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=20)
    stream: StrictBool = False
    n: int = Field(default=1, strict=True)
    chat_template_kwargs: TemplateKwargs | None = None
    timeout_s: TimeoutS | None = None
    max_weight_lag: WeightLag | None = None  # overrides the session's
    # which agent and thread asked (api/lineage.py: from the headers, then the body fields
    # below), committed with the turn; never read from a body key of its own name
    _lineage: Lineage | None = PrivateAttr(default=None)
    # body fields a dialect read that name the client's thread (`metadata.user_id`,
    # `prompt_cache_key`), by field name: api/lineage.py decides what they mean
    _lineage_hints: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("n must be 1 (one trajectory per session turn)")
        return v

    @field_validator("messages")
    @classmethod
    def _roles(cls, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(msgs):
            role = m.get("role")
            if not isinstance(role, str) or role not in _ROLES:  # a list or dict is not hashable
                raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
            if role == "tool" and not isinstance(m.get("content"), str | list):
                raise ValueError(f"messages[{i}]: tool message needs content")
            for key in ("tool_call_id", "name"):  # strings in every OpenAI message type
                if m.get(key) is not None and not isinstance(m[key], str):
                    raise ValueError(f"messages[{i}].{key} must be a string, got {m[key]!r}")
            _check_content(f"messages[{i}].content", m.get("content"))
            if m.get("tool_calls") is not None:
                _check_tool_calls(f"messages[{i}].tool_calls", m["tool_calls"])
        return msgs



def _check_content(where: str, content: Any) -> None:
    """Text only: a string, null, or a list of `text` parts (joined when
    rendered). Any other part (image_url, input_audio, ...) is refused by its type:
    this server serves text models, and a part dropped silently would leave the
    model answering a prompt the client did not send."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string, null or a list of text parts")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = kind if isinstance(kind, str) else type(part).__name__
            raise ValueError(f"{where}[{j}]: content part type {shown!r} is not supported (text models: only 'text' parts)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")


def _check_tool_calls(where: str, calls: Any) -> None:
    """Assistant tool calls as OpenAI sends them: `function.name` a string, `arguments` a
    JSON object (as a JSON string, or already an object). Templates receive the parsed
    object (GLM iterates it as a mapping), so anything else is a 400 here."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list")
    for j, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)  # as the renderer parses it (trajectory.messages)
            except ValueError as exc:
                raise ValueError(f"{where}[{j}].function.arguments is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}[{j}].function.arguments must be a JSON object, not {type(args).__name__}")


