"""One turn through any number of pauses: abort -> accumulate -> resubmit.

`generate_resilient` runs a turn as segments, each waiting at the control plane's
gate, sent as `prompt + partial` with the remaining budget, and registered with the
plane while at the engine (`ControlPlane.track_flight`); it returns one
`ResilientResult` (a `GenerateResult` plus weight spans and per-turn counters) that
is indistinguishable from an uninterrupted generation (assemble.py builds it).
It talks to the plane only through its public interface: `wait_open`, `blocked`, `epoch`,
`weight_version`, `cache_salt`, `max_empty_aborts`, `metrics`, `record_version_mismatch`,
`track_flight`, `record_abort`, `record_resubmit`, `abort_engine_request`.

The turn is a state machine (`Phase`): one method per phase reads and writes the named fields
of `TurnState` (what changes across segments) and `Segment` (the one being settled), and
returns the next phase:

    WAIT_GATE -> ACQUIRE -> DISPATCH -> SETTLE -> ACCUMULATE -> RESUBMIT -> WAIT_GATE
    ACQUIRE -> WAIT_GATE   the gate closed again while the segment queued
    ACQUIRE -> DONE        the staleness bound: the turn ends at the update
    SETTLE -> DONE         the segment finished (stop, length): the turn is assembled
    ACCUMULATE -> DONE     the budget ran out across aborts

Prefill admission and the engine slot are held from ACQUIRE until the engine answers (DISPATCH),
never while waiting at the gate.

Weight versions per token (versions.py): the trainer's version at each segment's
dispatch, refined by what the engine reports where it is one the trainer went through
(vLLM 0.32's per-token spans split a `keep` segment exactly where the update landed;
SGLang's one version per request stamps it whole with the version at its end). An
engine's unset or stale version never overrides the trainer's.
A turn with `request.max_weight_lag` ends at the update that would take its tokens
past that many versions instead of resubmitting (lag.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from session_server.engines.base import (
    EngineAdapter,
    GenerateRequest,
    GenerateResult,
    TokenDelta,
    segment_sampling,
)
from session_server.engines.base import streaming as streaming_of
from session_server.errors import EngineAborted, ReplyWorkerLost, UpstreamInvalid, UpstreamTimeout
from session_server.tracing import TurnTrace
from trajectory.errors import ValidationError
from trajectory.validate import Expectations

from .assemble import Acc, Counts, ResilientResult, assemble
from .lag import LagBound, SegmentWatch
from .peek import Peek, peek_stream, peeked, resend
from .plane import ControlPlane
from .segment import (
    abort_on_stop_is_stop,
    check_partial,
    counted,
    enter_by,
    extend,
    new_request_id,
    salted,
    stop_strings,
    streamed,
)
from .stops import Decode, StopStrings, StreamStops
from .versions import ReceivedSplit, SegmentSpans, received_split, reports_per_token, segment_spans

__all__ = ["AbortEvent", "Peek", "Phase", "Segment", "TurnState", "generate_resilient", "new_request_id"]


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


class Phase(enum.Enum):
    """Where a turn is (the transitions are in the module docstring)."""

    WAIT_GATE = "wait_gate"  # wait for the plane's gate to open
    ACQUIRE = "acquire"  # prefill admission, an engine slot, the gate again, the staleness bound
    DISPATCH = "dispatch"  # one segment at the engine: prompt + partial, the budget left
    SETTLE = "settle"  # stamp its versions, cut it at a stop; a finished segment ends the turn
    ACCUMULATE = "accumulate"  # an aborted segment: keep (or drop) its partial
    RESUBMIT = "resubmit"  # count the resubmission, back to the gate
    DONE = "done"  # `TurnState.result` holds the turn


@dataclass
class Segment:
    """One dispatch of the turn and the engine's answer, as SETTLE and ACCUMULATE see it."""

    rid: str
    input_len: int  # prompt + the partial kept before it
    epoch: int  # the plane's pause epoch at dispatch: a later one explains an abort
    dispatch_version: int | None
    result: GenerateResult
    watch: SegmentWatch  # the versions it may have sampled with; `cut` at the staleness bound
    split: ReceivedSplit | None  # a streamed segment's tokens against the updates
    spans: SegmentSpans = field(default_factory=list)  # its ids stamped with versions
    sampled: int | None = None  # ids the engine sampled when the segment was cut at a stop string


