"""Request models of the HTTP API's own resources (sessions, samples, engines, control),
pydantic, validated on the CPU offload threads. The chat request every dialect builds
is the turn's input and lives in `turn/chat_request.py`.

Unknown OpenAI fields are accepted and ignored (agents send many); fields we act
on are typed strictly so bad input is a clear 400, never a 500.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from trajectory.codec.base import HistoryPolicy
from trajectory.lineage import AgentFilter
from trajectory.samples import DEFAULT_PICKER, PICKERS, Sample

from ..engines.admission_check import check_engine_spec
from ..errors import BadRequest
from ..turn.chat_request import INT64_MAX, LoraName, SessionSampling, TemplateKwargs, WeightLag

TTL_S_MAX = 30 * 86_400.0
MAX_CONTEXT_TOKENS_LIMIT = 1 << 24
MAX_DP_SIZE = 1024  # data-parallel ranks behind one engine URL

SAMPLE_METADATA_RESERVED = frozenset({"session_id", "sampling", *(f.name for f in dataclasses.fields(Sample))})
MAX_BATCH_SESSIONS = 10_000


def _sample_metadata(v: dict[str, Any]) -> dict[str, Any]:
    """Session metadata is copied into every training sample, beside fields the server
    owns: a client key named like one would shadow or forge it."""
    owned = sorted(SAMPLE_METADATA_RESERVED.intersection(v))
    if owned:
        raise ValueError(f"keys {owned} are set by the server in every sample, not by the client")
    return v


SampleMetadata = Annotated[dict[str, Any], AfterValidator(_sample_metadata)]
SampleFormat = Literal["json", "npz", "safetensors"]
AgentKind = Literal["main", "subagent", "side"]  # trajectory.lineage.KINDS


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: SampleMetadata = Field(default_factory=dict)
    ttl_s: float | None = Field(default=None, strict=True, gt=0, le=TTL_S_MAX, allow_inf_nan=False)
    max_context_tokens: int | None = Field(default=None, strict=True, ge=1, le=MAX_CONTEXT_TOKENS_LIMIT)
    sampling: SessionSampling = Field(default_factory=SessionSampling)
    lora: LoraName | None = None
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    history_policy: Literal["append", "template"] = HistoryPolicy.APPEND.value
    # record the engine's routed experts (R3) with the tokens; None: the server default
    routing_replay: bool | None = Field(default=None, strict=True)
    max_weight_lag: WeightLag | None = None  # every turn's default
    # whose sampling values reach the engine (docs/api.md "Sampling policy"); None: the server's
    sampling_policy: Literal["pinned", "client"] | None = None
    # each engine request's seed derives from (seed, branch, turn, segment); None: unseeded
    seed: int | None = Field(default=None, strict=True, ge=0, le=INT64_MAX)

    @model_validator(mode="after")
    def _one_seed(self) -> SessionCreate:
        """`seed` derives a seed per request; `sampling.seed` sends one fixed seed with
        every request: a session asking for both has not said which it means."""
        if self.seed is not None and self.sampling.seed is not None:
            raise ValueError("seed and sampling.seed are exclusive: seed derives one per engine request, "
                             "sampling.seed sends the same one with every request")
        return self
    # capture each sampled token's support (true: k = 20, or k itself); turn/support_rules.py
    sampling_support: StrictBool | Annotated[int, Field(strict=True, ge=1)] | None = None


TurnSeq = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
Reward = Annotated[float | None, Field(strict=True, allow_inf_nan=False)]


class TurnReward(BaseModel):
    """One committed turn's (process) reward, the turn named by its seq (trajectory/turn_rewards.py)."""

    model_config = ConfigDict(extra="forbid")

    turn: TurnSeq = Field(description="the turn's seq: the session's n-th committed turn, from 0, over all branches")
    reward: Reward = Field(description="that turn's reward; null unsets it")


