"""One turn through any number of pauses: abort -> accumulate -> resubmit (DESIGN.md s9).

`generate_resilient` runs a turn as segments, each waiting at the control plane's
gate, sent as `prompt + partial` with the remaining budget, and registered with the
plane while at the engine (`ControlPlane.track_flight`); it returns one
`ResilientResult` (a `GenerateResult` plus weight spans and per-turn counters) that
is indistinguishable from an uninterrupted generation (assemble.py builds it).
It talks to the plane only through its public interface: `wait_open`, `blocked`,
`epoch`, `weight_version`, `cache_salt`, `record_version_mismatch`,
`track_flight`, `record_abort`, `record_resubmit`, `abort_engine_request`.

Weight versions per token (versions.py): the trainer's version at each segment's
dispatch, refined by what the engine reports where it is one the trainer went through
(vLLM 0.32's per-token spans split a `keep` segment exactly where the update landed;
SGLang's one version per request stamps it whole with the version at its end). An
engine's unset or stale version never overrides the trainer's.
A turn with `request.max_weight_lag` ends at the update that would take its tokens
past that many versions instead of resubmitting (lag.py, issue 13.5).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from session_server.engines.base import (
    EngineAdapter,
    GenerateRequest,
    GenerateResult,
    StreamItem,
    TokenDelta,
    TokenIds,
)
from session_server.engines.base import streaming as streaming_of
from session_server.errors import EngineAborted, UpstreamInvalid, UpstreamTimeout
from trajectory.errors import ValidationError
from trajectory.validate import Expectations, is_int, validate_chunk, validate_generation

from .assemble import Acc, Counts, ResilientResult, assemble
from .lag import LagBound
from .plane import ControlPlane
from .stops import Decode, StopStrings, StreamStops, cut_at
from .versions import ReceivedSplit, SegmentSpans, received_split, reports_per_token, segment_spans

__all__ = ["AbortEvent", "generate_resilient", "new_request_id"]

_RID_PREFIX = secrets.token_hex(8)  # per process: ids of two server processes never collide
_rid_counter = itertools.count()


def new_request_id() -> str:
    """A fixed-width (32 hex chars) id: SGLang aborts by rid *prefix*, so ids must be
    prefix-free; equal width makes them so. Random per process, then a counter
    (no syscall per request)."""
    return f"{_RID_PREFIX}{next(_rid_counter):016x}"



@dataclass(frozen=True)
class AbortEvent:
    """Passed to `on_abort` after each aborted segment (e.g. to add a session note)."""

    request_id: str  # the turn's (original) id
    segment_request_id: str
    segment: int
    new_tokens: int
    total_tokens: int
    remaining: int
    paused: bool  # the gate was closed when the abort arrived



async def _enter_by(stack: contextlib.AsyncExitStack, cm: contextlib.AbstractAsyncContextManager[Any],
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


def _extend(prompt: TokenIds, partial: list[Any]) -> TokenIds:
    """prompt + partial, keeping a numpy prompt numpy (contexts reach 100K+ ids; no list copy)."""
    if not partial:
        return prompt
    if isinstance(prompt, np.ndarray):
        return np.concatenate([prompt, np.asarray(partial, dtype=prompt.dtype)])
    return [*prompt, *partial]


def _salted(request_salt: str | None, control_salt: str | None) -> str | None:
    if control_salt is None:
        return request_salt
    return control_salt if request_salt is None else f"{request_salt}:{control_salt}"


def _abort_on_stop_is_stop(result: GenerateResult, request: GenerateRequest,
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


def _stamped(control: ControlPlane, engine: str, result: GenerateResult, dispatch_version: int | None,
             *, cut: bool, counts: Counts, split: ReceivedSplit | None = None) -> SegmentSpans:
    """The segment's tokens stamped with versions (control/versions.py): the engine's
    per-token spans or its one version where it reports one the trainer went through,
    else the dispatch version. Without per-token spans a streamed segment is split where
    the server saw an update take effect (`split`), which it knows better than SGLang's one
    version, read at the end. A segment cut at an update (lag.py) without per-token
    spans predates the update: its dispatch version (SGLang's one version, read at the
    end, would be the new one). Malformed spans or versions are bad output (502)."""
    n = len(result.output_ids)
    reported, reported_spans = result.weight_version, result.version_spans
    if cut and result.finish_reason == "abort" and not reported_spans:
        reported = None
    try:
        spans, mismatches = segment_spans(n, reported, reported_spans, dispatch_version, control.weight_version)
    except ValidationError as exc:
        raise UpstreamInvalid(f"{result.request_id}: engine output rejected: {exc}", engine=engine) from exc
    if mismatches:  # one per segment, as the metric counts
        counts.mismatches += 1
        control.record_version_mismatch(engine, reported if not reported_spans else list(reported_spans))
    known = None if split is None or reports_per_token(reported_spans) or cut else split.spans(n, dispatch_version)
    return spans if known is None else known


def _check_partial(result: GenerateResult, seg_rid: str, prompt_len: int, budget: int,
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


async def _streamed(items: AsyncIterator[StreamItem], on_delta: Callable[[TokenDelta], None],
                    expect: Expectations | None, seg_rid: str,
                    stops: StreamStops | None = None, on_stop: Callable[[], None] | None = None) -> GenerateResult:
    """One streamed segment: its checked deltas to `on_delta`, its final result returned.
    With `stops` (a resubmitted segment of a turn with stop strings) nothing past a stop
    string completed across the boundary is shown, and `on_stop` aborts the engine request
    there (its final answer is then cut, `_stop_strings`). The engine stream is closed on
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