@dataclass
class TurnState:
    """What changes while a turn runs, read and written by the phases by name."""

    remaining: int  # the budget of the next segment
    last_version: Any  # the version the kept tokens end with: the next partial's lower bound
    lag: LagBound  # the versions the kept tokens span, against `max_weight_lag`
    acc: Acc = field(default_factory=Acc)  # the kept partials' raw values and spans
    counts: Counts = field(default_factory=Counts)  # per-turn counters and segment request ids
    first: GenerateResult | None = None  # the first segment's answer (prompt counters, cache)
    unexplained_empty: int = 0  # consecutive aborts that kept nothing and no pause explains
    segment: Segment | None = None  # the one being settled
    result: ResilientResult | None = None  # the turn, once DONE


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


class _Turn:
    """One turn's state machine: its fixed inputs, `state`, and a method per `Phase`."""

    def __init__(self, adapter: EngineAdapter, request: GenerateRequest, control: ControlPlane, *,
                 expect: Expectations | None, on_abort: Callable[[AbortEvent], None] | None, deadline: float,
                 admit: Callable[[int | None], contextlib.AbstractAsyncContextManager[Any]] | None,
                 on_delta: Callable[[TokenDelta], None] | None, decode: Decode | None,
                 trace: TurnTrace | None = None, peek: Peek | None = None) -> None:
        self.adapter, self.request, self.control, self.trace = adapter, request, control, trace
        self.expect, self.on_abort, self.deadline, self.admit = expect, on_abort, deadline, admit
        self.on_delta = on_delta
        self.engine = str(adapter.base_url)
        self.state = TurnState(remaining=request.max_tokens, lag=LagBound(request.max_weight_lag),
                               last_version=None if expect is None else expect.last_weight_version)
        self.first_salt = control.cache_salt()
        self.constrained = request.sampling.constraint is not None
        streamer = streaming_of(adapter) if on_delta is not None and not self.constrained else None
        self.streaming = None if streamer is None else streamer.generate_stream
        self.peek = peek if peek is not None and on_delta is None and not self.constrained else None
        self.peek_stream = None if self.peek is None else peek_stream(adapter)  # incremental streams only
        self.stops = (StopStrings(request.sampling.stop, decode)
                      if decode and request.sampling.stop and not self.constrained else None)

    async def run(self) -> ResilientResult:
        """Step from WAIT_GATE to DONE; ACQUIRE and DISPATCH run under one exit stack."""
        phase = Phase.WAIT_GATE
        while phase is not Phase.DONE:
            if phase is Phase.ACQUIRE:
                # gate -> prefill admission -> engine slot -> gate again -> read version/salt:
                # a segment queued behind admission or the engine's cap cannot slip past a
                # pause that closed meanwhile, nor carry the weight version it saw before it.
                # Leaving this block (back to the gate, on to SETTLE) releases both.
                async with contextlib.AsyncExitStack() as held:
                    phase = await self.acquire(held)
                    if phase is Phase.DISPATCH:
                        phase = await self.dispatch()
            else:
                phase = await _STEPS[phase](self)
        assert self.state.result is not None
        return self.state.result

    async def wait_gate(self) -> Phase:
        """Nothing is held while paused: admission and slots stay free for turns that can run."""
        self.state.counts.paused_wait_s += await self.control.wait_open(self.request.lora, deadline=self.deadline)
        return Phase.ACQUIRE

    async def acquire(self, held: contextlib.AsyncExitStack) -> Phase:
        """Admission and a slot on `held`; a resubmission that would cross the staleness
        bound ends the turn here, before anything is sent."""
        st, request, control = self.state, self.request, self.control
        if self.admit is not None:
            salt_now = control.cache_salt()
            # a resubmission re-prefills only its partial, unless the salt changed
            guess = None if not st.counts.rids else (
                len(request.input_ids) + len(st.acc.ids) if salt_now != self.first_salt else len(st.acc.ids))
            await enter_by(held, self.admit(guess), self.deadline, f"prefill admission on {self.engine}")
        await enter_by(held, self.adapter.slot(), self.deadline, f"a generation slot on {self.engine}")
        if control.blocked(request.lora):
            return Phase.WAIT_GATE  # closed again while we queued: release everything, wait again
        if st.first is not None and st.lag.ends_before(len(st.acc.ids), control.weight_version):
            control.metrics.turns_ended_stale_total.inc()  # ended at the update (lag.py)
            ended = assemble(request, st.first, None, (), st.acc, st.counts, ended="abort")
            st.result = replace(ended, stale_bound=st.lag.flag(control.weight_version))
            return Phase.DONE
        return Phase.DISPATCH

    async def dispatch(self) -> Phase:
        """One segment at the engine, tracked by the plane (a pause aborts it there), sent its
        own seed in a seeded session (`derive_seed`: a resubmit is reproducible); a
        cancelled or rejected segment is aborted at the engine, since nobody reads it."""
        st, request, control, adapter = self.state, self.request, self.control, self.adapter
        seg_rid = request.request_id if not st.counts.rids else new_request_id()
        st.counts.rids.append(seg_rid)
        epoch, dispatch_version = control.epoch, control.weight_version
        seg_input = extend(request.input_ids, st.acc.ids)
        k = len(st.counts.rids) - 1
        sampling = segment_sampling(request, k)
        st.counts.seeds.append(sampling.seed)
        span = None if self.trace is None else self.trace.segment(k, seg_rid, self.engine)
        seg = replace(
            request, request_id=seg_rid, sampling=sampling, input_ids=seg_input, max_tokens=st.remaining,
            cache_salt=salted(request.cache_salt, control.cache_salt()),
            timeout_s=max(0.001, self.deadline - time.monotonic()), slot_held=True,
            routed_experts_start=st.acc.routed_start(request),  # rows already held (R3)
            # the engine continues the segment's trace (tracing.py)
            trace_headers=request.trace_headers if span is None else span.headers,
        )
        with (span if span is not None else contextlib.nullcontext(),
              control.track_flight(seg_rid, engine=self.engine, lora=request.lora),
              st.lag.watch(control, adapter, seg_rid, dispatch_version) as watch,
              received_split(control, self.streaming is not None) as split):
            try:
                if self.streaming is not None and self.on_delta is not None:
                    watch_stops = StreamStops(self.stops, st.acc.ids) if self.stops is not None and st.acc.ids else None
                    result = await streamed(self.streaming(seg), counted(self.on_delta, split), self.expect, seg_rid,
                                            watch_stops, partial(control.abort_engine_request, adapter, seg_rid))
                elif self.peek is not None and self.peek_stream is not None and (watcher := self.peek()) is not None:
                    result = await peeked(self.peek_stream(seg), watcher, seg_rid, self.peek, partial(
                        resend, adapter, control, st.lag, seg, watch), partial(control.abort_engine_request, adapter, seg_rid))
                else:
                    result = await adapter.generate(seg)
            except (asyncio.CancelledError, UpstreamTimeout, ReplyWorkerLost):
                control.abort_engine_request(adapter, seg_rid)  # nobody waits for it any more
                raise
            except UpstreamInvalid:
                if self.streaming is not None or self.peek_stream is not None:  # a rejected chunk
                    control.abort_engine_request(adapter, seg_rid)
                raise
            if span is not None:
                span.result(result.finish_reason, len(result.output_ids))
        st.segment = Segment(seg_rid, len(seg_input), epoch, dispatch_version, result, watch, split)
        return Phase.SETTLE

    async def settle(self) -> Phase:
        """The segment's versions and its end as the engine would have found it (a stop id
        under an abort, a stop string it could not match); finished, the turn is assembled."""
        st, seg = self.state, self._segment()
        if st.first is None:
            st.first = seg.result
        seg.spans = _stamped(self.control, self.engine, seg.result, seg.dispatch_version, cut=seg.watch.cut,
                             counts=st.counts, split=seg.split)
        seg.result = abort_on_stop_is_stop(seg.result, self.request, self.expect)
        seg.result, seg.spans, seg.sampled = await stop_strings(self.stops, st.acc.ids, seg.result, seg.spans)
        if seg.result.finish_reason == "abort":
            return Phase.ACCUMULATE
        st.acc.add_routed(self.request, seg.result, seg.input_len, seg.sampled)
        st.counts.mark(len(st.acc.ids), len(seg.result.output_ids), str(seg.result.finish_reason))
        st.result = assemble(self.request, st.first, seg.result, seg.spans, st.acc, st.counts)
        return Phase.DONE

    async def accumulate(self) -> Phase:
        """An aborted segment's partial, checked, kept for `prompt + partial` (dropped when
        constrained); aborts that keep nothing and no pause explains are bounded."""
        st, seg, request, control = self.state, self._segment(), self.request, self.control
        result, spans = seg.result, seg.spans
        # the partial is held to the rules of a whole result with the version it was stamped
        # with: a stale engine report is counted above, never a reason to fail the turn
        stamped = replace(result, weight_version=spans[-1][2] if spans else None)
        check_partial(stamped, seg.rid, seg.input_len, st.remaining, self.expect, st.last_version)
        n = len(result.output_ids)
        st.counts.aborts += 1
        control.record_abort(empty=n == 0)
        keeps = bool(n) and not self.constrained
        st.counts.mark(len(st.acc.ids), n if keeps else 0, "abort", dropped=0 if keeps else n)
        if keeps:
            st.acc.add_routed(request, result, seg.input_len)  # before add: its start is the rows held
            st.acc.add(result, spans)
            st.lag.keep(*(v for _, _, v in spans), *seg.watch.versions)
            st.last_version = spans[-1][2] if spans[-1][2] is not None else st.last_version
            st.remaining -= n
            st.unexplained_empty = 0
        else:
            if n:
                # engines restart a grammar at the first output token, so `prompt + partial`
                # under the same constraint would demand a whole new instance after the partial
                # (committing e.g. `{"a": {"a": 1}`). The partial is dropped and the turn is
                # regenerated from its own prompt with its whole budget; it was never shown.
                st.counts.dropped_tokens += n
            else:  # nothing to accumulate: retry as is
                st.counts.empty_aborts += 1
            if control.epoch == seg.epoch and not control.blocked(request.lora):
                # nothing kept and no pause explains the abort: bounded, so an engine that
                # keeps aborting cannot loop the turn until its deadline
                st.unexplained_empty += 1
                if st.unexplained_empty > control.max_empty_aborts:
                    raise EngineAborted(
                        f"{request.request_id}: {st.unexplained_empty} consecutive aborts without a "
                        f"kept token or a pause: {result.abort_message or 'no message'}",
                        engine=self.engine,
                    )
            elif n:
                st.unexplained_empty = 0
        if self.on_abort is not None:
            self.on_abort(AbortEvent(
                request_id=request.request_id, segment_request_id=seg.rid,
                segment=len(st.counts.rids) - 1, new_tokens=n, total_tokens=len(st.acc.ids),
                remaining=st.remaining, paused=control.blocked(request.lora),
            ))
        if st.remaining <= 0:  # the budget ran out across aborts: the turn ends at its length
            assert st.first is not None  # set by SETTLE
            st.result = assemble(request, st.first, None, (), st.acc, st.counts)
            return Phase.DONE
        return Phase.RESUBMIT

    async def resubmit(self) -> Phase:
        """Counted apart from aborts: an abort that ends the turn is not resubmitted."""
        self.state.counts.resubmits += 1
        self.control.record_resubmit()
        return Phase.WAIT_GATE

    def _segment(self) -> Segment:
        assert self.state.segment is not None  # set by DISPATCH
        return self.state.segment


