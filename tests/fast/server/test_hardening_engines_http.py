"""Hardening of the engine adapters and their HTTP plumbing (issues 8 and 16), live stack."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.control import ControlPlane, generate_resilient
from session_server.engines import GenerateRequest, SGLangAdapter, VLLMAdapter
from session_server.sim import running_sim
from tests.fast.server.conftest import CHAT, live_stack


async def _aborts(engine: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        return (await c.get(f"{engine}/sim/aborts")).json()


def _aborted_rids(log: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for call in log["calls"]:
        body = call["body"]
        out += [body["rid"]] if "rid" in body else list(body.get("request_ids", []))
    return out


async def _until(pred: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await pred():
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_turn_timeout_aborts_engine_request(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=50) as st:
        sid = await st.session()
        r = await st.chat(sid, {**CHAT, "max_tokens": 400, "timeout_s": 0.4})
        assert r.status_code == 504, r.text

        async def seen() -> bool:
            return bool(_aborted_rids(await _aborts(st.engines[0])))

        await _until(seen)
        aborted = _aborted_rids(await _aborts(st.engines[0]))
        assert len(aborted) == 1, "the engine never saw an abort for the timed-out turn"
        assert re.fullmatch(r"[0-9a-f]{32}", aborted[0])  # that segment's own rid, never "all"


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_cancelled_generate_resilient_aborts_engine_request(qwen3_dir: Path, protocol: str) -> None:
    async with running_sim(protocol, str(qwen3_dir), latency_ms=30) as url:
        adapter: Any = SGLangAdapter(url, retries=0) if protocol == "sglang" else VLLMAdapter(url, retries=0)
        control = ControlPlane(lambda: [adapter])
        rid = f"{7:032x}"
        try:
            task = asyncio.create_task(generate_resilient(
                adapter, GenerateRequest(rid, [1, 2, 3, 4], 400), control))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await control.drain_aborts()
            log = await _aborts(url)
        finally:
            await adapter.aclose()
    assert rid in _aborted_rids(log)
    sent = control.metrics.engine_aborts_total.labels("sent")._value.get()
    assert sent == 1
