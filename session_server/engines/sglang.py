"""SGLang native `/generate` adapter, its pure response parsers, and SGLang's control plane.

Every SGLang field name lives here. Version drift handled (ENGINES.md, SOURCES.md):
ids and logprobs come from `meta_info.output_token_logprobs` triples
`[logprob, id, text|null]`; `output_ids` (absent before ~0.4.10, prefixed by up to
5 prompt tokens in 0.4.10-0.5.4) is only an echo, sliced to its last
`completion_tokens`; `finish_reason` is an object, a bare string (2024-05) or
null (mid-stream); a JSON list body (batch or n>1) is refused; unknown
`meta_info` keys are ignored; `routed_experts` stays `msgspec.Raw`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec

from session_server.engines.admission_check import EngineRefused
from session_server.engines.base import (
    EngineCapabilities,
    GenerateRequest,
    GenerateResult,
    StreamItem,
    TokenDelta,
    optional_sampling_fields,
)
from session_server.engines.http import (
    ConnectionLimits,
    EngineHTTP,
    Offload,
    encode_json,
    fold_stream,
    http_error,
    raw_or_none,
    run_inline,
)
from session_server.engines.load import sglang_load
from session_server.errors import UpstreamHTTPError, UpstreamInvalid
from trajectory.validate import is_int

__all__ = ["SGLangAdapter", "SGLangStream", "parse_sglang_generate", "parse_sglang_stream"]


class _Meta(msgspec.Struct):
    id: Any = None
    finish_reason: Any = None
    prompt_tokens: Any = None
    completion_tokens: Any = None
    cached_tokens: Any = None
    weight_version: Any = None
    output_token_logprobs: Any = None
    output_top_logprobs: Any = None
    routed_experts: msgspec.Raw = msgspec.Raw()


class _Generate(msgspec.Struct):
    text: Any = None
    output_ids: Any = None
    meta_info: _Meta | None = None
    error: Any = None


_DECODER = msgspec.json.Decoder(_Generate | list[Any])


def _error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _finish(fr: Any, *, engine: str, request_id: str) -> tuple[str, int | str | None, str | None]:
    """(finish, matched, abort_message); raises for engine-side errors and unknown shapes."""
    if isinstance(fr, str):  # SGLang <= 2024-05: a bare string
        fr = {"type": fr}
    if not isinstance(fr, dict):
        raise UpstreamInvalid(
            f"sglang {request_id}: finish_reason {fr!r} is not a final finish reason", engine=engine
        )
    kind = fr.get("type")
    if kind == "stop":
        matched = fr.get("matched")
        return "stop", matched if isinstance(matched, int | str) else None, None
    if kind == "length":
        return "length", None, None
    if kind == "abort":
        message = fr.get("message")
        status = fr.get("status_code")
        if is_int(status) and status >= 400:
            raise UpstreamHTTPError(
                f"sglang {request_id}: aborted with {status}: {message}",
                engine=engine,
                http_status=status,
            )
        return "abort", None, None if message is None else str(message)
    raise UpstreamInvalid(f"sglang {request_id}: unknown finish_reason {fr!r}", engine=engine)


def _top_logprobs(raw: Any, n: int) -> list[Any] | None:
    """Per token: list of (id, logprob) from `output_top_logprobs` triples; raw values kept."""
    if not isinstance(raw, list):
        return None
    out: list[Any] = []
    for entry in raw[:n] if n else raw:
        if isinstance(entry, list):
            out.append([(t[1], t[0]) if isinstance(t, list) and len(t) >= 2 else t for t in entry])
        else:
            out.append(entry)
    return out


def _from_struct(
    resp: _Generate, *, request_id: str, engine: str, require_logprobs: bool, final: bool = True
) -> GenerateResult:
    if resp.error is not None and resp.meta_info is None:
        raise UpstreamHTTPError(
            f"sglang {request_id}: {_error_message(resp.error)}", engine=engine, http_status=200
        )
    meta = resp.meta_info
    if meta is None:
        raise UpstreamInvalid(f"sglang {request_id}: response has no meta_info", engine=engine)
    if final:
        finish, matched, abort_message = _finish(
            meta.finish_reason, engine=engine, request_id=request_id
        )
    else:
        finish, matched, abort_message = "abort", None, None
    ct = meta.completion_tokens
    echo: list[Any] | None = None
    if isinstance(resp.output_ids, list):
        echo = resp.output_ids
        # 0.4.10-0.5.4 prepend the last 5 prompt tokens: keep the last completion_tokens.
        if is_int(ct) and 0 <= ct <= len(echo):
            echo = echo[len(echo) - ct :]
    elif resp.output_ids is not None:
        raise UpstreamInvalid(f"sglang {request_id}: output_ids is not a list", engine=engine)

    triples = meta.output_token_logprobs
    if isinstance(triples, list):
        ids: list[Any] = []
        lps: list[Any] = []
        for t in triples:
            if not isinstance(t, list) or len(t) < 2:
                raise UpstreamInvalid(
                    f"sglang {request_id}: malformed logprob entry {t!r}", engine=engine
                )
            lps.append(t[0])
            ids.append(t[1])
        output_ids: Sequence[Any] = ids
        logprobs: Sequence[Any] = lps
    elif triples is None and not require_logprobs and echo is not None:
        output_ids, logprobs, echo = echo, [], None
    else:
        raise UpstreamInvalid(
            f"sglang {request_id}: no output_token_logprobs"
            + ("" if require_logprobs else " and no output_ids"),
            engine=engine,
        )
    return GenerateResult(
        request_id=meta.id,
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish,  # type: ignore[arg-type]
        matched_stop=matched,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=ct,
        cached_tokens=meta.cached_tokens,
        weight_version=meta.weight_version,
        output_ids_echo=echo,
        top_logprobs=_top_logprobs(meta.output_top_logprobs, 0),
        routed_experts=raw_or_none(meta.routed_experts),
        abort_message=abort_message,
    )


def _decode(body: bytes, *, request_id: str, engine: str) -> _Generate:
    try:
        resp = _DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise UpstreamInvalid(f"sglang {request_id}: malformed JSON: {exc}", engine=engine) from exc
    if isinstance(resp, list):
        raise UpstreamInvalid(
            f"sglang {request_id}: got a list of {len(resp)} results (batch or n>1)", engine=engine
        )
    return resp


def parse_sglang_generate(
    body: bytes, *, request_id: str, engine: str = "", require_logprobs: bool = True
) -> GenerateResult:
    """Parse one non-streaming `/generate` body (HTTP 200). Pure; no I/O.

    `require_logprobs=False` accepts bodies without `output_token_logprobs` (the
    adapter always asks for them, captured docs samples never did); then ids come
    from `output_ids` and `logprobs` is empty, which validation rejects downstream."""
    resp = _decode(body, request_id=request_id, engine=engine)
    return _from_struct(resp, request_id=request_id, engine=engine, require_logprobs=require_logprobs)


class SGLangStream:
    """Folds the frames of one streamed `/generate` into deltas and the final result.

    Frames are cumulative by default (each repeats every earlier token) and deltas with
    the server's incremental streaming option: a frame whose `output_token_logprobs`
    cover all `completion_tokens` is cumulative. The final result is the last frame
    (cumulative) or the frames joined (incremental), parsed as a non-streamed body is."""

    def __init__(self, *, request_id: str, engine: str = "") -> None:
        self.request_id, self.engine = request_id, engine
        self.last: _Generate | None = None
        self.triples: list[Any] = []
        self.tops: list[Any] = []
        self.ids: list[Any] = []
        self.incremental = False
        self.done = False

    def add(self, payload: bytes) -> TokenDelta | None:
        """One `data:` payload; the tokens it adds (None: none, or `[DONE]`)."""
        if payload == b"[DONE]":
            self.done = True
            return None
        frame = _decode(payload, request_id=self.request_id, engine=self.engine)
        if frame.error is not None:
            raise UpstreamHTTPError(
                f"sglang {self.request_id}: stream error: {_error_message(frame.error)}", engine=self.engine
            )
        meta = frame.meta_info
        self.last = frame
        triples = meta.output_token_logprobs if meta is not None else None
        if not isinstance(triples, list):
            return None
        tops = meta.output_top_logprobs if meta is not None and isinstance(meta.output_top_logprobs, list) else []
        ct = meta.completion_tokens if meta is not None else None
        cumulative = not self.incremental and (not is_int(ct) or ct == len(triples)) and len(triples) >= len(self.triples)
        if cumulative:
            new, new_tops = triples[len(self.triples):], tops[len(self.triples):]
            self.triples, self.tops = triples, tops
            self.ids = list(frame.output_ids) if isinstance(frame.output_ids, list) else []
        else:
            self.incremental = True
            new, new_tops = triples, tops
            self.triples = self.triples + triples
            self.tops = self.tops + tops
            if isinstance(frame.output_ids, list):
                self.ids.extend(frame.output_ids)
        ok = [t for t in new if isinstance(t, list) and len(t) >= 2]
        if not ok:
            return None
        top = _top_logprobs(new_tops, 0) if new_tops else None
        return TokenDelta(ids=[t[1] for t in ok], logprobs=[t[0] for t in ok], top_logprobs=top)

    def result(self) -> GenerateResult:
        """The final result; a stream cut before `[DONE]` is invalid."""
        last = self.last
        if last is None or not self.done:
            raise UpstreamInvalid(f"sglang {self.request_id}: stream ended without [DONE]", engine=self.engine)
        if self.incremental and last.meta_info is not None:
            last.meta_info.output_token_logprobs = self.triples
            last.meta_info.output_top_logprobs = self.tops or None
            last.output_ids = self.ids
        return _from_struct(last, request_id=self.request_id, engine=self.engine, require_logprobs=True)


def parse_sglang_stream(body: bytes | str, *, request_id: str, engine: str = "") -> GenerateResult:
    """Parse a whole SSE `/generate` stream (cumulative or incremental frames)."""
    text = body.decode() if isinstance(body, bytes) else body
    acc = SGLangStream(request_id=request_id, engine=engine)
    for line in text.splitlines():
        if line.startswith("data:") and not acc.done:
            acc.add(line[5:].strip().encode())
    return acc.result()


def build_sglang_payload(request: GenerateRequest) -> dict[str, Any]:
    """The `/generate` body for one request (exposed for tests and the simulator's log)."""
    s = request.sampling
    sp: dict[str, Any] = {
        "max_new_tokens": request.max_tokens,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }
    sp.update(optional_sampling_fields(s, seed_key="sampling_seed"))
    if s.constraint is not None:
        # SGLang sampling_params `json_schema` (a JSON string) / `regex` / `ebnf`, at most one
        # (sglang/srt/sampling/sampling_params.py `verify`; docs.sglang.io sampling_params)
        sp[s.constraint.kind] = s.constraint.text
    payload: dict[str, Any] = {
        "rid": request.request_id,
        "input_ids": request.input_ids,
        "sampling_params": sp,
        "return_logprob": True,
        "stream": False,
    }
    if request.top_logprobs:
        payload["top_logprobs_num"] = request.top_logprobs
    if request.dp_rank is not None:
        payload["data_parallel_rank"] = request.dp_rank
    if request.lora is not None:
        payload["lora_path"] = request.lora
    if request.cache_salt is not None:
        payload["extra_key"] = request.cache_salt
    if request.return_routed_experts:
        payload["return_routed_experts"] = True
        if request.routed_experts_start:
            # rows cover [routed_experts_start_len, seqlen - 1); 0 = the whole sequence
            # (sgl-project/sglang python/sglang/srt/managers/io_struct.py, GenerateReqInput)
            payload["routed_experts_start_len"] = request.routed_experts_start
    return payload


# The plane's pause modes in SGLang's own names (`POST /pause_generation {mode}`: abort,
# retract, in_place). `keep` freezes requests with their KV: `in_place`. SGLang has no
# drain mode, so for `wait` (the plane has drained its own requests first) it is frozen
# `in_place` too.
_PAUSE_MODES: dict[str, str] = {"abort": "abort", "keep": "in_place", "wait": "in_place"}


class SGLangAdapter:
    """One SGLang server (all its DP ranks) behind `EngineAdapter`."""

    protocol = "sglang"
    capabilities = EngineCapabilities(
        streams=True, reports_load=True, reports_dp_size=True, names_model=True, pushes_weight_version=True,
    )

    def __init__(
        self,
        base_url: str,
        *,
        max_concurrency: int = 256,
        limits: ConnectionLimits | None = None,
        retries: int = 2,
        control_timeout_s: float = 30.0,
        offload: Offload = run_inline,
    ) -> None:
        self.http = EngineHTTP(
            base_url, protocol=self.protocol, max_concurrency=max_concurrency, limits=limits,
            retries=retries, control_timeout_s=control_timeout_s,
        )
        self.base_url = self.http.base_url
        self._offload = offload

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """POST /generate; deadline `request.timeout_s` from dispatch (after the concurrency cap)."""
        body = encode_json(build_sglang_payload(request))
        reply = await self.http.generate("/generate", body, timeout_s=request.timeout_s,
                                         slot_held=request.slot_held)
        if reply.status != 200:
            raise http_error(reply, what=f"sglang {request.request_id}", engine=self.base_url)
        # a reply can carry a ~1.4 MB routed-experts payload: decode it off the event loop
        return await self._offload(
            parse_sglang_generate, reply.body, request_id=request.request_id, engine=self.base_url
        )

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        """POST /generate with `stream: true`: a `TokenDelta` per frame as the engine sends
        it, then the final `GenerateResult`, equal to what `generate` returns."""
        payload = build_sglang_payload(request)
        payload["stream"] = True
        acc = SGLangStream(request_id=request.request_id, engine=self.base_url)
        async for item in fold_stream(self.http.stream("/generate", encode_json(payload), timeout_s=request.timeout_s,
                                                    slot_held=request.slot_held), acc, self._offload):
            yield item

    # --- control plane -------------------------------------------------------------

    async def health(self) -> bool:
        """GET /health: an empty 200 when serving."""
        return await self.http.health()

    async def prove_protocol(self) -> None:
        """`/get_model_info` is a JSON object naming a generation model (`model_path`,
        `is_generation` not false)."""
        info = await self.model_info()
        if not isinstance(info, dict) or "model_path" not in info:
            raise EngineRefused(
                f"{self.base_url}: /get_model_info is not SGLang's (no model_path): {str(info)[:200]}")
        if info.get("is_generation") is False:
            raise EngineRefused(f"{self.base_url}: the served model is not a generation model")

    async def model_info(self) -> dict[str, Any]:
        return await self.http.call_json("GET", "/get_model_info")

    async def served_model_path(self) -> str | None:
        """The served model's path or hub name: `/get_model_info`'s `model_path` (the
        `--model-path` it was started with; tests/fixtures/engines/sglang/get_model_info_2026-04.json)."""
        info = await self.model_info()
        path = info.get("model_path") if isinstance(info, dict) else None
        return path if isinstance(path, str) and path else None

    async def server_info(self) -> dict[str, Any]:
        """`/get_server_info` (newer builds also serve `/server_info`); carries `dp_size`."""
        try:
            return await self.http.call_json("GET", "/get_server_info")
        except UpstreamHTTPError as exc:
            if exc.http_status != 404:
                raise
            return await self.http.call_json("GET", "/server_info")

    async def dp_size(self) -> int:
        info = await self.server_info()
        size = info.get("dp_size") if isinstance(info, dict) else None
        return size if is_int(size) and size > 0 else 1

    async def get_load(self) -> Any:
        return await self.http.call_json("GET", "/get_load")

    async def load_by_rank(self) -> dict[int, int]:
        """Running + waiting requests per DP rank, from `/get_load` (engines/load.py)."""
        return sglang_load(await self.get_load())

    def pause_mode(self, mode: str) -> str:
        """SGLang's own name for the plane's pause `mode` (`_PAUSE_MODES`)."""
        return _PAUSE_MODES[mode]

    async def pause(self, mode: str = "abort") -> None:
        """POST /pause_generation {mode}; modes: abort, retract, in_place."""
        await self.http.call_json("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.http.call_json("POST", "/continue_generation", {})

    async def update_weight_version(self, version: str) -> dict[str, Any]:
        """`POST /update_weight_version {"new_version", "abort_all_requests": false}`: the
        version `meta_info.weight_version` reports for requests that finish from now on.
        Its `abort_all_requests` defaults to true (SGLang's `UpdateWeightVersionReqInput`):
        sent false, since pauses are the plane's to decide."""
        return await self.http.set_version({"new_version": version, "abort_all_requests": False})

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (rids match by prefix: use fixed-width ids) or all when rid is None."""
        await self.http.call_json("POST", "/abort_request", {"rid": rid} if rid else {"abort_all": True})

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """Abort each of `rids`: SGLang's `/abort_request` takes one id per call."""
        await asyncio.gather(*(self.abort(rid) for rid in rids))

    def slot(self) -> AbstractAsyncContextManager[None]:
        """One of this engine's concurrency slots (see `EngineHTTP.slot`)."""
        return self.http.slot()

    async def abort_request(self, rid: str) -> None:
        """Abort one request (SGLang `POST /abort_request {rid}`; matches by rid prefix, so
        our ids are fixed width). A request already finished is a no-op there."""
        await self.http.call_json("POST", "/abort_request", {"rid": rid}, timeout_s=5.0)

    async def flush_cache(self) -> None:
        await self.http.call_json("POST", "/flush_cache")

    async def aclose(self, drain_s: float = 0.0) -> None:
        await self.http.aclose(drain_s)
