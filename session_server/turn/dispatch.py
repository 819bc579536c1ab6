"""Route + admit + generate: one turn's engine request, placed and sent.

    generate  -> dispatch (the re-home loop: at most one retry, one deadline)
                   -> route (routing policy, prefix affinity: a target)
                   -> _attempt (one try on that target)
                        -> _admission (a prefill slot per segment)
                        -> generate_resilient (through pauses)
                        -> _engine_down (health: what the failure says of the engine)

An engine's 4xx on a request constraint becomes the client's 400 (`generate`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trajectory.codec.probe import decode_text
from trajectory.validate import Expectations, is_int

from ..context import ServerContext, log
from ..control import ResilientResult, generate_resilient
from ..engines.base import GenerateRequest, TokenDelta
from ..errors import UpstreamHTTPError, UpstreamTransportError
from ..routing import prefix_block_hashes, record_failure
from ..routing.pool import TargetStats
from ..sessions import Session
from ..structured import engine_refusal
from ..tracing import TurnTrace
from .chat_request import ChatRequest
from .engine_request import EngineCall
from .watch import Peeker

__all__ = ["Generated", "dispatch", "generate_turn"]


@dataclass(frozen=True)
class Generated:
    """The engine's answer (through any pauses) and the target that gave it."""

    result: ResilientResult
    target_id: str


@dataclass(frozen=True)
class _EngineDown:
    """An attempt whose engine turned out dead before anything was received: re-home."""

    engine_id: str
    error: UpstreamTransportError


async def generate_turn(
    ctx: ServerContext, session: Session, req: ChatRequest, call: EngineCall, on_placed: Callable[[], None],
    on_delta: Callable[[TokenDelta], None] | None = None, trace: TurnTrace | None = None,
    peek: Peeker | None = None,
) -> Generated:
    """Route, admit and generate; an engine's 4xx on a constraint is the client's 400.
    `on_delta`: a streamed turn's engine deltas, `trace`: its spans, `peek`: a watcher's
    view of a turn the client does not stream (`generate_resilient`)."""
    try:
        return await dispatch(ctx, session, call.greq, call.expect, on_placed, on_delta, trace, peek)
    except UpstreamHTTPError as exc:
        refusal = engine_refusal(exc, call.greq.sampling.constraint, req)
        if refusal is not None:
            raise refusal from exc
        raise


async def dispatch(
    ctx: ServerContext, session: Session, greq: GenerateRequest, expect: Expectations,
    on_placed: Callable[[], None], on_delta: Callable[[TokenDelta], None] | None = None,
    trace: TurnTrace | None = None, peek: Peeker | None = None,
) -> Generated:
    """Send to the session's home; when that engine is down, re-home once and retry.

    The turn's deadline (`timeout_s`) starts here and covers every wait inside
    `generate_resilient`: the pause gate, prefill admission (a large uncached
    prefill waits in the server for its engine), a generation slot, and the
    generation; pauses are survived there (abort, accumulate, resubmit).
    `on_placed` is called once, when the first target is chosen. Tokens a watcher saw
    (`peek`) were never the client's: they do not stop a re-home."""
    hashes = None
    if ctx.pool.policy.needs_prefix_hashes:
        hashes = prefix_block_hashes(greq.input_ids)  # hashed as numpy bytes, no per-id ints
    attempts = 2 if len(ctx.pool.engines) > 1 else 1
    deadline = time.monotonic() + greq.timeout_s  # once: a re-home does not restart the clock
    shown = 0

    def forward(delta: TokenDelta) -> None:
        nonlocal shown
        shown += 1
        if on_delta is not None:
            on_delta(delta)

    for attempt in range(attempts):
        target = route(ctx, session, len(greq.input_ids), hashes)
        if attempt == 0:
            on_placed()  # the engine request built and its target chosen
        got = await _attempt(ctx, session, target, greq, expect, deadline, forward if on_delta else None, trace, peek)
        if not isinstance(got, _EngineDown):
            return Generated(result=got, target_id=target.id)
        if attempt == attempts - 1 or shown:  # streamed tokens were shown: no other sample
            raise got.error
        # nothing was received and nothing committed: a fresh generation on the
        # new home is a valid sample of the same turn
        log.warning("engine %s is down (%s); re-homing session %s", got.engine_id, got.error, session.id)
        if peek is not None:
            peek.restart()
    raise AssertionError("unreachable")


