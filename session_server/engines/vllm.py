"""vLLM token-in adapter, its pure response parsers, and vLLM's (dev-mode) control plane.

Every vLLM field name lives here. The token-in endpoint `/inference/v1/generate`
is used when `discover()` finds it (it is opt-in on the server), else `/v1/completions`
with a token-id prompt. Version drift handled (ENGINES.md): logprob entries as
`{"token": "token_id:123", "logprob"}` or `{"token_id": 123, "logprob", ...}`;
`prompt_token_ids` inside the completions choice; `usage` may be missing.

Missing `usage` (documented choice): `completion_tokens = len(token_ids)`,
`prompt_tokens = len(prompt_token_ids)` when the choice carries them, else None,
and `cached_tokens` None; the validator decides whether None is acceptable.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec

from session_server.engines.base import (
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
from session_server.engines.load import vllm_load
from session_server.errors import UpstreamHTTPError, UpstreamInvalid
from trajectory.validate import is_int

__all__ = [
    "VLLMAdapter",
    "VLLMStream",
    "parse_vllm_completions",
    "parse_vllm_generate",
    "parse_vllm_logprob_content",
]

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
DP_RANK_HEADER = "X-data-parallel-rank"
_TOKEN_ID_RE = re.compile(r"^token_id:(-?\d+)$")
_ID_PREFIXES = ("cmpl-", "generate-tokens-")


class _Choice(msgspec.Struct):
    index: Any = None
    text: Any = None
    token_ids: Any = None
    prompt_token_ids: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    logprobs: Any = None
    routed_experts: msgspec.Raw = msgspec.Raw()
    weight_versions: Any = None  # 0.32+: [{version, start, end}] over the output (last stream frame)


class _Envelope(msgspec.Struct):
    id: Any = None
    request_id: Any = None
    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = None


_DECODER = msgspec.json.Decoder(_Envelope | list[Any])


def _token_id(token: Any) -> Any:
    """`"token_id:123"` -> 123; anything else is kept raw for the validator."""
    if isinstance(token, str):
        m = _TOKEN_ID_RE.match(token)
        if m:
            return int(m.group(1))
    return token


def parse_vllm_logprob_content(entries: Any, *, engine: str = "", request_id: str = "") -> tuple[
    list[Any], list[Any], list[Any]
]:
    """Chat-style logprob entries in either encoding -> (ids, logprobs, top per token)."""
    if not isinstance(entries, list):
        raise UpstreamInvalid(f"vllm {request_id}: logprobs content is not a list", engine=engine)
    ids: list[Any] = []
    lps: list[Any] = []
    tops: list[Any] = []
    for e in entries:
        if not isinstance(e, dict) or "logprob" not in e:
            raise UpstreamInvalid(f"vllm {request_id}: malformed logprob entry {e!r}", engine=engine)
        ids.append(e["token_id"] if "token_id" in e else _token_id(e.get("token")))
        lps.append(e["logprob"])
        top = e.get("top_logprobs") or []
        tops.append(
            [
                (t["token_id"] if "token_id" in t else _token_id(t.get("token")), t.get("logprob"))
                for t in top
                if isinstance(t, dict)
            ]
        )
    return ids, lps, tops


def _finish(fr: Any, *, engine: str, request_id: str) -> str:
    if fr in ("stop", "length", "abort"):
        return fr
    if fr == "repetition":  # the engine's repetition detector stopped it: no stop id, no match
        return "repetition"
    if fr == "error":
        raise UpstreamHTTPError(
            f"vllm {request_id}: finish_reason error", engine=engine, http_status=500
        )
    raise UpstreamInvalid(f"vllm {request_id}: unknown finish_reason {fr!r}", engine=engine)


def _decode(body: bytes, *, request_id: str, engine: str) -> tuple[_Envelope, _Choice]:
    try:
        resp = _DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise UpstreamInvalid(f"vllm {request_id}: malformed response: {exc}", engine=engine) from exc
    if isinstance(resp, list):
        raise UpstreamInvalid(f"vllm {request_id}: response is a JSON list", engine=engine)
    if resp.error is not None:
        err = resp.error
        msg = err.get("message") if isinstance(err, dict) else err
        code = err.get("code") if isinstance(err, dict) else None
        raise UpstreamHTTPError(
            f"vllm {request_id}: {msg}", engine=engine, http_status=code if is_int(code) else 200
        )
    if not resp.choices or len(resp.choices) != 1:
        n = 0 if not resp.choices else len(resp.choices)
        raise UpstreamInvalid(f"vllm {request_id}: expected one choice, got {n}", engine=engine)
    return resp, resp.choices[0]


def _echoed_id(raw: Any) -> Any:
    if isinstance(raw, str):
        for prefix in _ID_PREFIXES:
            if raw.startswith(prefix):
                return raw[len(prefix) :]
    return raw


def _usage(usage: Any, token_ids: Sequence[Any], prompt_ids: Any) -> tuple[Any, Any, Any]:
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached
    prompt = len(prompt_ids) if isinstance(prompt_ids, list) else None
    return prompt, len(token_ids), None


def _result(
    env: _Envelope,
    choice: _Choice,
    *,
    ids: list[Any],
    lps: list[Any],
    echo: list[Any] | None,
    tops: list[Any] | None,
    engine: str,
    request_id: str,
) -> GenerateResult:
    finish = _finish(choice.finish_reason, engine=engine, request_id=request_id)
    prompt, completion, cached = _usage(env.usage, ids, choice.prompt_token_ids)
    matched = choice.stop_reason if isinstance(choice.stop_reason, int | str) else None
    spans = _version_spans(choice.weight_versions)
    return GenerateResult(
        request_id=_echoed_id(env.request_id if env.request_id is not None else env.id),
        output_ids=ids,
        logprobs=lps,
        finish_reason=finish,  # type: ignore[arg-type]
        matched_stop=matched,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        weight_version=spans[-1][2] if spans else None,
        version_spans=spans,
        output_ids_echo=echo,
        top_logprobs=tops,
        routed_experts=raw_or_none(choice.routed_experts),
    )


def _version_spans(raw: Any) -> list[tuple[Any, Any, Any]] | None:
    """`weight_versions` entries as raw (start, end, version) triples; a malformed entry is
    kept malformed (None fields) for the span check to reject, never dropped."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        return [(None, None, raw)]
    return [(e.get("start"), e.get("end"), e.get("version")) if isinstance(e, dict) else (None, None, e)
            for e in raw]


