"""The one entry point of a turn request: `TurnEndpoint.handle`.

A turn route (chat completions, Messages, Responses) hands its HTTP request here and
returns what comes back. In order:

1. the session (404 before any body is read) and the body (413 past the limit);
2. the replay log's decision for the request (`turn/replay.py`): the same error as
   its original's, the original's stored bytes, the original's live stream to follow,
   or run the turn;
3. a fresh turn runs as its own task through the pipeline (`turn/pipeline.py`), its
   live stream (`turn/live.py`) fed by the pipeline when the request asks for one;
4. the response: a streamed turn answers once it starts, or once it has waited
   `keepalive_s` without starting (queued for its session), then sends keep-alives;
   anything before that (and a turn that is not streamed) answers as one response,
   errors as HTTP errors.

The endpoint lives at the API edge (it reads HTTP and speaks the client's dialect);
the turn's modules below it know nothing of HTTP, the dialects or this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from trajectory.lineage import Lineage

from ..context import ServerContext, log
from ..errors import CommittedUnanswered, JournalUnavailable
from ..journal import durable
from ..journal_records import RESPONSE, encode
from ..sessions import Session
from ..tracing import TurnTrace
from ..turn.chat_request import ChatRequest
from ..turn.live import LiveTurn
from ..turn.output import Rendered, TurnOutput, committed_output
from ..turn.pipeline import ClientWatch, TurnRunner
from ..turn.replay import Follow, Refuse, Replay, ReplayLog, Rerender, RunFresh, identify
from .dialects import Dialect, SessionBound, as_response, render
from .edge import read_body
from .lineage import attach, from_headers

__all__ = ["TurnEndpoint"]

SSE = "text/event-stream"
_UNKNOWN: Any = object()

Parse = Callable[[bytes], ChatRequest]
"""A dialect's parse: request body -> the pipeline's `ChatRequest`."""


def _client_gone(request: Request) -> ClientWatch:
    """Returns when the client hangs up (ASGI `http.disconnect`).

    Only for after the body was read: then the server's `receive` has nothing left
    to deliver but the disconnect, and waits for it without polling."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


async def _journal_kept(ctx: ServerContext, sid: str, kept: tuple[str, Any]) -> None:
    """What a dialect kept in the session (a Responses object), journaled before the
    response that names it is sent (a write that fails only costs the later lookup)."""
    if ctx.journal is None:
        return
    rid, value = kept
    body = encode({"rid": rid, "stored": msgspec.msgpack.encode(value)})
    try:
        await durable(ctx.journal.append(sid, RESPONSE, body))
    except JournalUnavailable:
        log.warning("session %s: stored response %s not journaled", sid, rid)


