"""Route + admit + generate: one turn's engine request, placed and sent.

`dispatch` chooses the session's target (routing policy, prefix affinity), holds a
prefill admission slot per segment, generates through pauses (`generate_resilient`)
and, when the home engine turns out dead, re-homes once; engine health is recorded
from what the request saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from trajectory.validate import Expectations

from .context import ServerContext, log
from .control import ResilientResult, generate_resilient
from .engines.base import GenerateRequest
from .errors import UpstreamHTTPError, UpstreamTransportError
from .routing import prefix_block_hashes, record_failure
from .sessions import Session

__all__ = ["dispatch"]


async def dispatch(
    ctx: ServerContext, session: Session, greq: GenerateRequest, expect: Expectations,
    on_routed: Callable[[], None],
) -> tuple[ResilientResult, str]:
    """Send to the session's home; on a refused connection, re-home once and retry.

    The turn's deadline (`timeout_s`) starts here and covers every wait inside
    `generate_resilient`: the pause gate, prefill admission (a large uncached
    prefill waits in the server for its engine), a generation slot, and the
    generation; pauses are survived there (abort, accumulate, resubmit)."""
    engines = ctx.engines
    n = len(greq.input_ids)
    hashes = None
    if engines.policy.name == "cache_aware":
        hashes = prefix_block_hashes(greq.input_ids)  # hashed as numpy bytes, no per-id ints
    attempts = 2 if len(engines.engines) > 1 else 1
    deadline = time.monotonic() + greq.timeout_s  # once: a re-home does not restart the clock
    for attempt in range(attempts):
        target = engines.select(session.id, session.home, context_tokens=n, prefix_hashes=hashes)
        if attempt == 0:
            on_routed()  # the engine request built and its target chosen
        session.home = target.id
        engine = engines.engine_of(target)
        adapter = ctx.registry.adapter(engine.id)
        pinned = replace(greq, dp_rank=target.dp_rank if engine.dp_size > 1 else None)
        uncached = engines.uncached_tokens(session.id, target.id, n)
        target.in_flight += 1
        result: ResilientResult | None = None
        try:
            eid = engine.id  # admission per segment, never held at the pause gate (issue 8)

            def admit(guess: int | None, eid: str = eid, uncached: int = uncached) -> Any:
                return ctx.admission.acquire(eid, uncached if guess is None else guess)

            result = await generate_resilient(adapter, pinned, ctx.control, expect=expect,
                                              admit=admit, deadline=deadline)
            return result, target.id
        except UpstreamTransportError as exc:
            dead = record_failure(engines, engine.id, exc)
            if not dead and not exc.transient and not await ctx.registry.answers_health(engine.id):
                engines.mark_failed(engine.id)  # the drop was the engine dying
                dead = True
            if not dead or attempt == attempts - 1:
                raise
            # nothing was received and nothing committed: a fresh generation on the
            # new home is a valid sample of the same turn
            log.warning("engine %s is down (%s); re-homing session %s", engine.id, exc, session.id)
        except UpstreamHTTPError as exc:
            record_failure(engines, engine.id, exc, exc.http_status)
            raise
        finally:
            target.in_flight -= 1
            total = n + len(result.output_ids) if result is not None else None
            engines.on_turn_complete(target, session.id, ok=result is not None, total_tokens=total)
    raise AssertionError("unreachable")
