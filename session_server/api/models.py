"""Request models of the HTTP API (pydantic), validated in the CPU pool.

Unknown OpenAI fields are accepted and ignored (agents send many); fields we act
on are typed strictly so bad input is a clear 400, never a 500.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trajectory.codec.base import HistoryPolicy

from ..errors import BadRequest
from ..structured import ResponseFormat, ToolChoice

_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    n: int = 1
    chat_template_kwargs: dict[str, Any] | None = None
    timeout_s: float | None = Field(default=None, gt=0)

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
            if role not in _ROLES:
                raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
            if role == "tool" and not isinstance(m.get("content"), str | list):
                raise ValueError(f"messages[{i}]: tool message needs content")
        return msgs

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any] = Field(default_factory=dict)
    ttl_s: float | None = Field(default=None, gt=0)
    max_context_tokens: int | None = Field(default=None, ge=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
    lora: str | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    history_policy: Literal["append", "template"] = HistoryPolicy.APPEND.value


def parse_json_model(body: bytes, model: type[BaseModel]) -> Any:
    """orjson + pydantic; any failure is a 400 naming the problem (runs in the pool)."""
    try:
        data = orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise BadRequest(f"invalid request: {errs}") from exc


class EngineAdd(BaseModel):
    """`POST /engines`: add an engine at runtime (protocol forced with `sglang=`/`vllm=`)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1)
    dp_size: int | None = Field(default=None, ge=1)


class PauseRequest(BaseModel):
    """`POST /control/pause`: how engines pause, and optionally only one LoRA adapter."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "keep", "wait"] = "abort"
    lora: str | None = None


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora: str | None = None


class WeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(strict=True)
