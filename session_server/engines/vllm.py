"""vLLM token-in adapter, its request bodies, and vLLM's (dev-mode) control plane.

Every vLLM field name lives here or in vllm_replies.py (the pure parsers of its
replies). The token-in endpoint `/inference/v1/generate` is used when `discover()`
finds it (it is opt-in on the server), else `/v1/completions` with a token-id prompt.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any

import msgspec

from session_server.engines.base import (
    EngineCapabilities,
    GenerateRequest,
    GenerateResult,
    StreamItem,
    optional_sampling_fields,
    parsed_without_routed,
    request_headers,
)
from session_server.engines.http import (
    ConnectionLimits,
    EngineHTTP,
    RemoteFetch,
    encode_json,
    http_error,
)
from session_server.engines.load import vllm_load
from session_server.engines.streams import Offload, fold_stream, run_inline
from session_server.engines.vllm_replies import (
    ID_PREFIXES,
    VLLMStream,
    parse_vllm_completions,
    parse_vllm_generate,
)
from session_server.errors import UpstreamInvalid

# the reply parsers the adapter uses are importable from here too (ops/verify_engine.py)
__all__ = ["VLLMAdapter", "VLLMStream", "engine_request_ids", "parse_vllm_completions", "parse_vllm_generate"]

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
DP_RANK_HEADER = "X-data-parallel-rank"


def _sampling(request: GenerateRequest) -> dict[str, Any]:
    s = request.sampling
    sp: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        "logprobs": max(1, request.top_logprobs),
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    sp.update(optional_sampling_fields(s, seed_key="seed"))
    return sp


# vLLM structured outputs (docs.vllm.ai features/structured_outputs): since 0.10.2 a
# `structured_outputs` object {json, regex, grammar, choice, ...}; the older top-level
# `guided_json`/`guided_regex`/`guided_grammar` were deprecated in 0.10.2 and removed in
# 0.12.0. The token-in endpoint is newer than the rename and takes the object inside
# `sampling_params`. `/v1/completions` uses what `/version` says; unknown: the newer one.
_SO_KEYS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
_GUIDED_KEYS = {"json_schema": "guided_json", "regex": "guided_regex", "ebnf": "guided_grammar"}

# the parser per (`/inference/v1/generate`?, routed experts asked for?), one object per kind
# of reply: `EngineHTTP.generate` learns each kind's reply size
_PARSE: dict[tuple[bool, bool], Callable[..., GenerateResult]] = {
    (True, True): parse_vllm_generate, (False, True): parse_vllm_completions,
    (True, False): partial(parsed_without_routed, parse_vllm_generate),
    (False, False): partial(parsed_without_routed, parse_vllm_completions),
}
STRUCTURED_SINCE = (0, 10, 2)


def _constraint_fields(request: GenerateRequest, *, legacy: bool = False) -> dict[str, Any]:
    c = request.sampling.constraint
    if c is None:
        return {}
    if legacy:
        return {_GUIDED_KEYS[c.kind]: c.text}
    return {"structured_outputs": {_SO_KEYS[c.kind]: c.text}}


def _version_tuple(text: Any) -> tuple[int, ...] | None:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    return None if m is None else tuple(int(x or 0) for x in m.groups())


def build_vllm_generate_payload(request: GenerateRequest, model: str) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "request_id": request.request_id,
        "model": request.lora or model,
        "token_ids": request.input_ids,
        "sampling_params": {**_sampling(request), **_constraint_fields(request)},
        "stream": False,
    }
    if request.cache_salt is not None:
        payload["cache_salt"] = request.cache_salt
    return payload


def build_vllm_completions_payload(request: GenerateRequest, model: str, *, legacy_guided: bool = False) -> dict[str, Any]:
    payload = _sampling(request)
    payload.update(_constraint_fields(request, legacy=legacy_guided))
    payload.update(
        {
            "model": request.lora or model,
            "prompt": request.input_ids,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "request_id": request.request_id,
            "stream": False,
        }
    )
    if request.cache_salt is not None:
        payload["cache_salt"] = request.cache_salt
    return payload


def engine_request_ids(rids: Sequence[str]) -> list[str]:
    """Our request ids as vLLM names them internally: the bare id (older servers) and each
    endpoint's prefixed form (`ID_PREFIXES`); an abort of an unknown id is a no-op."""
    return [form for rid in rids for form in (rid, *(p + rid for p in ID_PREFIXES))]