def parse_vllm_generate(body: bytes, *, request_id: str, engine: str = "") -> GenerateResult:
    """Parse one non-streaming `/inference/v1/generate` body (HTTP 200). Pure; no I/O."""
    env, choice = _decode(body, request_id=request_id, engine=engine)
    return _generate_result(env, choice, request_id=request_id, engine=engine)


def _generate_result(env: _Envelope, choice: _Choice, *, request_id: str, engine: str) -> GenerateResult:
    if not isinstance(choice.token_ids, list):
        raise UpstreamInvalid(f"vllm {request_id}: choice has no token_ids", engine=engine)
    lp = choice.logprobs
    content = lp.get("content") if isinstance(lp, dict) else lp
    if content is None:
        raise UpstreamInvalid(f"vllm {request_id}: no logprobs in the choice", engine=engine)
    echo, lps, tops = parse_vllm_logprob_content(content, engine=engine, request_id=request_id)
    return _result(
        env, choice, ids=choice.token_ids, lps=lps, echo=echo, tops=tops,
        engine=engine, request_id=request_id,
    )


def parse_vllm_completions(body: bytes, *, request_id: str, engine: str = "") -> GenerateResult:
    """Parse one non-streaming `/v1/completions` body requested with a token-id prompt,
    `return_token_ids` and `return_tokens_as_token_ids`. Pure; no I/O."""
    env, choice = _decode(body, request_id=request_id, engine=engine)
    return _completions_result(env, choice, request_id=request_id, engine=engine)


def _completions_result(env: _Envelope, choice: _Choice, *, request_id: str, engine: str) -> GenerateResult:
    if not isinstance(choice.token_ids, list):
        raise UpstreamInvalid(
            f"vllm {request_id}: choice has no token_ids (return_token_ids unsupported?)",
            engine=engine,
        )
    lp = choice.logprobs
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
        raise UpstreamInvalid(f"vllm {request_id}: no logprobs in the choice", engine=engine)
    tokens = lp.get("tokens")
    echo = [_token_id(t) for t in tokens] if isinstance(tokens, list) else None
    tops_raw = lp.get("top_logprobs")
    tops = None
    if isinstance(tops_raw, list):
        tops = [
            [(_token_id(k), v) for k, v in m.items()] if isinstance(m, dict) else m
            for m in tops_raw
        ]
    return _result(
        env, choice, ids=choice.token_ids, lps=lp["token_logprobs"], echo=echo, tops=tops,
        engine=engine, request_id=request_id,
    )