def route(ctx: ServerContext, session: Session, context_tokens: int, hashes: Any) -> TargetStats:
    """The session's target under the routing policy; it becomes the session's home."""
    target = ctx.pool.select(session.id, session.home, context_tokens=context_tokens, prefix_hashes=hashes)
    session.home = target.id
    return target


async def _attempt(
    ctx: ServerContext, session: Session, target: TargetStats, greq: GenerateRequest,
    expect: Expectations, deadline: float, on_delta: Callable[[TokenDelta], None] | None = None,
    trace: TurnTrace | None = None, peek: Peeker | None = None,
) -> ResilientResult | _EngineDown:
    """One try on `target`, its load and outcome booked there (in flight, cache estimate,
    engine health). A dead engine is returned, not raised, so the caller can re-home."""
    engines = ctx.pool
    engine = engines.engine_of(target)
    adapter = ctx.registry.adapter(engine.id)
    n = len(greq.input_ids)
    pinned = replace(greq, dp_rank=target.dp_rank if engine.dp_size > 1 else None)
    admit = _admission(ctx, engine.id, engines.uncached_tokens(session.id, target.id, n))
    target.in_flight += 1
    result: ResilientResult | None = None
    try:
        result = await generate_resilient(adapter, pinned, ctx.control, expect=expect, admit=admit, deadline=deadline,
                                          on_delta=on_delta, decode=_output_text(ctx) if greq.sampling.stop else None,
                                          trace=trace, peek=peek)
        if greq.top_logprobs:  # a support session reads its supports with its engine's rule (commit)
            result = replace(result, support_rule=adapter.capabilities.support_logprobs)
        return result
    except UpstreamTransportError as exc:
        if not await _engine_down(ctx, engine.id, exc):
            raise
        return _EngineDown(engine_id=engine.id, error=exc)
    except UpstreamHTTPError as exc:
        record_failure(engines, engine.id, exc, exc.http_status)
        raise
    finally:
        target.in_flight -= 1
        total = n + len(result.output_ids) if result is not None else None
        engines.on_turn_complete(target, session.id, ok=result is not None, total_tokens=total)


def _output_text(ctx: ServerContext) -> Callable[[Sequence[Any]], str]:
    """Output ids as the engines' detokenizers read them for stop strings (special tokens
    kept: the server sends `skip_special_tokens: false`); an id the tokenizer has no text
    for (vocabulary padding, or bad output the validator rejects later) adds none."""
    tokenizer, size = ctx.tokenizer, ctx.codec.vocab_size

    def text(ids: Sequence[Any]) -> str:
        return decode_text(tokenizer, [int(t) for t in ids if is_int(t) and 0 <= t < size])

    return text


def _admission(
    ctx: ServerContext, engine_id: str, uncached: int
) -> Callable[[int | None], contextlib.AbstractAsyncContextManager[Any]]:
    """Prefill admission per segment, never held at the pause gate (`generate_resilient`
    takes it only once the gate is open): a resumed segment passes its own uncached
    guess, the first one the routing estimate."""

    def admit(guess: int | None) -> contextlib.AbstractAsyncContextManager[Any]:
        return ctx.admission.acquire(engine_id, uncached if guess is None else guess)

    return admit


async def _engine_down(ctx: ServerContext, engine_id: str, exc: UpstreamTransportError) -> bool:
    """Book a transport failure; True when the engine is now dead. A refused connection
    is dead at once (`record_failure`); a drop is the engine dying only when its health
    check fails too."""
    engines = ctx.pool
    if record_failure(engines, engine_id, exc):
        return True
    if not exc.transient and not await ctx.registry.answers_health(engine_id):
        engines.mark_failed(engine_id)  # the drop was the engine dying
        return True
    return False