class TurnEndpoint:
    """The turn routes' one entry point; one per app, built at its start."""

    def __init__(self, ctx: ServerContext) -> None:
        settings = ctx.settings
        self.ctx = ctx
        self.runner = TurnRunner(ctx)
        self.replays = ReplayLog(ctx.metrics, per_session=settings.replay_per_session,
                                 max_bytes=settings.replay_store_bytes, grace_s=settings.replay_grace_s)
        ctx.store.on_remove.append(lambda s: self.replays.forget(s.id))  # a session's records go with it
        self._bound: dict[str, SessionBound | None] = {}

    async def handle(self, session_id: str, request: Request, dialect: Dialect) -> Response:
        """One turn of `dialect` on the session: read the body, answer a replayed request
        from its original, else run the turn and respond or stream it."""
        ctx = self.ctx
        session = ctx.store.get(session_id)  # 404 before reading a body for an unknown session
        lineage = from_headers(request.headers)  # a bad x-tito-* (or harness) header: 400 before any work
        if ctx.journal is not None:
            ctx.journal.check_writable()  # a full disk: refused before an engine works on it
        body = await read_body(request, ctx.settings.max_body_bytes)
        # a retry replays only its own attempt: never a turn the client has since built on
        ident = await identify(ctx.offload, session_id, dialect.name, request.headers, body,
                               built_on=session.built_on)
        live = LiveTurn(ctx, dialect)
        decision = await self.replays.decide(ident, live)
        if isinstance(decision, Refuse):
            raise decision.error
        if isinstance(decision, Replay):
            return as_response(decision.rendered)
        if isinstance(decision, Rerender):  # its turn was committed before a restart: answer from it
            rendered = await self._rerender(session, body, dialect, decision)
            self.replays.answered(session_id, decision, rendered)
            return as_response(rendered)
        if isinstance(decision, Follow):  # a replay of a turn streaming now: follow it live
            waiter = asyncio.ensure_future(self.replays.followed(decision))
            return StreamingResponse(decision.live.follow(waiter), media_type=SSE)
        return await self._fresh(decision, session, body, request, dialect, live, lineage)

    async def _rerender(self, session: Session, body: bytes, dialect: Dialect, again: Rerender) -> Rendered:
        """The response of a turn committed before a restart, rendered from the turn as the
        journal brought it back (the request's own body says how: JSON or a stream).
        Top logprobs are not stored with a turn: a retry that asked for them gets none."""
        ctx = self.ctx
        bound = dialect if isinstance(dialect, SessionBound) else None
        parse: Parse = bound.parser(session, ctx.tokenizer) if bound is not None else dialect.parse
        req = await ctx.offload.run_sized(len(body), parse, body)
        # its tokens are read from the tree: O(context) for a forked line, so off the loop (under
        # the session lock, as every reader of a tree that a commit may change)
        async with session.lock:
            out = await ctx.offload.run(committed_output, session, again.turn, again.matched_stop)
        # what the dialect keeps of a turn (a Responses object, for `previous_response_id`)
        # may have died with the process: kept again, the answer's id names something
        if bound is not None and (kept := bound.remember(session, req, out, ctx.tokenizer)) is not None:
            await _journal_kept(ctx, session.id, kept)
        rendered = await render(ctx, dialect, req, out)
        return dataclasses.replace(rendered, turn=again.turn)

    async def count_tokens(self, session_id: str, request: Request, parse: Parse) -> Response:
        """How many prompt tokens the request would send now (Anthropic `count_tokens`)."""
        ctx = self.ctx
        ctx.store.get(session_id)
        body = await read_body(request, ctx.settings.max_body_bytes)
        n = await self.runner.prompt_tokens(session_id, body, parse=parse)
        return Response(content=orjson.dumps({"input_tokens": n}), media_type="application/json")

    async def _fresh(self, fresh: RunFresh, session: Session, body: bytes, request: Request, dialect: Dialect,
                     live: LiveTurn, lineage: Lineage | None) -> Response:
        """Run the turn as its own task; answer when it ends, or stream once it opens."""
        watch = fresh.held(_client_gone(request))
        trace = None if self.ctx.tracing is None else self.ctx.tracing.turn(request.headers, session.id, dialect.name)
        task = asyncio.ensure_future(fresh.keep(self._turn(session, body, dialect, live, watch, fresh.identity, trace,
                                                           lineage)))
        task.add_done_callback(live.on_done)
        task.add_done_callback(fresh.settle)
        opened = asyncio.ensure_future(live.opened.wait())
        try:
            await asyncio.wait([task, opened], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            opened.cancel()
        if not live.opened.is_set():
            return as_response(await task)
        return StreamingResponse(live.stream(task, held=fresh.recorded), media_type=SSE)

    async def _turn(self, session: Session, body: bytes, dialect: Dialect, live: LiveTurn,
                    watch: ClientWatch, recorded: tuple[str, bytes, str | None] | None = None,
                    trace: TurnTrace | None = None, lineage: Lineage | None = None) -> Rendered:
        """The turn through the pipeline, then its response bytes; a response that fails
        after the commit is `CommittedUnanswered` (never retried into a second turn).
        `trace` (tracing on): the turn's spans, ended here once the response is built."""
        try:
            rendered, out = await self._respond(session, body, dialect, live, watch, recorded, trace, lineage)
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            raise
        if trace is not None:
            trace.finish(response_id=out.request_id, finish_reason=out.finish_reason,
                         input_tokens=out.prompt_tokens, output_tokens=out.completion_tokens,
                         cached_tokens=out.cached_tokens, turn_index=out.turn_index, branch_id=out.branch_id)
        return rendered

    async def _respond(self, session: Session, body: bytes, dialect: Dialect, live: LiveTurn, watch: ClientWatch,
                       recorded: tuple[str, bytes, str | None] | None,
                       trace: TurnTrace | None, lineage: Lineage | None) -> tuple[Rendered, TurnOutput]:
        ctx, sid = self.ctx, session.id
        bound = self._bound.get(dialect.name, _UNKNOWN)
        if bound is _UNKNOWN:  # a Protocol isinstance walks its members: once per dialect
            bound = self._bound[dialect.name] = dialect if isinstance(dialect, SessionBound) else None
        parse_body: Parse = bound.parser(session, ctx.tokenizer) if bound is not None else dialect.parse

        def parse(b: bytes) -> ChatRequest:  # the turn's lineage: the headers', else the body's fields
            return attach(parse_body(b), lineage)

        req, out = await self.runner.run(sid, body, parse=parse, client_gone=watch, live=live, recorded=recorded,
                                         trace=trace)
        # committed: from here on nothing may turn into a retry that samples the turn again
        try:
            if bound is not None and (kept := bound.remember(session, req, out, ctx.tokenizer)) is not None:
                await _journal_kept(ctx, sid, kept)
            rendered = live.finish(out) if live.active else await render(ctx, dialect, req, out)
            return dataclasses.replace(rendered, turn=(out.branch_id, out.turn_index)), out
        except Exception as exc:
            log.exception("session %s: turn %d committed, its response failed", sid, out.turn_index)
            failed = CommittedUnanswered(
                f"turn {out.turn_index} of session {sid} was committed, but its response could not be built "
                f"({type(exc).__name__}); the turn is in GET /sessions/{sid}/trajectory, and a retry of this "
                "request gets this same error, never a second turn")
            failed.turn = (out.branch_id, out.turn_index)
            raise failed from exc
