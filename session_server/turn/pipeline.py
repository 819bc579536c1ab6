"""The pipeline of one chat turn: the one place that sequences the phases.

`TurnRunner._turn` reads top to bottom as the phases, each a short function with
typed inputs and outputs (frozen values), each timed under its own name
(`metrics.PHASES`):

    parse      the dialect's (offload, lock)  body -> ChatRequest (before the claim: see `run`)
    claim      run (here)                    the session, for this request only (queued while busy)
    prepare    prepare.py (lock, offload)    -> Prepared: append / rollback / fork
    render     prepare.py (offload)          -> Prompt: prompt ids (+ a template fork)
    route      engine_request.py, dispatch.py  -> EngineCall; a target chosen
    generate   dispatch.py                   admitted, generated through pauses -> Generated
    validate   commit.py (offload)           -> Checked
    commit     commit.py (lock, no await)    -> Committed
    respond    api/dialects/ (the API edge)  TurnOutput -> JSON body or SSE frames

A streamed request's live stream (`live.py`) is seen here only as a `TurnStream`: the
pipeline tells it when the request is parsed, when the turn begins, each engine delta
and the validated output before commit; it never imports the stream itself.

The claim is released in a `finally` on every path (errors, cancellation, client
disconnect), and only by the request that made it. Branch changes decided at
prepare (rollback, fork) are applied at commit, so a failed turn leaves the
session exactly as it was.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..context import ServerContext
from ..engines.base import TokenDelta
from ..errors import ClientGone, SessionBusy, SessionClosed
from ..journal_records import DISCARDED, encode
from ..sessions import Claim, Session, SessionState
from ..tracing import TurnTrace, request_attributes
from . import watch
from .chat_request import ChatRequest
from .commit import Checked, Committed, PendingTurn, commit, validate
from .dispatch import Generated, generate_turn
from .engine_request import EngineCall, engine_request
from .output import TurnOutput
from .prepare import Prepared, check_branch_cap, prepare, render_prompt

__all__ = ["ClientWatch", "TurnOutput", "TurnRunner", "TurnStream"]

ClientWatch = Callable[[], Awaitable[None]]
"""Returns when the request's client hung up (the turn is then cancelled)."""


class TurnStream(Protocol):
    """What the pipeline tells a request's live stream (`live.LiveTurn`), in this order:
    `parsed`, then `begin` once the engine request is built, `on_delta` per engine delta
    when `begin` said the turn streams, and `check` of the validated output before
    commit. A stream that the request did not ask for does nothing."""

    @property
    def request_id(self) -> str | None:
        """The engine request id a stream already announced (None: mint one)."""
        ...

    def parsed(self, req: ChatRequest) -> None:
        """The request is parsed, before its claim (a stream may begin its response early)."""
        ...

    def begin(self, req: ChatRequest, call: EngineCall, prep: Prepared) -> bool:
        """The turn starts: whether it streams (then `on_delta` gets the engine's deltas)."""
        ...

    def on_delta(self, delta: TokenDelta) -> None:
        """Tokens the engine sampled since its last delta."""
        ...

    def check(self, checked: Checked) -> Checked:
        """Before commit: what was streamed must agree with `checked` (else the turn
        fails, nothing committed); `checked` as the stream amends it."""
        ...


class _Timer:
    trace: TurnTrace | None = None

    def __init__(self, ctx: ServerContext) -> None:
        self._ctx = ctx
        self._t0 = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._ctx.metrics.observe_phase(phase, now - self._last)
        self._last = now

    def total(self) -> None:
        self.phases["total"] = time.perf_counter() - self._t0
        self._ctx.metrics.observe_phase("total", self.phases["total"])


class _TracedTimer(_Timer):
    """The timer of a traced turn: each lap is also the phase's span (tracing.py), cut at
    the same instants. A turn that is not traced gets the plain `_Timer`, so tracing off
    costs no check per phase."""

    def __init__(self, ctx: ServerContext, trace: TurnTrace) -> None:
        super().__init__(ctx)
        self.trace = trace

    def lap(self, phase: str) -> None:
        start = self._last
        super().lap(phase)
        assert self.trace is not None
        self.trace.lap(phase, start, self._last)