class VLLMStream:
    """Folds the frames of one streamed token-in generation into deltas and the final
    result. vLLM streams deltas: `token_ids` and logprob entries per chunk, the finish
    reason and `weight_versions` on the last choice chunk, `usage` on a last chunk without
    choices (with `stream_options.include_usage`, which the adapter always sends),
    `prompt_token_ids` on the first completions chunk; the joined frames are parsed as a
    non-streamed body is."""

    def __init__(self, *, completions: bool, request_id: str, engine: str = "") -> None:
        self.completions, self.request_id, self.engine = completions, request_id, engine
        self.env = _Envelope()
        self.choice = _Choice(token_ids=[])
        self.content: list[Any] = []  # generate: logprob entries
        self.lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        self.done = False

    def add(self, payload: bytes) -> TokenDelta | None:
        if payload == b"[DONE]":
            self.done = True
            return None
        try:
            env = _DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            raise UpstreamInvalid(f"vllm {self.request_id}: malformed stream chunk: {exc}", engine=self.engine) from exc
        if isinstance(env, list):
            raise UpstreamInvalid(f"vllm {self.request_id}: stream chunk is a JSON list", engine=self.engine)
        if env.error is not None:
            _decode(payload, request_id=self.request_id, engine=self.engine)  # raises the typed error
        self.env.id = env.id if env.id is not None else self.env.id
        self.env.request_id = env.request_id if env.request_id is not None else self.env.request_id
        if env.usage is not None:
            self.env.usage = env.usage
        if not env.choices:
            return None
        if len(env.choices) != 1:
            raise UpstreamInvalid(f"vllm {self.request_id}: expected one choice, got {len(env.choices)}",
                                  engine=self.engine)
        return self._choice(env.choices[0])

    def _choice(self, c: _Choice) -> TokenDelta | None:
        acc = self.choice
        for name in ("index", "finish_reason", "stop_reason", "prompt_token_ids", "weight_versions"):
            if getattr(c, name) is not None:
                setattr(acc, name, getattr(c, name))
        if raw_or_none(c.routed_experts) is not None:
            acc.routed_experts = c.routed_experts
        ids = c.token_ids if isinstance(c.token_ids, list) else []
        acc.token_ids.extend(ids)
        lp = c.logprobs
        if self.completions:
            if isinstance(lp, dict):
                for k, v in self.lp.items():
                    if isinstance(lp.get(k), list):
                        v.extend(lp[k])
            lps = lp.get("token_logprobs") if isinstance(lp, dict) else None
        else:
            entries = lp.get("content") if isinstance(lp, dict) else lp
            if isinstance(entries, list):
                self.content.extend(entries)
            lps = [e.get("logprob") if isinstance(e, dict) else e for e in entries] if isinstance(entries, list) else None
        if not ids:
            return None
        return TokenDelta(ids=ids, logprobs=list(lps) if isinstance(lps, list) else [])

    def result(self) -> GenerateResult:
        if not self.done:
            raise UpstreamInvalid(f"vllm {self.request_id}: stream ended without [DONE]", engine=self.engine)
        if self.completions:
            self.choice.logprobs = self.lp
            return _completions_result(self.env, self.choice, request_id=self.request_id, engine=self.engine)
        self.choice.logprobs = {"content": self.content}
        return _generate_result(self.env, self.choice, request_id=self.request_id, engine=self.engine)


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
    endpoint's prefixed form (`_ID_PREFIXES`); an abort of an unknown id is a no-op."""
    return [form for rid in rids for form in (rid, *(p + rid for p in _ID_PREFIXES))]


class VLLMAdapter:
    """One vLLM server behind `EngineAdapter` (token-in generate, else completions)."""

    protocol = "vllm"

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
        return path, encode_json(payload), headers

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        path, body, headers = await self._request(request, stream=False)
        reply = await self.http.generate(path, body, timeout_s=request.timeout_s, headers=headers,
                                         slot_held=request.slot_held)
        if reply.status != 200:
            raise http_error(reply, what=f"vllm {request.request_id}", engine=self.base_url)
        parse = parse_vllm_generate if self.endpoint == "generate" else parse_vllm_completions
        # a reply can carry a large routed-experts payload: decode it off the event loop
        return await self._offload(parse, reply.body, request_id=request.request_id, engine=self.base_url)

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
