"""One segment of a resilient turn (resilient.py): its input, its stream, its answer checked
and cut where the engine would have stopped. None of these touch the control plane."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import numpy as np

from session_server.engines.base import (
    GenerateRequest,
    GenerateResult,
    StreamItem,
    TokenDelta,
    TokenIds,
)
from session_server.errors import UpstreamInvalid, UpstreamTimeout
from trajectory.errors import ValidationError
from trajectory.validate import Expectations, is_int, validate_chunk, validate_generation

from .stops import StopStrings, StreamStops, cut_at
from .versions import ReceivedSplit, SegmentSpans

__all__ = [
    "abort_on_stop_is_stop", "check_partial", "counted", "enter_by", "extend", "new_request_id", "salted",
    "stop_strings", "streamed",
]

_RID_PREFIX = secrets.token_hex(8)  # per process: ids of two server processes never collide
_rid_counter = itertools.count()


def new_request_id() -> str:
    """A fixed-width (32 hex chars) id: SGLang aborts by rid *prefix*, so ids must be
    prefix-free; equal width makes them so. Random per process, then a counter
    (no syscall per request)."""
    return f"{_RID_PREFIX}{next(_rid_counter):016x}"


async def enter_by(stack: contextlib.AsyncExitStack, cm: contextlib.AbstractAsyncContextManager[Any],
                   deadline: float, what: str) -> None:
    """Enter `cm` on `stack`, waiting no later than the turn's monotonic `deadline`."""
    left = deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(0.0, left)):
            await stack.enter_async_context(cm)
    except TimeoutError:
        raise UpstreamTimeout(
            f"the turn's deadline passed while waiting for {what} ({max(0.0, left):.3f}s)"
        ) from None


def extend(prompt: TokenIds, partial: list[Any]) -> TokenIds:
    """prompt + partial, keeping a numpy prompt numpy (contexts reach 100K+ ids; no list copy)."""
    if not partial:
        return prompt
    if isinstance(prompt, np.ndarray):
        return np.concatenate([prompt, np.asarray(partial, dtype=prompt.dtype)])
    return [*prompt, *partial]


def salted(request_salt: str | None, control_salt: str | None) -> str | None:
    """The segment's cache salt: the request's own, joined with the weight version's."""
    if control_salt is None:
        return request_salt
    return control_salt if request_salt is None else f"{request_salt}:{control_salt}"


def abort_on_stop_is_stop(result: GenerateResult, request: GenerateRequest,
                          expect: Expectations | None) -> GenerateResult:
    """SGLang checks the abort flag before the stop check, so a pause landing on the step
    that sampled end-of-turn reports `abort` with the stop id as the last token. That turn
    is finished: resubmitting would sample past its own end-of-turn."""
    if result.finish_reason != "abort" or not result.output_ids:
        return result
    last = result.output_ids[-1]
    stops = set(request.sampling.stop_token_ids)
    if expect is not None:
        stops |= set(expect.stop_token_ids)
    if not is_int(last) or last not in stops:
        return result
    return replace(result, finish_reason="stop", matched_stop=last, abort_message=None)


def check_partial(result: GenerateResult, seg_rid: str, prompt_len: int, budget: int,
                  expect: Expectations | None, last_version: Any) -> None:
    """Reject bad raw values in an aborted segment before they are accumulated."""
    try:
        if expect is not None:
            validate_generation(result, replace(
                expect, request_id=seg_rid, prompt_len=prompt_len, max_tokens=budget,
                last_weight_version=last_version,
            ))
            return
        n = len(result.output_ids)
        if len(result.logprobs) != n:
            raise ValidationError("logprobs", f"{len(result.logprobs)} logprobs for {n} ids")
        bad = next((i for i, t in enumerate(result.output_ids) if not is_int(t) or t < 0), None)
        if bad is not None:
            raise ValidationError("output_ids", f"{result.output_ids[bad]!r} is not a token id", bad)
        if n > budget:
            raise ValidationError("output_ids", f"{n} ids exceed max_tokens {budget}", budget)
    except ValidationError as exc:
        raise UpstreamInvalid(f"aborted segment {seg_rid} rejected: {exc}") from exc


def _checked_delta(delta: TokenDelta, expect: Expectations | None, seg_rid: str) -> TokenDelta:
    """A chunk held to the per-token rules of a whole result before anyone sees it
    (`validate_chunk`), its values as the trajectory will keep them; a bad one fails
    the turn now (`UpstreamInvalid`: the stream ends with an error event, nothing is
    committed). Without `expect` (no vocabulary known) only the final result is checked."""
    if expect is None:
        return delta
    try:
        ids, lps = validate_chunk(delta.ids, delta.logprobs, delta.top_logprobs, expect)
    except ValidationError as exc:
        raise UpstreamInvalid(f"{seg_rid}: stream chunk rejected: {exc}") from exc
    return TokenDelta(ids.tolist(), lps.tolist(), delta.top_logprobs)


async def streamed(items: AsyncIterator[StreamItem], on_delta: Callable[[TokenDelta], None],
                   expect: Expectations | None, seg_rid: str,
                   stops: StreamStops | None = None, on_stop: Callable[[], None] | None = None) -> GenerateResult:
    """One streamed segment: its checked deltas to `on_delta`, its final result returned.
    With `stops` (a resubmitted segment of a turn with stop strings) nothing past a stop
    string completed across the boundary is shown, and `on_stop` aborts the engine request
    there (its final answer is then cut, `stop_strings`). The engine stream is closed on
    the way out (a rejected chunk drops the connection)."""
    async with contextlib.aclosing(items) as stream:  # type: ignore[type-var]
        async for item in stream:
            if not isinstance(item, TokenDelta):
                return item
            if stops is not None and stops.matched:
                continue  # past the stop: never shown, the engine request is being aborted
            delta = _checked_delta(item, expect, seg_rid)
            keep = None if stops is None else stops.feed(delta.ids)
            if keep is not None:
                tops = None if delta.top_logprobs is None else delta.top_logprobs[:keep]
                delta = TokenDelta(delta.ids[:keep], delta.logprobs[:keep], tops)
                if on_stop is not None:
                    on_stop()
            on_delta(delta)
    raise UpstreamInvalid("the engine stream ended without a result")


def counted(on_delta: Callable[[TokenDelta], None], split: ReceivedSplit | None) -> Callable[[TokenDelta], None]:
    """`on_delta`, counting the tokens received so far (the segment's version split)."""
    if split is None:
        return on_delta

    def seen(delta: TokenDelta) -> None:
        split.received += len(delta.ids)
        on_delta(delta)

    return seen


async def stop_strings(stops: StopStrings | None, kept: list[Any], result: GenerateResult,
                       spans: SegmentSpans) -> tuple[GenerateResult, SegmentSpans, int | None]:
    """The segment ended where the engine would have on a stop string it could not match
    (control/stops.py): after an abort, or in a resubmission. Returns the segment, its
    spans and, when cut, how many ids the engine sampled (its routed rows cover them).
    Decoded off the event loop."""
    n = len(result.output_ids)
    if stops is None or not n or (result.finish_reason != "abort" and not kept):
        return result, spans, None
    hit = await asyncio.to_thread(stops.in_segment, kept, list(result.output_ids))
    if hit is None or (hit[0] == n and result.finish_reason == "stop" and result.matched_stop == hit[1]):
        return result, spans, None
    cut, cut_spans = cut_at(result, spans, *hit)
    return cut, cut_spans, n
