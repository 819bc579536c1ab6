"""Health: dead signals mark engines, slow never does, recovery moves nothing back."""

from __future__ import annotations

import asyncio

import pytest

from session_server.errors import UpstreamHTTPError, UpstreamTimeout, UpstreamTransportError
from session_server.routing import (
    EnginePool,
    check_health_once,
    health_check_loop,
    is_dead_signal,
    record_failure,
)
from session_server.routing.pool import Engine


@pytest.mark.parametrize(
    ("exc", "status", "dead"),
    [
        pytest.param(ConnectionRefusedError(), None, True, id="refused"),
        pytest.param(ConnectionResetError(), None, True, id="reset"),
        pytest.param(UpstreamTransportError("x"), None, True, id="transport"),
        pytest.param(UpstreamHTTPError("x", http_status=503), None, True, id="http-503"),
        pytest.param(UpstreamHTTPError("x", http_status=400), None, False, id="http-400"),
        pytest.param(None, 500, True, id="status-500"),
        pytest.param(None, 429, False, id="status-429"),
        pytest.param(UpstreamTimeout("slow"), None, False, id="timeout"),
        pytest.param(TimeoutError(), None, False, id="builtin-timeout"),
    ],
)
def test_dead_signals(exc: BaseException | None, status: int | None, dead: bool) -> None:
    assert is_dead_signal(exc, status) is dead


def _pool() -> EnginePool:
    pool = EnginePool(clock=lambda: 1.0)
    for e in ("e0", "e1", "e2"):
        pool.add(e, dp_size=1)
    return pool


def test_record_failure_marks_only_dead_signals() -> None:
    pool = _pool()
    assert not record_failure(pool, "e0", UpstreamTimeout("slow"))
    assert pool.engines["e0"].healthy
    # a reset / 5xx counts, but one bad request does not take the engine out
    assert not record_failure(pool, "e0", ConnectionResetError())
    assert not record_failure(pool, "e0", http_status=500)
    assert pool.engines["e0"].healthy
    assert record_failure(pool, "e0", ConnectionResetError())  # third in a row
    assert not pool.engines["e0"].healthy


def test_refused_connection_marks_dead_at_once_and_success_resets_the_count() -> None:
    from session_server.errors import UpstreamTransportError

    pool = _pool()
    assert not record_failure(pool, "e1", http_status=502)
    assert not record_failure(pool, "e1", http_status=503)
    t = pool.select("s", None)
    pool.on_turn_complete(pool.targets["e1/0"], "s", ok=True)  # a success in between
    assert pool.engines["e1"].consecutive_errors == 0
    assert not record_failure(pool, "e1", http_status=500)
    assert pool.engines["e1"].healthy
    assert record_failure(pool, "e2", UpstreamTransportError("refused", transient=True))
    assert not pool.engines["e2"].healthy
    assert t is not None


async def test_health_check_once_dead_slow_healthy_and_recovery_moves_nothing() -> None:
    pool = _pool()
    home = next(tid for tid in pool.targets if tid.startswith("e1/"))  # on the slow engine
    t = pool.select("s", home, context_tokens=10)
    assert t.id == home
    pool.on_turn_complete(t, "s", ok=True, total_tokens=20)
    pool.mark_failed("e2")

    async def check(eng: Engine) -> None:
        if eng.id == "e0":
            raise ConnectionRefusedError
        if eng.id == "e1":
            await asyncio.sleep(1.0)

    verdicts = await check_health_once(pool, check, timeout_s=0.05)
    assert verdicts == {"e0": "dead", "e1": "slow", "e2": "healthy"}
    # one failed health check is not death: consecutive failures confirm it
    assert [pool.engines[e].healthy for e in ("e0", "e1", "e2")] == [True, True, True]
    await check_health_once(pool, check, timeout_s=0.05)
    assert [pool.engines[e].healthy for e in ("e0", "e1", "e2")] == [False, True, True]
    # slow is not dead: the session stays home with its cached prefix
    assert pool.uncached_tokens("s", home, 30) == 10
    assert pool.select("s", home, context_tokens=30).id == home
    assert pool.migrations == 0


async def test_health_check_loop_stops_on_event() -> None:
    pool = _pool()
    calls: list[str] = []
    stop = asyncio.Event()

    async def check(eng: Engine) -> None:
        calls.append(eng.id)
        if len(calls) >= 6:
            stop.set()

    await asyncio.wait_for(health_check_loop(pool, check, interval_s=0.01, timeout_s=1.0, stop=stop), 2.0)
    assert len(calls) == 6
