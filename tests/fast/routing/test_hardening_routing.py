"""Hardening of routing, health and admission."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from session_server.engines.http import EngineHTTP
from session_server.errors import NoHealthyEngine, UpstreamTransportError
from session_server.routing.pool import EnginePool


def test_engine_removed_mid_turn_on_turn_complete_keeps_the_turn() -> None:
    pool = EnginePool()
    pool.add("e0")
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
    pool.add("e0")
    target = pool.select("s", None, context_tokens=100)
    pool.on_turn_complete(target, "s", ok=True, total_tokens=150)
    assert pool.uncached_tokens("s", target.id, 200) == 50
    control = ControlPlane(lambda: [])
    control.on_weight_version.append(lambda _v: pool.reset_cached())
    control.set_weight_version(1)
    assert pool.uncached_tokens("s", target.id, 200) == 200
    assert target.resident_tokens == 0




async def test_one_failed_health_check_keeps_engine_and_its_cache_estimates() -> None:
    from session_server.routing.health import check_health_once

    pool = EnginePool()
    pool.add("e0")
    pool.add("e1")
    t = pool.select("s", "e0/0", context_tokens=100)
    pool.on_turn_complete(t, "s", ok=True, total_tokens=150)
    fail = {"e0"}

    async def check(eng: Any) -> None:
        if eng.id in fail:
            raise ConnectionRefusedError

    await check_health_once(pool, check, timeout_s=1.0)
    assert pool.engines["e0"].healthy and pool.uncached_tokens("s", "e0/0", 200) == 50
    fail.clear()
    await check_health_once(pool, check, timeout_s=1.0)  # a healthy check resets the count
    fail.add("e0")
    await check_health_once(pool, check, timeout_s=1.0)
    assert pool.engines["e0"].healthy
    await check_health_once(pool, check, timeout_s=1.0)
    assert not pool.engines["e0"].healthy and pool.uncached_tokens("s", "e0/0", 200) == 200


def _old_prefix_block_hashes(token_ids: list[int], block_tokens: int) -> tuple[int, ...]:
    """The previous definition (per-token Python ints), kept as the reference."""
    import hashlib

    out: list[int] = []
    prev = b""
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = token_ids[start : start + block_tokens]
        digest = hashlib.blake2b(
            prev + b"".join(int(t).to_bytes(4, "little", signed=True) for t in block), digest_size=8
        ).digest()
        out.append(int.from_bytes(digest, "big"))
        prev = digest
    return tuple(out)


class _NoPerIdArray(np.ndarray):
    """Fails if anyone walks the ids one Python int at a time."""

    def __iter__(self) -> Any:
        raise AssertionError("per-id iteration")

    def tolist(self) -> Any:
        raise AssertionError("tolist")


def test_prefix_hashes_on_numpy_bytes_equal_old_definition() -> None:
    from session_server.routing.policy import prefix_block_hashes

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, size=1000).astype(np.int32)
    for block in (1, 7, 256):
        new = prefix_block_hashes(ids, block)
        assert new == _old_prefix_block_hashes(ids.tolist(), block)
        assert new == prefix_block_hashes(ids.tolist(), block)  # lists and arrays agree
        # prefix-stable: a longer context keeps every earlier block hash
        assert prefix_block_hashes(ids[:700], block) == new[: 700 // block]
    # the per-block work is on bytes: never one Python int per id
    guarded = ids.view(_NoPerIdArray)
    assert prefix_block_hashes(guarded, 256) == _old_prefix_block_hashes(ids.tolist(), 256)