# on the class: bound methods kept on a turn made each one a cycle, left to the cyclic GC
_STEPS: dict[Phase, Callable[[_Turn], Awaitable[Phase]]] = {Phase.WAIT_GATE: _Turn.wait_gate, Phase.SETTLE: _Turn.settle,
                                                            Phase.ACCUMULATE: _Turn.accumulate, Phase.RESUBMIT: _Turn.resubmit}


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
    trace: TurnTrace | None = None,
    peek: Peek | None = None,
) -> ResilientResult:
    """Generate one turn through any number of pauses: abort -> accumulate -> resubmit
    (the phases of `_Turn`, in the module docstring).

    Each segment waits at the gate (bounded by `deadline`, monotonic; default
    now + `request.timeout_s`), is sent as `prompt + partial` with the remaining
    budget under a new fixed-width request id (the first keeps
    `request.request_id`), and carries the current weight version's cache salt.
    `expect` (the whole turn's `Expectations`) makes each aborted segment pass the
    full validator before its values are kept; without it only shapes are checked.
    `admit(uncached_guess)` (prefill admission; None = the caller's own estimate, for the
    first segment) is held per segment, never while waiting at the gate; waiting for it
    or for the adapter's `slot()` past `deadline` is `UpstreamTimeout` (504).
    `on_delta` (a streamed turn) gets each `TokenDelta` as the engine streams
    it, when the adapter can stream and the turn is unconstrained (a constrained partial
    may be dropped on a pause, so it is never shown early); an aborted segment's deltas
    are its kept partial, so the resubmitted segment's deltas continue the same stream.
    `decode` (output ids -> text) lets the server match `request.sampling.stop` where the
    engine cannot: on an aborted step and across a resubmission's boundary (stops.py).
    `trace` (tracing on): a span per segment, its context sent to the engine.
    `peek` (a turn the client does not stream): asked per segment for a watcher's callback;
    given one, the segment is streamed to it alone where frames are deltas (peek.py: a failed
    stream is sent again unstreamed; no stop cut or version split: it commits as if unwatched).
    Engine errors propagate; `EngineAborted` after `max_empty_aborts` consecutive
    empty aborts that no pause explains; `PausedTooLong` when paused past the deadline.
    """
    if deadline is None:
        deadline = time.monotonic() + request.timeout_s
    return await _Turn(adapter, request, control, expect=expect, on_abort=on_abort, deadline=deadline,
                       admit=admit, on_delta=on_delta, decode=decode, trace=trace, peek=peek).run()