class TurnRunner:
    """Runs chat turns against the shared context; one instance per app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def run(
        self, session_id: str, body: bytes, *, parse: Callable[[bytes], ChatRequest],
        client_gone: ClientWatch | None = None, live: TurnStream | None = None,
        recorded: tuple[str, bytes, str | None] | None = None, trace: TurnTrace | None = None,
    ) -> tuple[ChatRequest, TurnOutput]:
        """Claim the session and run the turn as its own task (`parse` is the client
        dialect's: body -> the pipeline's `ChatRequest`), which ends early when

        - the client hangs up (`client_gone` returns): `ClientGone` (499, never sent);
        - the session is deleted (`SessionStore.close` cancels `session.turn`): 409.

        `live` streams the turn as it is sampled when the request asks for a stream
        (`TurnStream`; `live.py`). `recorded`: the replay log's name of the request
        (`RunFresh.identity`), journaled with the turn. `trace`: the turn's spans when
        tracing is on (the caller ends them: it also times the response).

        The body is parsed before the claim: a malformed request is a 400 at once rather
        than after the turns queued before it, and `live` learns from the parsed request
        whether it is a stream, so a stream that waits in the claim queue (or anywhere
        before its first frame) can begin its response and send keep-alives meanwhile
        (`TurnStream.parsed`). The parse runs under the session lock: a Responses body's
        `previous_response_id` reads the session's tree, which a commit of the turn in
        flight would otherwise change under it.

        Cancelling the work aborts its engine request (`generate_resilient`) and commits
        nothing (commit's one await is the journal's write of a turn already applied,
        which a cancel does not interrupt: stored, it stands), so the claim is free at
        once for a retry."""
        ctx = self.ctx
        timer = _Timer(ctx) if trace is None else _TracedTimer(ctx, trace)
        watcher: asyncio.Future[None] | None = None
        if client_gone is not None:
            watcher = asyncio.ensure_future(client_gone())
        try:
            req = await self._parse(session_id, body, parse)
            timer.lap("parse")
            if live is not None:
                live.parsed(req)
            session, claim = await self._claim(session_id, watcher)
        except BaseException:
            if watcher is not None:
                watcher.cancel()
            raise
        timer.lap("claim")
        ctx.metrics.turns_in_flight.inc()
        work = asyncio.create_task(self._turn(session, claim, req, len(body), timer, live, recorded),
                                   name=f"tito-turn-{session_id}")
        session.turn = work
        discarded = False

        def discard() -> None:  # once per turn, whichever way it ended without a commit
            nonlocal discarded
            committed = work.done() and not work.cancelled() and work.exception() is None
            if not discarded and not committed:
                discarded = True
                self._discarded(session)

        try:
            await asyncio.wait([t for t in (work, watcher) if t is not None], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away first
                try:
                    await self._cancel(work)
                finally:  # also when a cancellation of this request lands in the await
                    discard()
                if work.done() and not work.cancelled() and work.exception() is None:
                    return work.result()  # committed as it was cancelled (its journal write stood)
                raise ClientGone(f"client disconnected mid-turn on session {session.id}; nothing committed")
            if work.cancelled():  # only a DELETE cancels the work itself
                discard()
                raise SessionClosed(f"session {session.id} was deleted during the turn; nothing committed")
            if isinstance(work.exception(), SessionClosed):
                discard()
            return work.result()
        finally:
            if watcher is not None:
                watcher.cancel()
            try:
                if not work.done():  # this request itself was cancelled (e.g. shutdown, the client left)
                    try:
                        await self._cancel(work)
                    finally:
                        discard()
            finally:  # the claim goes back even when a second cancellation lands in `_cancel`
                if session.turn is work:
                    session.turn = None
                ctx.metrics.turns_in_flight.dec()
                ctx.store.release(session, claim)
                watch.ended(session, work.done() and not work.cancelled() and work.exception() is None)

    async def _parse(self, session_id: str, body: bytes, parse: Callable[[bytes], ChatRequest]) -> ChatRequest:
        """The dialect's parse, off the loop when the body is large, under the session lock."""
        session = self.ctx.store.get(session_id)
        async with session.lock:
            req: ChatRequest = await self.ctx.offload.run_sized(len(body), parse, body)
        return req

    async def _claim(self, session_id: str, watcher: asyncio.Future[None] | None) -> tuple[Session, Claim]:
        """The session's claim: at once when it is free, else after the turns queued
        before this one (`SessionStore.wait_claim`), waiting at most `busy_wait_s`.

        Why wait rather than 409: harnesses send side requests beside their main one
        (Claude Code's title request arrives with its first turn); a 409 only makes
        them retry with backoff. Queued, the side request is served next, on its own
        branch (prepare attaches it after the turn before it committed), and turns on
        a session still run and commit one at a time, in arrival order.
        The client leaving while queued is `ClientGone`; past the bound, 409."""
        store = self.ctx.store
        try:
            return store.claim(session_id)
        except SessionBusy:
            wait_s = self.ctx.settings.busy_wait_s
            if wait_s <= 0:
                raise
        session = store.get(session_id)
        fut = store.wait_claim(session)
        taken = False
        try:
            await asyncio.wait([t for t in (fut, watcher) if t is not None], timeout=wait_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if fut.done():
                claim = fut.result()  # SessionClosed when deleted meanwhile
                taken = True
                if session.state is not SessionState.ACTIVE:
                    # deleted between the hand-over and this task waking: no turn object
                    # existed for the DELETE to cancel, so the session's removal waits on us
                    store.release(session, claim)
                    raise SessionClosed(f"session {session_id} was deleted while this chat waited for the turn "
                                        "in flight")
                return session, claim
            if watcher is not None and watcher.done():
                raise ClientGone(f"client disconnected while waiting for the turn in flight on session {session_id}")
            raise SessionBusy(f"a chat was still in flight on session {session_id} after {wait_s:g}s of waiting")
        finally:
            if not taken:
                if not fut.done():
                    fut.cancel()  # release() skips it
                elif not fut.cancelled() and fut.exception() is None:
                    store.release(session, fut.result())  # handed over just as this request gave up

    @staticmethod
    async def _cancel(work: asyncio.Task[tuple[ChatRequest, TurnOutput]], wait_s: float = 1.0) -> None:
        """Cancel the turn's work and give its `finally`s (engine abort, routing stats) a
        bounded moment; the claim is released after this either way."""
        work.cancel()
        await asyncio.wait([work], timeout=wait_s)

    def _discarded(self, session: Session) -> None:
        """A turn that ended without a commit: counted in the session view and metrics."""
        session.turns_discarded += 1
        self.ctx.metrics.turns_total.labels(outcome="discarded").inc()
        journal = self.ctx.journal
        if journal is not None and session.id in self.ctx.store.all():  # a counter of the session view
            journal.put(session.id, DISCARDED, encode({"turns_discarded": session.turns_discarded}))

    async def _turn(
        self, session: Session, claim: Claim, req: ChatRequest, body_len: int, timer: _Timer,
        live: TurnStream | None = None, recorded: tuple[str, bytes, str | None] | None = None,
    ) -> tuple[ChatRequest, TurnOutput]:
        """The phases in order, each lapped under its own name (parse and claim were lapped
        by `run`; `route` is lapped inside `generate_turn`, when the first target is chosen)."""
        ctx = self.ctx
        prep = await self._prepare(session, req, body_len)
        timer.lap("prepare")
        prompt = await render_prompt(ctx, session, prep)
        timer.lap("render")
        check_branch_cap(ctx, session, prompt.prep)
        # a stream that began before its turn has announced this id (Responses' response.created)
        call = engine_request(ctx, session, req, prompt.prep, prompt.prompt_ids,
                              request_id=live.request_id if live is not None else None)
        streams = live is not None and live.begin(req, call, prompt.prep)
        on_delta = watch.observed(session, live.on_delta if live is not None and streams else None, ctx.tokenizer)
        # the watchers' view of it
        peek = None if on_delta is not None else watch.Peeker(session, call.expect, ctx.tokenizer)
        watch.begun(session, prompt.prep.branch_id, len(prompt.prep.context_ids) + len(prompt.prompt_ids), streams)
        if timer.trace is not None:
            timer.trace.request(_request_attributes(req, call))
        gen = await generate_turn(ctx, session, req, call, on_placed=lambda: timer.lap("route"), on_delta=on_delta,
                                  trace=timer.trace, peek=peek)
        timer.lap("generate")
        checked = await validate(ctx, gen.result, call.expect, req, prompt.prep, call)
        if live is not None and streams:
            checked = live.check(checked)  # a stream that disagrees commits nothing
        timer.lap("validate")
        done = await commit(ctx, session, claim, PendingTurn(prompt.prep, prompt.prompt_ids, call, gen.result,
                                                              checked, gen.target_id, recorded, req._lineage))
        timer.lap("commit")
        timer.total()
        ctx.metrics.turns_total.labels(outcome="committed").inc()
        return req, _output(call, gen, checked, done, dict(timer.phases))

    async def prompt_tokens(self, session_id: str, body: bytes, *, parse: Callable[[bytes], ChatRequest]) -> int:
        """How many prompt tokens this request would send to the engine now (Anthropic
        `count_tokens`): parse, prepare and render as a turn would, then stop. No claim
        (a turn in flight is not disturbed: the count is against the committed history),
        nothing generated, committed or noted in the session's diagnostics."""
        ctx = self.ctx
        session = ctx.store.get(session_id)
        ctx.store.touch(session)
        req: ChatRequest = await ctx.offload.run_sized(len(body), parse, body)
        prep = await self._prepare(session, req, len(body))
        prompt = await render_prompt(ctx, session, prep, note=False)
        return len(prompt.prep.context_ids) + len(prompt.prompt_ids)

    async def _prepare(self, session: Session, req: ChatRequest, body_len: int) -> Prepared:
        """`prepare` under the session lock. O(history): the agent resends every message,
        so it runs on the offload threads (inline when the body is small); the claim keeps
        other turns out meanwhile."""
        async with session.lock:
            return await self.ctx.offload.run_sized(body_len, prepare, self.ctx, session, req)


def _request_attributes(req: ChatRequest, call: EngineCall) -> dict[str, object]:
    """A traced turn's `gen_ai.request.*`: the model the client named, the sampling sent."""
    g = call.greq
    s = g.sampling
    return request_attributes(req.model, max_tokens=g.max_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, seed=s.seed, stop=s.stop, presence_penalty=s.presence_penalty,
                              frequency_penalty=s.frequency_penalty)


def _output(call: EngineCall, gen: Generated, checked: Checked, done: Committed, timings_s: dict[str, float]) -> TurnOutput:
    """What the respond phase (the API dialect) needs of a committed turn."""
    valid = checked.valid
    return TurnOutput(
        request_id=call.greq.request_id,
        message=checked.message,
        finish_reason="stop" if checked.finish == "repetition" else checked.finish,  # OpenAI knows no repetition
        prompt_tokens=len(call.greq.input_ids),
        completion_tokens=len(valid.ids),
        cached_tokens=valid.cached_tokens,
        sampled_ids=valid.ids.tolist(),
        logprobs=valid.logprobs.tolist(),
        top_logprobs=gen.result.top_logprobs,
        turn_index=done.turn_index,
        branch_id=done.branch_id,
        timings_s=timings_s,
        matched_stop=gen.result.matched_stop,
    )