def _counted(on_delta: Callable[[TokenDelta], None], split: ReceivedSplit | None) -> Callable[[TokenDelta], None]:
    """`on_delta`, counting the tokens received so far (the segment's version split)."""
    if split is None:
        return on_delta

    def seen(delta: TokenDelta) -> None:
        split.received += len(delta.ids)
        on_delta(delta)

    return seen


async def _stop_strings(stops: StopStrings | None, kept: list[Any], result: GenerateResult,
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


async def generate_resilient(
    adapter: EngineAdapter,
    request: GenerateRequest,
    control: ControlPlane,
    *,
    expect: Expectations | None = None,
    on_abort: Callable[[AbortEvent], None] | None = None,
    deadline: float | None = None,
    admit: Callable[[int | None], contextlib.AbstractAsyncContextManager[Any]] | None = None,
    on_delta: Callable[[TokenDelta], None] | None = None,
    decode: Decode | None = None,
) -> ResilientResult:
    """Generate one turn through any number of pauses: abort -> accumulate -> resubmit.

    Each segment waits at the gate (bounded by `deadline`, monotonic; default
    now + `request.timeout_s`), is sent as `prompt + partial` with the remaining
    budget under a new fixed-width request id (the first keeps
    `request.request_id`), and carries the current weight version's cache salt.
    `expect` (the whole turn's `Expectations`) makes each aborted segment pass the
    full validator before its values are kept; without it only shapes are checked.
    `admit(uncached_guess)` (prefill admission; None = the caller's own estimate, for the
    first segment) is held per segment, never while waiting at the gate; waiting for it
    or for the adapter's `slot()` past `deadline` is `UpstreamTimeout` (504).
    `on_delta` (a streamed turn, issue 12.2) gets each `TokenDelta` as the engine streams
    it, when the adapter can stream and the turn is unconstrained (a constrained partial
    may be dropped on a pause, so it is never shown early); an aborted segment's deltas
    are its kept partial, so the resubmitted segment's deltas continue the same stream.
    `decode` (output ids -> text) lets the server match `request.sampling.stop` where the
    engine cannot: on an aborted step and across a resubmission's boundary (stops.py).
    Engine errors propagate; `EngineAborted` after `max_empty_aborts` consecutive
    empty aborts that no pause explains; `PausedTooLong` when paused past the deadline.
    """
    if deadline is None:
        deadline = time.monotonic() + request.timeout_s
    prompt = request.input_ids
    lora = request.lora
    engine = str(adapter.base_url)
    acc, counts = Acc(), Counts()
    first: GenerateResult | None = None
    last_version = None if expect is None else expect.last_weight_version
    remaining = request.max_tokens
    unexplained_empty = 0
    lag = LagBound(request.max_weight_lag)

    first_salt = control.cache_salt()
    constrained = request.sampling.constraint is not None
    streamer = streaming_of(adapter) if on_delta is not None and not constrained else None
    streaming = None if streamer is None else streamer.generate_stream
    stops = StopStrings(request.sampling.stop, decode) if decode and request.sampling.stop and not constrained else None
    while True:
        async with contextlib.AsyncExitStack() as held:
            # gate -> prefill admission -> engine slot -> gate again -> read version/salt:
            # a segment queued behind admission or the engine's cap cannot slip past a
            # pause that closed meanwhile, nor carry the weight version it saw before it
            counts.paused_wait_s += await control.wait_open(lora, deadline=deadline)
            if admit is not None:
                salt_now = control.cache_salt()
                # a resubmission re-prefills only its partial, unless the salt changed
                guess = None if not counts.rids else (
                    len(prompt) + len(acc.ids) if salt_now != first_salt else len(acc.ids))
                await _enter_by(held, admit(guess), deadline, f"prefill admission on {engine}")
            await _enter_by(held, adapter.slot(), deadline, f"a generation slot on {engine}")
            if control.blocked(lora):
                continue  # closed again while we queued: release everything, wait again
            if first is not None and lag.ends_before(len(acc.ids), control.weight_version):
                control.metrics.turns_ended_stale_total.inc()  # ended at the update (lag.py)
                ended = assemble(request, first, None, (), acc, counts, ended="abort")
                return replace(ended, stale_bound=lag.flag(control.weight_version))
            seg_rid = request.request_id if not counts.rids else new_request_id()
            counts.rids.append(seg_rid)
            epoch, dispatch_version = control.epoch, control.weight_version
            seg_input = _extend(prompt, acc.ids)
            seg = replace(
                request,
                request_id=seg_rid,
                input_ids=seg_input,
                max_tokens=remaining,
                cache_salt=_salted(request.cache_salt, control.cache_salt()),
                timeout_s=max(0.001, deadline - time.monotonic()),
                slot_held=True,
                routed_experts_start=acc.routed_start(request),  # rows already held (R3)
            )
            with (control.track_flight(seg_rid, engine=engine, lora=lora),
                  lag.watch(control, adapter, seg_rid, dispatch_version) as watch,
                  received_split(control, streaming is not None) as split):
                try:
                    if streaming is not None and on_delta is not None:
                        watch_stops = StreamStops(stops, acc.ids) if stops is not None and acc.ids else None
                        result = await _streamed(streaming(seg), _counted(on_delta, split), expect, seg_rid,
                                                 watch_stops, partial(control.abort_engine_request, adapter, seg_rid))
                    else:
                        result = await adapter.generate(seg)
                except (asyncio.CancelledError, UpstreamTimeout):
                    control.abort_engine_request(adapter, seg_rid)  # nobody waits for it any more
                    raise
                except UpstreamInvalid:
                    if streaming is not None:  # a rejected chunk: nobody reads the rest
                        control.abort_engine_request(adapter, seg_rid)
                    raise
        if first is None:
            first = result
        spans = _stamped(control, engine, result, dispatch_version, cut=watch.cut, counts=counts, split=split)
        result = _abort_on_stop_is_stop(result, request, expect)
        result, spans, sampled = await _stop_strings(stops, acc.ids, result, spans)
        if result.finish_reason != "abort":
            acc.add_routed(request, result, len(seg_input), sampled)
            return assemble(request, first, result, spans, acc, counts)

        # the partial is held to the rules of a whole result with the version it was stamped
        # with: a stale engine report is counted above, never a reason to fail the turn
        stamped = replace(result, weight_version=spans[-1][2] if spans else None)
        _check_partial(stamped, seg_rid, len(seg_input), remaining, expect, last_version)
        n = len(result.output_ids)
        counts.aborts += 1
        control.record_abort(empty=n == 0)
        if n and not constrained:
            acc.add_routed(request, result, len(seg_input))  # before add: its start is the rows held
            acc.add(result, spans)
            lag.keep(*(v for _, _, v in spans), *watch.versions)
            last_version = spans[-1][2] if spans[-1][2] is not None else last_version
            remaining -= n
            unexplained_empty = 0
        else:
            if n:
                # engines restart a grammar at the first output token, so `prompt + partial`
                # under the same constraint would demand a whole new instance after the partial
                # (committing e.g. `{"a": {"a": 1}`). The partial is dropped and the turn is
                # regenerated from its own prompt with its whole budget; it was never shown.
                counts.dropped_tokens += n
            else:  # nothing to accumulate: retry as is
                counts.empty_aborts += 1
            if control.epoch == epoch and not control.blocked(lora):
                # nothing kept and no pause explains the abort: bounded, so an engine that
                # keeps aborting cannot loop the turn until its deadline
                unexplained_empty += 1
                if unexplained_empty > control.max_empty_aborts:
                    raise EngineAborted(
                        f"{request.request_id}: {unexplained_empty} consecutive aborts without a "
                        f"kept token or a pause: {result.abort_message or 'no message'}",
                        engine=engine,
                    )
            elif n:
                unexplained_empty = 0
        if on_abort is not None:
            on_abort(AbortEvent(
                request_id=request.request_id, segment_request_id=seg_rid,
                segment=len(counts.rids) - 1, new_tokens=n, total_tokens=len(acc.ids),
                remaining=remaining, paused=control.blocked(lora),
            ))
        if remaining <= 0:  # the budget ran out across aborts: the turn ends at its length
            return assemble(request, first, None, (), acc, counts)
        counts.resubmits += 1
        control.record_resubmit()
