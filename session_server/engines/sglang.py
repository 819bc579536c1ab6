"""SGLang native `/generate` adapter, its request body, and SGLang's control plane.

Every SGLang field name lives here or in sglang_replies.py (the pure parsers of its
replies).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from functools import partial
from typing import Any

from session_server.engines.admission_check import EngineRefused
from session_server.engines.base import (
    EngineCapabilities,
    GenerateRequest,
    GenerateResult,
    StreamItem,
    optional_sampling_fields,
    parsed_without_routed,
    request_headers,
)
from session_server.engines.http import ConnectionLimits, EngineHTTP, RemoteFetch, encode_json
from session_server.engines.load import sglang_load
from session_server.engines.sglang_replies import (
    SGLangStream,
    parse_sglang_generate,
    parse_sglang_stream,
)
from session_server.engines.streams import Offload, fold_stream, run_inline
from session_server.errors import UpstreamHTTPError
from trajectory.validate import is_int

log = logging.getLogger("session_server")

# the reply parsers are importable from here too (ops/verify_engine.py)
__all__ = ["SGLangAdapter", "SGLangStream", "build_sglang_payload", "parse_sglang_generate", "parse_sglang_stream"]


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

# one object per kind of reply: `EngineHTTP.generate` learns each kind's reply size
_PARSE_ROUTED = parse_sglang_generate
_PARSE_PLAIN = partial(parsed_without_routed, parse_sglang_generate)


class SGLangAdapter:
    """One SGLang server (all its DP ranks) behind `EngineAdapter`."""

    protocol = "sglang"
    capabilities = EngineCapabilities(
        streams=True, reports_load=True, reports_dp_size=True, names_model=True, pushes_weight_version=True,
        # SGLang's top logprobs are log(softmax(logits / T)) before top-k/top-p/min-p
        # (layers/sampler.py; the default without SGLANG_RETURN_ORIGINAL_LOGPROB)
        support_logprobs="post_temperature",
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
        remote: RemoteFetch | None = None,
        incremental_stream: bool = False,
    ) -> None:
        if incremental_stream:  # started with --incremental-streaming-output: a viewer may watch its turns
            self.capabilities = replace(SGLangAdapter.capabilities, incremental_stream=True)
        self.http = EngineHTTP(
            base_url, protocol=self.protocol, max_concurrency=max_concurrency, limits=limits,
            retries=retries, control_timeout_s=control_timeout_s,
        )
        self.base_url = self.http.base_url
        self._offload = offload
        self._remote = remote

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """POST /generate; deadline `request.timeout_s` from dispatch (after the concurrency cap)."""
        body = encode_json(build_sglang_payload(request))
        # a reply can carry a ~1.4 MB routed-experts payload: decoded off the event loop,
        # or fetched whole by the reply worker once this kind of reply is known to be large
        return await self.http.generate(
            "/generate", body, _PARSE_ROUTED if request.return_routed_experts else _PARSE_PLAIN,
            what=f"sglang {request.request_id}", timeout_s=request.timeout_s, headers=request_headers(request),
            slot_held=request.slot_held, offload=self._offload, remote=self._remote,
            parse_kw={"request_id": request.request_id, "engine": self.base_url})

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        """POST /generate with `stream: true`: a `TokenDelta` per frame as the engine sends
        it, then the final `GenerateResult`, equal to what `generate` returns."""
        payload = build_sglang_payload(request)
        payload["stream"] = True
        acc = SGLangStream(request_id=request.request_id, engine=self.base_url,
                           incremental=self.capabilities.incremental_stream)
        async for item in fold_stream(self.http.stream("/generate", encode_json(payload), timeout_s=request.timeout_s,
                                                    headers=request_headers(request), slot_held=request.slot_held),
                                      acc, self._offload):
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
        if self.capabilities.incremental_stream:
            await self._confirm_incremental()

    async def _confirm_incremental(self) -> None:
        """A server declared incremental (`sglang_incremental_streams`) that reports
        `incremental_streaming_output: false` in `/get_server_info` streams cumulative
        frames: it is read as cumulative (its watched turns go unstreamed), with a warning,
        not refused, since `*` may cover a mixed fleet. A server that does not report the
        flag keeps the declaration; `SGLangStream` still checks every frame."""
        try:
            info = await self.server_info()
        except UpstreamHTTPError as exc:
            log.warning("%s: declared incremental, not confirmed (/get_server_info: %s)", self.base_url, exc)
            return
        if isinstance(info, dict) and info.get("incremental_streaming_output") is False:
            log.warning("%s: declared incremental (sglang_incremental_streams) but its /get_server_info says "
                        "incremental_streaming_output is false: its stream frames are read as cumulative",
                        self.base_url)
            self.capabilities = SGLangAdapter.capabilities

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
