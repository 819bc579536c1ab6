"""The engine seam: one required coroutine per adapter.

Session code talks to engines only through `EngineAdapter.generate`; every
SGLang/vLLM field name lives inside its adapter module (sglang.py, vllm.py).
Adapters translate third-party and wire errors into the tree in
`session_server.errors` at this boundary.

`GenerateResult` is deliberately *raw*: ids and logprobs are kept exactly as the
engine sent them (possibly bools, strings, NaN) so that `trajectory.validate`
sees the real values and can reject them field by field. Adapters only
normalise the *shape* (where the ids are, what the finish reason is).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from ..routed import Decoded
    from ..structured import Constraint

TokenIds = Sequence[int] | NDArray[np.int32]  # a context: a list in tests, numpy in the server
FinishReason = Literal["stop", "length", "abort", "repetition"]  # repetition: vLLM detector


@dataclass(frozen=True)
class SamplingParams:
    """Engine-neutral sampling parameters (None = engine default, but max tokens is always set)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # constrained decoding (tool_choice / response_format); adapters map it to their field
    constraint: Constraint | None = None


_OPTIONAL_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)


def optional_sampling_fields(s: SamplingParams, *, seed_key: str) -> dict[str, Any]:
    """The sampling fields both engines name alike, only those set, plus the seed
    under the engine's own name and the stop lists when non-empty."""
    out: dict[str, Any] = {k: getattr(s, k) for k in _OPTIONAL_SAMPLING if getattr(s, k) is not None}
    if s.seed is not None:
        out[seed_key] = s.seed
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    return out


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str  # fixed width, prefix-free (SGLang aborts by rid prefix)
    # a numpy array in the server: bodies are written by orjson straight from it, so
    # a 100K-token context never becomes 100K Python objects on the event loop
    input_ids: TokenIds
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    top_logprobs: int = 0
    dp_rank: int | None = None
    lora: str | None = None
    cache_salt: str | None = None
    return_routed_experts: bool = False
    # line positions before this already have rows (SGLang `routed_experts_start_len`)
    routed_experts_start: int = 0
    timeout_s: float = 600.0  # deadline measured from dispatch
    slot_held: bool = False  # the caller already holds this engine's concurrency slot (`adapter.slot()`)
    max_weight_lag: int | None = None  # server-side: weight versions a turn may span (control/lag.py)


@dataclass(frozen=True)
class GenerateResult:
    """One engine answer, shape-normalised but value-raw (see module doc)."""

    request_id: Any
    output_ids: Sequence[Any]
    logprobs: Sequence[Any]
    finish_reason: FinishReason
    matched_stop: int | str | None
    prompt_tokens: Any
    completion_tokens: Any
    cached_tokens: Any
    weight_version: Any = None  # one version for the whole output (SGLang: read at its end)
    # per-token versions, raw: (start, end, version) over this result's output ids, when the
    # engine reports them (vLLM 0.32 `choices[].weight_versions`); checked by control/versions.py
    version_spans: Sequence[Any] | None = None
    # SGLang sends ids twice (output_ids and inside the logprob triples); the
    # second copy lets validation cross-check them. None when the engine has one copy.
    output_ids_echo: Sequence[Any] | None = None
    top_logprobs: Sequence[Any] | None = None  # per token: list of (id, logprob); raw
    # raw payload, never decoded by the adapter; the server's reply decoder may turn a
    # base64 one into `Decoded` ids in its worker process (session_server/routed.py)
    routed_experts: bytes | Decoded | None = None
    abort_message: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    """Tokens a streamed generation sampled since its last delta, values raw
    as the engine sent them; the stream's final `GenerateResult` is what is validated."""

    ids: Sequence[Any]
    logprobs: Sequence[Any]
    top_logprobs: Sequence[Any] | None = None


StreamItem = TokenDelta | GenerateResult
"""What an adapter's `generate_stream` yields: deltas, then one final result (the same
`GenerateResult` a non-streamed `generate` of the request would return)."""


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine endpoint (one base URL, possibly several DP ranks): the typed control
    protocol the rest of the server uses, reached through `engines.registry`.

    Optional capabilities, looked up with `getattr` where used: `generate_stream(request)`
    (an async iterator of `StreamItem`: the engine's own stream, issue 12.2), `get_load()` (the load
    the engine reports about itself, SGLang), `dp_size()` (SGLang), and the
    protocol-specific bulk `abort(...)` a per-LoRA pause uses (see control/fanout.py)."""

    protocol: str  # "sglang" | "vllm"
    base_url: str

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one generation; raise `session_server.errors.EngineError` subclasses on failure."""
        ...

    async def abort_request(self, rid: str) -> None:
        """Abort one request by id (its turn stopped waiting for it)."""
        ...

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation in the engine's own mode name (see control/fanout.py)."""
        ...

    async def resume(self) -> None:
        """Resume generation after `pause`."""
        ...

    def slot(self) -> AbstractAsyncContextManager[None]:
        """One of the engine's concurrent-generation slots (held around `generate`)."""
        ...

    async def aclose(self, drain_s: float = 0.0) -> None:
        """Release connections."""
        ...

    async def health(self) -> bool:
        """Active health check: does the engine answer healthy right now."""
        ...
