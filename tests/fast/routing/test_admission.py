"""Prefill admission: large uncached prefills are serialised per engine, FIFO; small never wait."""

from __future__ import annotations

import asyncio

import pytest

from session_server.routing import AdmissionConfig, PrefillAdmission


async def _hold(
    adm: PrefillAdmission, engine: str, tokens: int, log: list[str], tag: str, gate: asyncio.Event
) -> None:
    async with adm.acquire(engine, tokens):
        log.append(f"start {tag}")
        await gate.wait()
        log.append(f"end {tag}")


async def test_small_prefills_never_wait() -> None:
    adm = PrefillAdmission()
    gate = asyncio.Event()
    log: list[str] = []
    big = asyncio.create_task(_hold(adm, "e0", 50_000, log, "big", gate))
    await asyncio.sleep(0)
    async with adm.acquire("e0", 16_383):
        log.append("small")
    assert log == ["start big", "small"]
    gate.set()
    await big


async def test_large_prefills_serialised_per_engine_in_fifo_order() -> None:
    adm = PrefillAdmission()
    gates = [asyncio.Event() for _ in range(3)]
    log: list[str] = []
    tasks = [asyncio.create_task(_hold(adm, "e0", 16_384, log, str(i), gates[i])) for i in range(3)]
    other = asyncio.create_task(_hold(adm, "e1", 90_000, log, "e1", asyncio.Event()))
    await asyncio.sleep(0.01)
    assert log == ["start 0", "start e1"]
    assert (adm.active("e0"), adm.waiting("e0"), adm.active("e1")) == (1, 2, 1)
    for i in range(3):
        gates[i].set()
        await tasks[i]
    assert [x for x in log if x != "start e1"] == [
        "start 0",
        "end 0",
        "start 1",
        "end 1",
        "start 2",
        "end 2",
    ]
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other
    assert adm.active("e1") == 0


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    adm = PrefillAdmission(AdmissionConfig(max_large_per_engine=2, large_prefill_tokens=1000))
    gate = asyncio.Event()
    log: list[str] = []
    holders = [asyncio.create_task(_hold(adm, "e0", 1000, log, str(i), gate)) for i in range(2)]
    waiter = asyncio.create_task(_hold(adm, "e0", 1000, log, "w", gate))
    await asyncio.sleep(0.01)
    assert adm.waiting("e0") == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.waiting("e0") == 0
    gate.set()
    await asyncio.gather(*holders)
    async with adm.acquire("e0", 5000), adm.acquire("e0", 5000):
        assert adm.active("e0") == 2
    assert adm.active("e0") == 0
