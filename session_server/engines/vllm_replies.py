"""vLLM's replies, parsed: the pure, I/O-free readers of `/inference/v1/generate` and
`/v1/completions` bodies and of their streams (the adapter is in vllm.py).

Version drift handled (ENGINES.md): logprob entries as `{"token": "token_id:123",
"logprob"}` or `{"token_id": 123, "logprob", ...}`; `prompt_token_ids` inside the
completions choice; `usage` may be missing.

Missing `usage` (documented choice): `completion_tokens = len(token_ids)`,
`prompt_tokens = len(prompt_token_ids)` when the choice carries them, else None,
and `cached_tokens` None; the validator decides whether None is acceptable.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from session_server.engines.base import GenerateResult, TokenDelta
from session_server.engines.http import raw_or_none
from session_server.errors import UpstreamHTTPError, UpstreamInvalid
from trajectory.validate import is_int

__all__ = [
    "ID_PREFIXES",
    "VLLMStream",
    "parse_vllm_completions",
    "parse_vllm_generate",
    "parse_vllm_logprob_content",
]

_TOKEN_ID_RE = re.compile(r"^token_id:(-?\d+)$")
# vLLM names a request by its own id, our id prefixed per endpoint (0.32: `cmpl-` on
# completions, `generate-tokens-` on the token-in endpoint)
ID_PREFIXES = ("cmpl-", "generate-tokens-")


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
        for prefix in ID_PREFIXES:
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
