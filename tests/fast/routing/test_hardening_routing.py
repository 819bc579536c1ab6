"""Hardening of routing, health and admission (issue 8)."""

from __future__ import annotations

from typing import Any

import pytest

from session_server.engines.http import EngineHTTP
from session_server.errors import NoHealthyEngine, UpstreamTransportError
from session_server.routing.pool import EnginePool


class _Adapter:
    protocol = "sglang"
    base_url = "http://x"


def test_engine_removed_mid_turn_on_turn_complete_keeps_the_turn() -> None:
    pool = EnginePool()
    pool.add("e0", _Adapter())  # type: ignore[arg-type]
    target = pool.select("s", None, context_tokens=100)
    pool.remove("e0")
    # the turn finished after its engine left: stats only, never a KeyError
    pool.on_turn_complete(target, "s", ok=True, total_tokens=150)
    with pytest.raises(NoHealthyEngine):
        pool.engine_of(target)
    assert pool._cached == {} and pool._pending == {}


async def test_closed_engine_client_never_reopens_its_session() -> None:
    http = EngineHTTP("http://127.0.0.1:9", protocol="sglang")
    first = http.session()
    await http.aclose()
    assert first.closed
    with pytest.raises(UpstreamTransportError):
        http.session()
    assert http._session is None


def test_weight_update_resets_cached_prefix_estimates() -> None:
    from session_server.control import ControlPlane

    pool = EnginePool()
    pool.add("e0", _Adapter())  # type: ignore[arg-type]
    target = pool.select("s", None, context_tokens=100)
    pool.on_turn_complete(target, "s", ok=True, total_tokens=150)
    assert pool.uncached_tokens("s", target.id, 200) == 50
    control = ControlPlane(lambda: [])
    control.on_weight_version.append(lambda _v: pool.reset_cached())
    control.set_weight_version(1)
    assert pool.uncached_tokens("s", target.id, 200) == 200
    assert target.resident_tokens == 0




async def test_one_failed_probe_keeps_engine_and_its_cache_estimates() -> None:
    from session_server.routing.health import probe_once

    pool = EnginePool()
    pool.add("e0", _Adapter())  # type: ignore[arg-type]
    pool.add("e1", _Adapter())  # type: ignore[arg-type]
    t = pool.select("s", "e0/0", context_tokens=100)
    pool.on_turn_complete(t, "s", ok=True, total_tokens=150)
    fail = {"e0"}

    async def probe(eng: Any) -> None:
        if eng.id in fail:
            raise ConnectionRefusedError

    await probe_once(pool, probe, timeout_s=1.0)
    assert pool.engines["e0"].healthy and pool.uncached_tokens("s", "e0/0", 200) == 50
    fail.clear()
    await probe_once(pool, probe, timeout_s=1.0)  # a healthy probe resets the count
    fail.add("e0")
    await probe_once(pool, probe, timeout_s=1.0)
    assert pool.engines["e0"].healthy
    await probe_once(pool, probe, timeout_s=1.0)
    assert not pool.engines["e0"].healthy and pool.uncached_tokens("s", "e0/0", 200) == 200
