"""Real streaming of a turn: the engine's deltas forwarded as they are sampled.

A `LiveTurn` belongs to one request; the pipeline sees it as its `TurnStream`
(`pipeline.py`). When the parsed request asks for `stream: true`, the pipeline calls
`begin` once the engine request is built: the dialect's
encoder gets `TurnStarted`, and `on_delta` then receives every `TokenDelta` the engine
streams (through pauses: a resubmitted segment continues the same stream). Each delta
becomes a `TokensDelta` and the text deltas `TextStreamer` (`text_stream.py`) can vouch for; for the hermes
families, tool calls as `HermesCalls` reads them (`ToolCallStarted` with an id minted
here, canonical `ToolArgumentsDelta`s). Before commit, `check` verifies the streamed ids
are a prefix of the validated ones and the streamed text a prefix of the message's
fields (else the turn fails: nothing committed), gives the message the streamed call ids
and notes a final parse that disagrees with the streamed calls (committed anyway, see
`stream_events`); after commit, `finish` sends the rest (held-back text, the rest of the
tool calls, `TurnCommitted`). A turn
that fails after `begin` ends with `TurnFailed` (`on_done`). Every frame is also kept
(`frames`) so that a replayed request gets exactly these bytes (`replay.py`).

A streamed request may wait before its turn starts: in the session's claim queue behind
the turn in flight (which may itself wait out a weight-update pause), or for anything
else before `begin`. Silent, it is killed by its client's idle watchdog, so the
response begins without the turn (`parsed` arms it): once the request has waited
`keepalive_s`, `opened` is set, the endpoint answers 200 with the SSE headers, and the
dialect's keep-alives flow (after the encoder's `opening` frames: Responses sends its
`response.created` then, since Codex's idle timer counts events and the openai SDK
wants that event first) until the turn's own frames do. From then on a failure is the
dialect's error event (`on_done`), as after `begin`; before it, an HTTP status.

The client's frames wait in a bounded outbox (`outbox.py`, `stream_buffer_bytes`): a client that
stops reading without disconnecting would otherwise hold every frame of its turn, for
as long as its connection lives. Past the bound its waiting frames are dropped and its
stream ends with a `stream_overflow` error event (then its dialect's end, e.g. chat's
`[DONE]`), delivered if it ever reads again; the turn runs on and commits, and a retry
(with a retry header) gets the whole stored response. The reader holds only the outbox:
once the turn ends, its frames are not pinned by a stalled connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from trajectory.codec.parsing import new_call_id, tool_names
from trajectory.errors import CodecError

from ..control import new_request_id
from ..engines.base import TokenDelta
from ..errors import BadRequest, ServiceError, StreamOverflow, UpstreamInvalid, from_library
from .incremental import FieldSplitter, IncrementalDecoder, IncrementalText, calls_for, markup_for
from .incremental_calls import CallArgs, CallStart
from .outbox import Outbox, drain, with_keepalives
from .output import Rendered, TurnOutput
from .stream_events import (
    StreamEncoder,
    StreamEvent,
    TokensDelta,
    ToolArgumentsDelta,
    ToolCallStarted,
    TurnCommitted,
    TurnFailed,
    TurnStarted,
)
from .text_stream import TextStreamer, think_close_ids

if TYPE_CHECKING:
    from ..context import ServerContext
    from .chat_request import ChatRequest
    from .commit import Checked
    from .engine_request import EngineCall
    from .prepare import Prepared

__all__ = ["EncoderSource", "LiveTurn"]


class EncoderSource(Protocol):
    """Who makes a request's stream encoder: its client dialect (`api/dialects/`)."""

    def encoder(self, req: ChatRequest, tokenizer: Any) -> StreamEncoder: ...


def _failure(exc: BaseException) -> TurnFailed:
    """An exception as our error envelope's (type, message, status)."""
    err: ServiceError | None = exc if isinstance(exc, ServiceError) else None
    if err is None and isinstance(exc, CodecError):
        err = from_library(exc) or BadRequest(str(exc))
    if err is None:
        return TurnFailed("internal_error", f"{type(exc).__name__}: {exc}", 500)
    return TurnFailed(err.type, err.message, err.status)

