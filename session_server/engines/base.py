"""The engine seam: what every adapter must do, and what some declare they can.

Session code talks to engines only through `EngineAdapter`; every SGLang/vLLM field
name, mode name and rule lives inside its adapter module (sglang.py, vllm.py, and
the parsers of their replies, sglang_replies.py, vllm_replies.py). Optional
capabilities are declared by the adapter class (`EngineCapabilities`) and reached
through the accessors below, never discovered with `getattr`: a caller can then tell
"this engine cannot" from "this adapter forgot". Adapters translate third-party and
wire errors into the tree in `session_server.errors` at this boundary.

`GenerateResult` is deliberately *raw*: ids and logprobs are kept exactly as the
engine sent them (possibly bools, strings, NaN) so that `trajectory.validate`
sees the real values and can reject them field by field. Adapters only
normalise the *shape* (where the ids are, what the finish reason is).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from ..routed import Decoded, Unrequested
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


DERIVED_SEED_BOUND = 2**31
"""Derived seeds are below this: every engine path takes a non-negative int32 (SGLang
hashes `sampling_seed` in int64 tensors, vLLM seeds a torch generator; numpy-style
seeders refuse 2**32 and more)."""


def request_headers(request: GenerateRequest) -> dict[str, str] | None:
    """The HTTP headers of a generate request: its trace headers and its session
    (`SESSION_HEADER`, its `session_tag`); None when it has neither."""
    if request.session_id is None:
        return dict(request.trace_headers) if request.trace_headers else None
    return {**(request.trace_headers or {}), SESSION_HEADER: session_tag(request.session_id)}


def derive_seed(session_seed: int, branch: int, turn: int, segment: int) -> int:
    """The seed of one engine request of a seeded session: a pure function of (session
    seed, branch, turn index, segment index), so a retried turn and a segment
    resubmitted after a pause get the seed they had the first time, while turns,
    branches and segments never share a random stream (a resubmit reusing segment 0's
    seed would replay its draws from position 0 on the continuation)."""
    digest = hashlib.blake2b(f"{session_seed}:{branch}:{turn}:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % DERIVED_SEED_BOUND


SESSION_HEADER = "x-tito-session"
"""The HTTP header naming the session a generate request serves, by its `session_tag`.
The engines ignore unknown headers (SGLang and vLLM read only the trace and data-parallel
ones); it lets an engine-side log or proxy group a session's requests, and the simulator
play a script set for that session alone (`POST /sim/script {"session"}`)."""


def session_tag(session_id: str) -> str:
    """What `SESSION_HEADER` carries for a session: a digest that groups its requests
    and cannot be turned back into the id. The id itself is a capability (with auth off,
    whoever knows it drives the session), and engines, proxies and their logs are not
    trusted with it; the simulator digests a posted session id the same way to match."""
    return hashlib.sha256(b"tito-session:" + session_id.encode()).hexdigest()[:32]


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
    # W3C `traceparent` / `tracestate` of this request's span, sent as HTTP headers (session_server/tracing.py)
    trace_headers: Mapping[str, str] | None = None
    # server-side: (session seed, branch, turn) of a seeded session; segment k of the turn
    # is sent `derive_seed(*seed_key, k)` in place of `sampling.seed` (control/resilient.py)
    seed_key: tuple[int, int, int] | None = None
    session_id: str | None = None  # sent as `SESSION_HEADER`


def segment_sampling(request: GenerateRequest, segment: int) -> SamplingParams:
    """The sampling of segment `segment` of `request`: its own, with the derived seed in a
    seeded session (`GenerateRequest.seed_key`)."""
    if request.seed_key is None:
        return request.sampling
    return replace(request.sampling, seed=derive_seed(*request.seed_key, segment))


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
    routed_experts: bytes | Decoded | Unrequested | None = None
    abort_message: str | None = None


def parsed_without_routed(parse: Callable[..., GenerateResult], body: bytes, /, **kwargs: Any) -> GenerateResult:
    """`parse(body, **kwargs)` less a routed-experts payload the request did not ask for
    (a vLLM started with routed experts on sends them for every request): dropped where
    the reply is parsed, a worker process for a large one, so it never crosses back;
    its size stays (`Unrequested`)."""
    from ..routed import Unrequested

    result = parse(body, **kwargs)
    raw = result.routed_experts
    if isinstance(raw, bytes):
        return replace(result, routed_experts=Unrequested(len(raw)))
    return result


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


@dataclass(frozen=True)
class EngineCapabilities:
    """What an adapter can do beyond the required `EngineAdapter` members, declared once
    by its class. Each flag promises the methods of the small protocol named beside it;
    callers reach them through the accessor of the same name (`streaming(adapter)` ...),
    which answers None where the engine cannot."""

    streams: bool = False  # `Streaming.generate_stream`: the engine's own token stream
    # its stream frames are deltas (each token sent once): a viewer may watch a turn the
    # client does not stream at O(L). SGLang's default frames are cumulative (every frame
    # repeats the tokens so far: O(L^2) for an L-token answer) unless the server runs with
    # --incremental-streaming-output and the settings say so (`sglang_incremental_streams`);
    # vLLM's are deltas.
    incremental_stream: bool = False
    reports_load: bool = False  # `LoadReporting.load_by_rank`: the engine's own queue per DP rank
    reports_dp_size: bool = False  # `DPSizeReporting.dp_size`: how many DP ranks it serves
    names_model: bool = False  # `ModelNaming.served_model_path`: the model it was started with
    pushes_weight_version: bool = False  # `VersionPushing.update_weight_version`
    # how a token's sampling support reads out of its top logprobs (`trajectory.support`):
    # "processed" (masked tokens at the floor) or "post_temperature" (untruncated); None: it cannot
    support_logprobs: Literal["processed", "post_temperature"] | None = None


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine endpoint (one base URL, possibly several DP ranks): the typed control
    protocol the rest of the server uses, reached through `engines.registry`. Every
    member here is required; optional ones are declared in `capabilities`."""

    protocol: str  # "sglang" | "vllm"
    base_url: str
    capabilities: EngineCapabilities

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one generation; raise `session_server.errors.EngineError` subclasses on failure."""
        ...

    async def abort_request(self, rid: str) -> None:
        """Abort one request by id (its turn stopped waiting for it)."""
        ...

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """Abort these requests (one LoRA adapter's, on a per-LoRA `abort` pause) in the
        engine's bulk form; an empty list aborts nothing (never "everything")."""
        ...

    def pause_mode(self, mode: str) -> str:
        """The engine's own pause mode for the plane's `abort` / `keep` / `wait` (for
        `wait` the plane has already drained its own requests)."""
        ...

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation in the engine's own mode name (`pause_mode`)."""
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

    async def prove_protocol(self) -> None:
        """Admission: raise `admission_check.EngineRefused` unless the URL answers as this
        protocol (engine errors propagate); sends no generation."""
        ...


class Streaming(EngineAdapter, Protocol):
    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        """The engine's own stream: `TokenDelta`s as it samples, then the final result
        (the same `GenerateResult` a non-streamed `generate` of the request returns)."""
        ...


class LoadReporting(EngineAdapter, Protocol):
    async def load_by_rank(self) -> dict[int, int]:
        """Running + waiting requests per DP rank, as the engine reports them (engines/load.py)."""
        ...


class DPSizeReporting(EngineAdapter, Protocol):
    async def dp_size(self) -> int:
        """How many DP ranks the engine serves (each is a routing target)."""
        ...


class ModelNaming(EngineAdapter, Protocol):
    async def served_model_path(self) -> str | None:
        """The served model's path or hub name; None when the engine does not say."""
        ...


class VersionPushing(EngineAdapter, Protocol):
    async def update_weight_version(self, version: str) -> dict[str, Any]:
        """Set the weight version the engine reports for what it samples from now on."""
        ...


def streaming(adapter: EngineAdapter) -> Streaming | None:
    return cast(Streaming, adapter) if adapter.capabilities.streams else None


def load_reporting(adapter: EngineAdapter) -> LoadReporting | None:
    return cast(LoadReporting, adapter) if adapter.capabilities.reports_load else None


def dp_size_reporting(adapter: EngineAdapter) -> DPSizeReporting | None:
    return cast(DPSizeReporting, adapter) if adapter.capabilities.reports_dp_size else None


def model_naming(adapter: EngineAdapter) -> ModelNaming | None:
    return cast(ModelNaming, adapter) if adapter.capabilities.names_model else None


def version_pushing(adapter: EngineAdapter) -> VersionPushing | None:
    return cast(VersionPushing, adapter) if adapter.capabilities.pushes_weight_version else None
