"""Engine health: passive marking from request failures and an active health-check loop.

Dead means unreachable: connect refused/reset or a 5xx. Slow is not dead: a
timeout never marks an engine unhealthy (its KV still holds sessions, and moving
them would re-prefill their contexts elsewhere). Recovery marks the engine
healthy and moves nothing back; its targets only receive new placements.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ..errors import UpstreamHTTPError, UpstreamTimeout, UpstreamTransportError
from .pool import Engine, EnginePool

log = logging.getLogger(__name__)

HealthCheckFn = Callable[[Engine], Awaitable[object]]


def is_dead_signal(exc: BaseException | None = None, http_status: int | None = None) -> bool:
    """True for failures that mean the engine is gone, False for slow or client-side ones."""
    if http_status is not None and http_status >= 500:
        return True
    if exc is None:
        return False
    if isinstance(exc, (UpstreamTimeout, TimeoutError, asyncio.TimeoutError)):
        return False
    if isinstance(exc, UpstreamTransportError):
        return True
    if isinstance(exc, UpstreamHTTPError):
        return exc.http_status >= 500
    return isinstance(exc, (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError))


ERRORS_BEFORE_DEAD = 3
"""Engine-side errors (5xx, a connection dropped mid-request) in a row before an
engine counts as dead: one bad request must not take a whole engine out."""


def record_failure(
    pool: EnginePool,
    engine_id: str,
    exc: BaseException | None = None,
    http_status: int | None = None,
    *,
    errors_before_dead: int = ERRORS_BEFORE_DEAD,
) -> bool:
    """Passive health; True when `engine_id` is now marked failed.

    A refused connection is proof at once (nothing listens); other dead signals
    (5xx, a reset mid-request) count towards `errors_before_dead` in a row."""
    if not is_dead_signal(exc, http_status):
        return False
    eng = pool.engines.get(engine_id)
    if eng is None:
        return False
    refused = isinstance(exc, UpstreamTransportError) and exc.transient
    eng.consecutive_errors += 1
    if refused or eng.consecutive_errors >= errors_before_dead:
        pool.mark_failed(engine_id)
        return True
    return False


CHECKS_BEFORE_DEAD = 2
"""Failed active health checks in a row before an engine is marked dead: death drops every
cached-prefix estimate there (each session re-prefills elsewhere), so one lost check
must not cost that."""


async def check_health_once(
    pool: EnginePool, check: HealthCheckFn, timeout_s: float, *, checks_before_dead: int = CHECKS_BEFORE_DEAD
) -> dict[str, str]:
    """Health-check every engine concurrently; returns engine id -> "healthy" | "dead" | "slow".

    A "dead" verdict marks the engine failed only after `checks_before_dead` in a row;
    until then it keeps its sessions and their cached-prefix estimates."""
    engines = list(pool.engines.values())

    async def one(eng: Engine) -> str:
        try:
            await asyncio.wait_for(check(eng), timeout_s)
        except TimeoutError:
            return "slow"
        except Exception as exc:  # any failed check is a verdict, never a crash of the loop
            if isinstance(exc, UpstreamTimeout):
                return "slow"
            return "dead"
        return "healthy"

    verdicts = await asyncio.gather(*(one(e) for e in engines))
    out: dict[str, str] = {}
    for eng, verdict in zip(engines, verdicts, strict=True):
        out[eng.id] = verdict
        if verdict == "healthy":
            eng.failed_health_checks = 0
            if not eng.healthy:
                log.info("engine %s recovered; existing sessions stay where they are", eng.id)
                pool.mark_healthy(eng.id)
        elif verdict == "dead":
            eng.failed_health_checks += 1
            if eng.healthy and eng.failed_health_checks >= checks_before_dead:
                log.warning("engine %s failed %d health checks in a row; marking unhealthy",
                            eng.id, eng.failed_health_checks)
                pool.mark_failed(eng.id)
    return out


async def health_check_loop(
    pool: EnginePool,
    check: HealthCheckFn,
    interval_s: float = 5.0,
    timeout_s: float = 5.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Run `check_health_once` every `interval_s` until `stop` is set (or the task is cancelled)."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        await check_health_once(pool, check, timeout_s)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