class LiveTurn:
    """One request's live stream: frames out as events happen, kept for replays."""

    def __init__(self, ctx: ServerContext, dialect: EncoderSource) -> None:
        self.ctx, self.dialect = ctx, dialect
        self.started = asyncio.Event()  # the turn streams (`begin`)
        self.opened = asyncio.Event()  # the response began: at `begin`, or early (`parsed`)
        self.request_id: str | None = None  # minted at `parsed` for a stream: its turn's engine request id
        self._arrived = asyncio.get_running_loop().time()
        self._early: asyncio.TimerHandle | None = None
        self.frames: list[bytes] = []
        self._outbox = Outbox(ctx.settings.stream_buffer_bytes)
        self._req: ChatRequest | None = None
        self._encoder: StreamEncoder | None = None
        self._text: TextStreamer | None = None
        self._ids: list[Any] = []
        self._lps: list[Any] = []  # the streamed logprobs, held to the committed ones at `check`
        self._ended = False
        self.pending: list[StreamEvent] = []  # what `check` left to send after commit
        self._inc: IncrementalText | None = None  # the covered families' per-chunk path
        self._parsing = False  # a fallback whole parse is running off the loop
        self._stale = False  # ids came while it ran: parse again when it ends
        self._closed = False  # `check` ran: no more text deltas
        self._calls: list[list[str]] = []  # per tool call streamed live: [id we minted, name, arguments sent]
        self._followers: list[asyncio.Queue[bytes | None]] = []  # adopted replays (`follow`)

    @property
    def active(self) -> bool:
        return self.started.is_set()

    @property
    def _encoding(self) -> StreamEncoder:
        """The request's encoder: made at `parsed` (or `begin`), before any frame exists."""
        assert self._encoder is not None
        return self._encoder

    def parsed(self, req: ChatRequest) -> None:
        """The request is parsed (before its claim): for a stream, make its encoder and
        mint its turn's request id (the early `response.created` names it), and open the
        response `keepalive_s` after the request arrived unless its turn began by then."""
        if not req.stream or self._encoder is not None:
            return
        self._req = req
        self._encoder = self.dialect.encoder(req, self.ctx.tokenizer)
        self.request_id = new_request_id()
        loop = asyncio.get_running_loop()
        self._early = loop.call_at(self._arrived + self.ctx.settings.keepalive_s, self._open_early)

    def _open_early(self) -> None:
        """The request waited `keepalive_s` without its turn starting: begin the response
        (the dialect's opening frames, if any, are part of the turn: kept in `frames`)."""
        self._early = None
        if self.opened.is_set() or self._ended:
            return
        assert self.request_id is not None
        for frame in self._encoding.opening(self.request_id):
            self._push(frame)
        self.opened.set()

    def begin(self, req: ChatRequest, call: EngineCall, prep: Prepared) -> bool:
        """Start the stream when the request asks for one: whether it streams (then
        `on_delta` takes the engine's deltas)."""
        if not req.stream:
            return False
        ctx = self.ctx
        if self._early is not None:
            self._early.cancel()
            self._early = None
        if self._encoder is None:  # not `parsed` (a caller of the pipeline without it)
            self._req = req
            self._encoder = self.dialect.encoder(req, ctx.tokenizer)
        tools = None if req.tool_choice == "none" else prep.tools
        kwargs = prep.template_kwargs

        def parse(ids: Sequence[int]) -> dict[str, Any]:
            return ctx.codec.parse_assistant(ids, tools=tools, template_kwargs=kwargs).to_message()

        tok = getattr(ctx.codec, "tokenizer", ctx.tokenizer)
        self._text = TextStreamer(parse, think_close_ids(tok), tools=bool(tools))
        names = tool_names(tools)
        markup = markup_for(ctx.codec, tools=bool(names), template_kwargs=kwargs)
        if markup is not None:
            stops = getattr(ctx.codec, "stop_token_ids", ())
            calls = calls_for(markup, names)
            self._inc = IncrementalText(IncrementalDecoder(tok, stops), FieldSplitter(markup), calls)
        self._emit(TurnStarted(call.greq.request_id, len(call.greq.input_ids)))
        self.started.set()
        self.opened.set()
        return True

    def on_delta(self, delta: TokenDelta) -> None:
        """An engine delta: its tokens, then whatever text became certain. Covered families
        decode and split only the new ids here (work follows the new tokens); others get
        the whole parse, off the loop, one at a time (ids that came meanwhile wait for the next)."""
        self._ids.extend(delta.ids)
        self._lps.extend(delta.logprobs)
        self._emit(TokensDelta(list(delta.ids), list(delta.logprobs), delta.top_logprobs))
        if self._text is None or self._closed:
            return
        try:
            new = [int(t) for t in delta.ids]
        except (TypeError, ValueError):
            self._closed = True  # a bad id: validation fails the turn at its end
            return
        if self._inc is not None:
            try:
                pieces = self._inc.feed(new)
            except Exception:  # ids the tokenizer cannot decode: the end-of-turn parse says why
                self._closed = True
                return
            for piece in pieces:
                self._emit(self._piece(piece))
            return
        self._schedule()

    def _piece(self, piece: tuple[str, str] | CallStart | CallArgs) -> StreamEvent:
        """One incremental piece as its event; a call's id is minted here (the committed
        message gets it in `check`: the families streamed this way sample no ids)."""
        assert self._text is not None
        if isinstance(piece, CallStart):
            self._calls.append([new_call_id(), piece.name, ""])
            return ToolCallStarted(piece.index, self._calls[-1][0], piece.name)
        if isinstance(piece, CallArgs):
            self._calls[piece.index][2] += piece.text
            return ToolArgumentsDelta(piece.index, piece.text)
        return self._text.add(*piece)

    def _schedule(self) -> None:
        """Start a fallback whole parse off the loop unless one is running (then mark stale)."""
        if self._parsing:
            self._stale = True
            return
        assert self._text is not None
        self._parsing, self._stale = True, False
        ids = [int(t) for t in self._ids]
        fut = asyncio.ensure_future(self.ctx.offload.run(self._text.settle, ids))
        fut.add_done_callback(self._parsed)

    def _parsed(self, fut: asyncio.Future[dict[str, str]]) -> None:
        self._parsing = False
        if fut.cancelled() or fut.exception() is not None or self._closed or self._text is None:
            return
        for event in self._text.advance(fut.result()):
            self._emit(event)
        if self._stale:
            self._schedule()

    def check(self, checked: Checked) -> Checked:
        """Before commit: the streamed tokens and text must be a prefix of the validated
        turn (else `UpstreamInvalid`: nothing is committed); the events still to send go
        to `pending`. Tool calls streamed live give the committed message their ids; a
        call the final parse reads differently (the tokens are the truth: cut at
        max_tokens, malformed later on) does not fail the turn: it is committed as
        parsed, the rest of the message is sent, and the divergence is counted."""
        self._closed = True  # a fallback parse still running is discarded
        ids = checked.valid.ids.tolist()
        if [int(t) for t in self._ids] != ids[: len(self._ids)]:
            raise UpstreamInvalid("the engine's streamed tokens differ from its final output")
        logprobs = checked.valid.logprobs.tolist()
        if self._lps != logprobs[: len(self._lps)]:  # both float32 values (chunks are checked as they come)
            raise UpstreamInvalid("the engine's streamed logprobs differ from its final output")
        events: list[StreamEvent] = []
        if len(ids) > len(self._ids):  # not streamed (constrained turns) or held by the engine
            n = len(self._ids)
            events.append(TokensDelta(ids[n:], logprobs[n:], None))
        assert self._text is not None
        calls, rest, diverged = self._reconcile(checked.message.get("tool_calls") or [])
        events += rest  # the open call's rest before any text: a dialect's open block is that call
        events += self._text.tail(checked.message)
        for i, tc in enumerate(calls[len(self._calls):], start=len(self._calls)):
            fn = tc.get("function") or {}
            events.append(ToolCallStarted(i, str(tc.get("id", "")), str(fn.get("name", ""))))
            if fn.get("arguments"):
                events.append(ToolArgumentsDelta(i, str(fn["arguments"])))
        self.pending = events
        if not self._calls:
            return checked
        return _amended(checked, calls, diverged)

    def _reconcile(self, calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[StreamEvent], bool]:
        """(the message's calls with the streamed ids, the rest of the streamed calls'
        arguments, whether the final parse disagrees with what was streamed)."""
        out, diverged = list(calls), len(self._calls) > len(calls)
        rest: list[StreamEvent] = []
        for i, (cid, name, sent) in enumerate(self._calls[: len(calls)]):
            fn = calls[i].get("function") or {}
            args = str(fn.get("arguments") or "")
            last = i == len(self._calls) - 1  # only the last streamed call may still be open
            if fn.get("name") != name or not args.startswith(sent) or (len(args) > len(sent) and not last):
                diverged = True
                continue
            out[i] = {**calls[i], "id": cid}
            if len(args) > len(sent):
                rest.append(ToolArgumentsDelta(i, args[len(sent):]))
        if diverged:
            self.ctx.metrics.stream_tool_divergence_total.inc()
        return out, rest, diverged

    def finish(self, out: TurnOutput) -> Rendered:
        """After commit: the rest of the turn and `TurnCommitted`; every frame, for replays."""
        t0 = time.perf_counter()
        for event in [*self.pending, TurnCommitted(out)]:
            self._emit(event)
        self._end()
        self.ctx.metrics.observe_phase("respond", time.perf_counter() - t0)  # as `render` does
        return Rendered("text/event-stream", frames=tuple(self.frames))

    def on_done(self, task: asyncio.Future[Rendered]) -> None:
        """The request's task ended: a failure once the response began (at `begin` or
        early) ends the stream with `TurnFailed`; before, the endpoint answers it as an HTTP error."""
        if self._early is not None:
            self._early.cancel()
            self._early = None
        exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
        if self.opened.is_set() and not self._ended and exc is not None:
            self._emit(_failure(exc))
            self._end()

    def stream(self, task: asyncio.Future[Rendered], *, held: bool = False) -> AsyncIterator[bytes]:
        """The frames as they come; a client that leaves cancels the turn (nothing committed),
        unless `held`: a request that may be retried (`replay.py`) keeps its turn for the
        replay grace, and the retry gets every frame from the start and the one commit."""
        # not a generator of this object: see `outbox.drain`
        return drain(self._outbox, task, held, self._encoding.keepalive, self.ctx.settings.keepalive_s,
                      not self.frames)

    async def follow(self, waiter: asyncio.Future[None]) -> AsyncIterator[bytes]:
        """For a replay that adopted this turn while it streams: every frame from the first,
        then the rest as they come (to the same end: committed or the error event).
        `waiter` (the replay's own wait for the turn) is cancelled if the replay leaves
        first; else it ends with the turn."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        for sent in self.frames:
            queue.put_nowait(sent)
        if self._ended:
            queue.put_nowait(None)
        else:
            self._followers.append(queue)
        ended = False
        try:
            async for frame in with_keepalives(queue, self._encoding.keepalive, self.ctx.settings.keepalive_s,
                                                lead=queue.empty()):
                yield frame
            ended = True  # the waiter ends by itself now (the turn is over)
        finally:
            if queue in self._followers:
                self._followers.remove(queue)
            if not ended:
                waiter.cancel()

    def _emit(self, event: StreamEvent) -> None:
        for frame in self._encoding.encode(event):
            self._push(frame)

    def _push(self, frame: bytes) -> None:
        """One frame of the turn: kept for replays, sent to the client and to followers."""
        self.frames.append(frame)
        if not self._outbox.put(frame):
            self._cut()
        # followers are replays of a recorded request, whose frames are kept for the
        # replay log anyway (`frames`): their queues reference them, they add no bytes
        for follower in self._followers:
            follower.put_nowait(frame)

    def _cut(self) -> None:
        """The client stopped reading: drop its waiting frames and end its stream with a
        `stream_overflow` error event, encoded apart (the turn's own encoder keeps the
        frames a replay gets unchanged)."""
        err = StreamOverflow(
            f"the client read this stream too slowly: more than {self._outbox.limit} bytes waited unsent, so the "
            "stream was cut; the turn goes on and is committed (a retry with x-stainless-retry-count or "
            "Idempotency-Key gets the whole response; GET /sessions/{sid}/trajectory has it)")
        assert self._req is not None
        encoder = self.dialect.encoder(self._req, self.ctx.tokenizer)
        self._outbox.cut_with(encoder.encode(_failure(err)))
        self.ctx.metrics.stream_overflows_total.inc()

    def _end(self) -> None:
        self._ended = True
        self._outbox.end()
        for follower in self._followers:
            follower.put_nowait(None)


def _amended(checked: Checked, calls: list[dict[str, Any]], diverged: bool) -> Checked:
    """`checked` with the streamed call ids in its message and parse (and the divergence
    noted for the turn record)."""
    message = {**checked.message, "tool_calls": calls} if calls else checked.message
    parsed = checked.parsed
    if calls and len(parsed.tool_calls) == len(calls):
        parsed = replace(parsed, tool_calls=[replace(tc, id=c["id"]) for tc, c in zip(parsed.tool_calls, calls,
                                                                                           strict=True)])
    extra = {**checked.extra, "stream_tool_divergence": True} if diverged else checked.extra
    return replace(checked, message=message, parsed=parsed, extra=extra)