class RewardRequest(BaseModel):
    """`POST /sessions/{sid}/reward`: a reward for the session's samples: trajectory-level,
    per leaf, or per turn (`turn`, or several at once in `turn_rewards`)."""

    model_config = ConfigDict(extra="forbid")

    reward: Reward = Field(
        default=None,
        description="alone: every kept leaf's reward; with `leaf`: that leaf's (overrides); with `turn`: that "
                    "turn's; null unsets. Required unless `turn_rewards` is given",
    )
    metadata: SampleMetadata = Field(default_factory=dict, description="merged over the session's metadata")
    leaf: int | None = Field(default=None, strict=True, ge=0, le=INT64_MAX, description="a leaf branch id")
    turn: TurnSeq | None = Field(default=None, description="a committed turn's seq: `reward` is that turn's")
    turn_rewards: list[TurnReward] | None = Field(
        default=None, description="several turns' rewards, set together (all or none)")

    @model_validator(mode="after")
    def _one_address(self) -> RewardRequest:
        if "reward" not in self.model_fields_set and self.turn_rewards is None:
            raise ValueError("reward: required (a number or null) unless turn_rewards is given")
        if self.leaf is not None and "reward" not in self.model_fields_set:
            raise ValueError("leaf: needs the leaf's reward in `reward`")
        if self.turn is not None and self.leaf is not None:
            raise ValueError("turn and leaf: a reward names one turn or one leaf, not both")
        if self.turn is not None and self.turn_rewards is not None:
            raise ValueError("turn and turn_rewards: give one turn's reward in either, not both")
        seen: set[int] = set()
        for i, t in enumerate(self.turn_rewards or ()):
            if t.turn in seen:
                raise ValueError(f"turn_rewards[{i}].turn: turn {t.turn} is given twice")
            seen.add(t.turn)
        return self

    def turn_changes(self) -> list[tuple[str, int, float | None]]:
        """The per-turn rewards this request sets: (the field naming it, seq, reward)."""
        if self.turn is not None:
            return [("turn", self.turn, self.reward)]
        return [(f"turn_rewards[{i}].turn", t.turn, t.reward) for i, t in enumerate(self.turn_rewards or ())]

    def sets_session_reward(self) -> bool:
        """Whether `reward` is the trajectory-level (or, with `leaf`, a leaf's) reward."""
        return self.turn is None and "reward" in self.model_fields_set


def _known_picker(v: str) -> str:
    if v not in PICKERS:
        raise ValueError(f"unknown picker {v!r}; known: {sorted(PICKERS)}")
    return v


Picker = Annotated[str, AfterValidator(_known_picker)]


class SamplesBatch(BaseModel):
    """`POST /samples`: the samples of many sessions in one streamed payload."""

    model_config = ConfigDict(extra="forbid")

    session_ids: list[Annotated[str, Field(max_length=256)]] = Field(min_length=1, max_length=MAX_BATCH_SESSIONS)
    close: bool = Field(default=False, strict=True, description="close each session once its samples are read")
    format: SampleFormat = "json"
    picker: Picker = DEFAULT_PICKER
    max_seq_len: int | None = Field(default=None, strict=True, ge=1)
    # only the lines holding this agent's (or kind's) turns, training only those (docs/api.md)
    agent: str | None = Field(default=None, min_length=1, max_length=256)
    agent_kind: AgentKind | None = None

    def agent_filter(self) -> AgentFilter:
        return AgentFilter(self.agent, self.agent_kind)

    @field_validator("session_ids")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("session_ids must be unique")
        return v


def parse_json_model(body: bytes, model: type[BaseModel]) -> Any:
    """orjson + pydantic; any failure is a 400 naming the problem (runs on the offload threads)."""
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

    url: str = Field(min_length=1, max_length=2048, examples=["http://127.0.0.1:30000", "vllm=http://10.0.0.2:8000"])
    dp_size: int | None = Field(default=None, strict=True, ge=1, le=MAX_DP_SIZE)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        """`[sglang=|vllm=]http(s)://host[:port]`: anything else is a 400 here, not an
        unreachable engine (502) later (`check_engine_spec`, shared with `--engine`)."""
        return check_engine_spec(v)


class PauseRequest(BaseModel):
    """`POST /control/pause`: how engines pause, and optionally only one LoRA adapter."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "keep", "wait"] = "abort"
    lora: LoraName | None = None


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora: LoraName | None = None


class WeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(strict=True)
    force: bool = Field(default=False, strict=True, description="allow going backwards (a reset; logged)")


class ErrorDetail(BaseModel):
    type: str = Field(description="stable machine-readable kind, e.g. invalid_request, session_busy")
    message: str = Field(description="what was wrong, for people")


class ErrorBody(BaseModel):
    """Every error the server answers with: `{"error": {"type", "message"}}`."""

    error: ErrorDetail