class VLLMAdapter:
    """One vLLM server behind `EngineAdapter` (token-in generate, else completions)."""

    protocol = "vllm"
    # no dp_size: vLLM does not report its DP size (its own balancer spreads our requests)
    capabilities = EngineCapabilities(
        streams=True, incremental_stream=True, reports_load=True, names_model=True, pushes_weight_version=True,
        # with the server flag `--logprobs-mode processed_logprobs` (0.32, engine arg, not
        # per request): logprobs after masking, a masked token at -9999.0 on the wire
        support_logprobs="processed",
    )

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        endpoint: str = "auto",  # "auto" | "generate" | "completions"
        max_concurrency: int = 256,
        limits: ConnectionLimits | None = None,
        retries: int = 2,
        control_timeout_s: float = 30.0,
        offload: Offload = run_inline,
        remote: RemoteFetch | None = None,
    ) -> None:
        if endpoint not in ("auto", "generate", "completions"):
            raise ValueError(f"endpoint must be auto, generate or completions, not {endpoint!r}")
        self.http = EngineHTTP(
            base_url, protocol=self.protocol, max_concurrency=max_concurrency, limits=limits,
            retries=retries, control_timeout_s=control_timeout_s,
        )
        self.base_url = self.http.base_url
        self.model = model
        self.endpoint: str | None = None if endpoint == "auto" else endpoint
        self._offload = offload
        self._remote = remote
        self._discover_lock = asyncio.Lock()
        self.version: tuple[int, ...] | None = None  # from GET /version; None = unknown

    async def discover(self) -> str:
        """Find the served model (`/v1/models`) and whether `/inference/v1/generate` exists.

        The endpoint check posts an empty body: a validation error (400/422) proves the
        route exists without generating anything; 404/405 means it is not enabled."""
        async with self._discover_lock:
            if self.model is None:
                reply = await self.http.call("GET", "/v1/models")
                if reply.status != 200:
                    raise http_error(reply, what="vllm /v1/models", engine=self.base_url)
                try:
                    data = msgspec.json.decode(reply.body)
                    self.model = str(data["data"][0]["id"])
                except (msgspec.DecodeError, KeyError, IndexError, TypeError) as exc:
                    raise UpstreamInvalid(
                        f"vllm /v1/models: unexpected body {reply.body[:200]!r}", engine=self.base_url
                    ) from exc
            if self.version is None:
                reply = await self.http.call("GET", "/version")
                if reply.status == 200:
                    try:
                        self.version = _version_tuple(msgspec.json.decode(reply.body).get("version"))
                    except (msgspec.DecodeError, AttributeError):
                        self.version = None
            if self.endpoint is None:
                reply = await self.http.call("POST", GENERATE_PATH, {})
                self.endpoint = "completions" if reply.status in (404, 405) else "generate"
            return self.endpoint

    async def prove_protocol(self) -> None:
        """`/v1/models` names a model and the token-in endpoint check answers (a validation
        error proves the route; a 404 falls back to `/v1/completions`, which `/v1/models`
        already vouches for): `discover`."""
        await self.discover()

    async def served_model_path(self) -> str | None:
        """The served model's path or hub name: `/v1/models`' first `root` (the `--model`
        it was started with; its `id` is the served name, which `--served-model-name`
        may change: tests/fixtures/engines/vllm/real-0.32.0-cpu/models.json)."""
        reply = await self.http.call("GET", "/v1/models")
        if reply.status != 200:
            raise http_error(reply, what="vllm /v1/models", engine=self.base_url)
        try:
            first = msgspec.json.decode(reply.body)["data"][0]
            path = first.get("root") or first.get("id")
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise UpstreamInvalid(f"vllm /v1/models: unexpected body {reply.body[:200]!r}",
                                  engine=self.base_url) from exc
        return path if isinstance(path, str) and path else None

    async def _request(self, request: GenerateRequest, *, stream: bool) -> tuple[str, bytes, dict[str, str]]:
        """(path, body, headers) of one generation on the discovered endpoint."""
        if self.endpoint is None or self.model is None:
            await self.discover()
        assert self.model is not None
        if self.endpoint == "generate":
            path, payload = GENERATE_PATH, build_vllm_generate_payload(request, self.model)
            if stream:  # 0.32 streams no usage frame unless asked, on this endpoint too
                payload["stream_options"] = {"include_usage": True}
        else:
            legacy = self.version is not None and self.version < STRUCTURED_SINCE
            path, payload = COMPLETIONS_PATH, build_vllm_completions_payload(
                request, self.model, legacy_guided=legacy
            )
            if stream:
                payload["stream_options"] = {"include_usage": True}
        payload["stream"] = stream
        headers = {} if request.dp_rank is None else {DP_RANK_HEADER: str(request.dp_rank)}
        # the trace headers are read by vLLM's OpenAI server (vllm/tracing.py TRACE_HEADERS)
        headers.update(request_headers(request) or {})
        return path, encode_json(payload), headers

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        path, body, headers = await self._request(request, stream=False)
        parse = _PARSE[(self.endpoint == "generate", request.return_routed_experts)]
        # a reply can carry a large routed-experts payload: decoded off the event loop, or
        # fetched whole by the reply worker once this kind of reply is known to be large
        return await self.http.generate(
            path, body, parse, what=f"vllm {request.request_id}", timeout_s=request.timeout_s, headers=headers,
            slot_held=request.slot_held, offload=self._offload, remote=self._remote,
            parse_kw={"request_id": request.request_id, "engine": self.base_url})

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        """The same request with `stream: true`: a `TokenDelta` per chunk as the engine
        sends it, then the final `GenerateResult`, equal to what `generate` returns."""
        path, body, headers = await self._request(request, stream=True)
        acc = VLLMStream(completions=self.endpoint != "generate", request_id=request.request_id,
                         engine=self.base_url)
        async for item in fold_stream(self.http.stream(path, body, timeout_s=request.timeout_s, headers=headers,
                                                    slot_held=request.slot_held), acc, self._offload):
            yield item

    # --- control plane (dev mode) -----------------------------------------------------

    async def health(self) -> bool:
        """GET /health: a bare 200 when serving."""
        return await self.http.health()

    def pause_mode(self, mode: str) -> str:
        """vLLM names the plane's modes alike: `abort`, `keep` (requests freeze with their
        KV) and `wait` (running requests finish first; the plane has drained its own)."""
        return mode

    async def pause(self, mode: str = "abort", *, clear_cache: bool = False) -> None:
        """POST /pause?mode=abort|wait|keep (query parameters, not a body)."""
        params = {"mode": mode}
        if clear_cache:
            params["clear_cache"] = "true"
        await self.http.call_json("POST", "/pause", params=params)

    async def resume(self) -> None:
        await self.http.call_json("POST", "/resume")

    async def update_weight_version(self, version: str) -> dict[str, Any]:
        """`POST /update_weight_version {"new_version"}` (0.32, dev mode): the version its
        `weight_versions` spans report for tokens sampled from now on, paused or not."""
        return await self.http.set_version({"new_version": version})

    async def load_by_rank(self) -> dict[int, int]:
        """Running + waiting requests per DP rank from `GET /metrics` (engines/load.py);
        the exposition is parsed off the event loop."""
        reply = await self.http.call("GET", "/metrics")
        if reply.status != 200:
            raise http_error(reply, what="vllm /metrics", engine=self.base_url)
        return dict(await self._offload(vllm_load, reply.body))  # sized by the body: large ones leave the loop

    async def is_paused(self) -> bool:
        data = await self.http.call_json("GET", "/is_paused")
        return bool(isinstance(data, dict) and data.get("is_paused"))

    async def abort(self, request_ids: Sequence[str] = ()) -> None:
        """POST /abort_requests (by the engine's own ids); an empty list aborts everything."""
        await self.http.call_json("POST", "/abort_requests", {"request_ids": engine_request_ids(request_ids)})

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """Abort `rids` in one `/abort_requests` call; nothing is sent for none (an empty
        list would abort everything)."""
        if rids:
            await self.abort(list(rids))

    def slot(self) -> AbstractAsyncContextManager[None]:
        """One of this engine's concurrency slots (see `EngineHTTP.slot`)."""
        return self.http.slot()

    async def abort_request(self, rid: str) -> None:
        """Abort one request (vLLM `POST /abort_requests {request_ids}`); never an empty
        list, which would abort everything. vLLM aborts by its own id, which prefixes ours
        per endpoint (0.32: `generate-tokens-` on the token-in endpoint, `cmpl-` on
        completions; a bare id answers 200 and aborts nothing), so every form is sent."""
        if not rid:
            raise ValueError("abort_request needs a request id")
        await self.http.call_json("POST", "/abort_requests", {"request_ids": engine_request_ids([rid])},
                                  timeout_s=5.0)

    async def aclose(self, drain_s: float = 0.0) -> None:
        await self.http.aclose(drain_s)
