"""Two adds of one engine URL racing (a relayed POST /engines beside a peer sync, or a
trainer's retry of a slow add) register it once: the registry checks for the URL after
its last await, never before a slow step such as learning the model's shape."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from session_server.engines import registry as registry_module
from session_server.engines.registry import EngineRegistry
from session_server.routing.pool import EnginePool
from session_server.sim import running_sim


async def test_two_adds_of_one_url_racing_register_one_engine(
        monkeypatch: pytest.MonkeyPatch, tokenizer_dirs: dict[str, Any]) -> None:
    async def slow_shape(_adapter: Any, timeout_s: float = 10.0) -> None:
        await asyncio.sleep(0.2)  # an engine slow to tell its model's config
        return None

    monkeypatch.setattr(registry_module, "learn_routed_shape", slow_shape)
    reg = EngineRegistry(EnginePool())
    async with running_sim("sglang", str(tokenizer_dirs["qwen3"])) as url:
        try:
            a, b = await asyncio.gather(reg.add(f"sglang={url}"), reg.add(f"sglang={url}"))
            assert a is b
            assert list(reg.pool.engines) == [a.id]
        finally:
            await reg.aclose()
