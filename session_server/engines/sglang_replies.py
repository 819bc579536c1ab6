"""SGLang's replies, parsed: the pure, I/O-free readers of `/generate` bodies and of
their streams (the adapter is in sglang.py).

Version drift handled (ENGINES.md, SOURCES.md): ids and logprobs come from
`meta_info.output_token_logprobs` triples `[logprob, id, text|null]`; `output_ids`
(absent before ~0.4.10, prefixed by up to 5 prompt tokens in 0.4.10-0.5.4) is only an
echo, sliced to its last `completion_tokens`; `finish_reason` is an object, a bare
string (2024-05) or null (mid-stream); a JSON list body (batch or n>1) is refused;
unknown `meta_info` keys are ignored; `routed_experts` stays `msgspec.Raw`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from session_server.engines.base import GenerateResult, TokenDelta
from session_server.engines.http import raw_or_none
from session_server.errors import UpstreamHTTPError, UpstreamInvalid
from trajectory.validate import is_int

__all__ = ["SGLangStream", "parse_sglang_generate", "parse_sglang_stream"]


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
    (cumulative) or the frames joined (incremental), parsed as a non-streamed body is.
    Read as deltas, every frame's `completion_tokens` must equal the tokens held so far:
    a cumulative stream wrongly declared incremental fails at its first repeat, not at
    the end (`UpstreamInvalid`)."""

    def __init__(self, *, request_id: str, engine: str = "", incremental: bool = False) -> None:
        self.request_id, self.engine = request_id, engine
        self.last: _Generate | None = None
        self.triples: list[Any] = []
        self.tops: list[Any] = []
        self.ids: list[Any] = []
        # known deltas (the server runs with --incremental-streaming-output): every frame,
        # the first included, is read as new tokens; else told from the frames themselves
        self.incremental = incremental
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
            if is_int(ct) and len(self.triples) != ct:
                # cumulative frames read as deltas (a server wrongly declared incremental):
                # fail at this frame, so a watched turn is sent again unstreamed
                raise UpstreamInvalid(
                    f"sglang {self.request_id}: {len(self.triples)} tokens streamed but completion_tokens "
                    f"is {ct} (frames declared incremental are cumulative?)", engine=self.engine)
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
