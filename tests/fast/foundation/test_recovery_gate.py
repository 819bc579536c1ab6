"""While the journal replays, the instance is up and says so: `/health` 503 `recovering`,
session routes 503 `recovering` (retried by SDKs), then 200 with the sessions back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server import durability
from session_server.app import AppConfig
from session_server.context import Settings
from session_server.ops.cluster import free_ports
from session_server.ops.harness import running_server
from session_server.sim import running_sim


async def test_health_and_sessions_answer_503_recovering_until_the_journal_replayed(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = durability.replay_rows

    def slow(rows: Any, clock: Any) -> Any:
        time.sleep(1.5)  # a long journal (off the loop, as the real replay)
        return real(rows, clock)

    monkeypatch.setattr(durability, "replay_rows", slow)
    qwen3 = tokenizer_dirs["qwen3"]
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    seen: list[tuple[int, str]] = []

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                try:
                    h = await http.get(f"{url}/health")
                    s = await http.post(f"{url}/sessions", json={})
                except httpx.TransportError:
                    await asyncio.sleep(0.02)
                    continue
                seen.append((h.status_code, h.json()["status"]))
                if h.status_code == 200:
                    return
                assert s.status_code == 503 and s.json()["error"]["type"] == "recovering", s.text
                assert s.headers["retry-after"] == "1"
                await asyncio.sleep(0.05)

    async with running_sim("sglang", str(qwen3)) as engine:
        poller = asyncio.create_task(poll())
        config = AppConfig(tokenizer=str(qwen3), engines=[f"sglang={engine}"],
                           settings=Settings(journal_dir=str(tmp_path / "j")))
        async with running_server(config, port=port):
            await asyncio.wait_for(poller, 30)
    assert (503, "recovering") in seen and seen[-1] == (200, "ok"), seen


async def test_a_journal_writer_that_cannot_start_keeps_the_gate_closed_and_says_why(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of processes at start: no session is served without a journal that can be
    written (the store stays closed, the reason is kept; under `serve` the process
    exits with the restartable status 70)."""
    from session_server import journal_writer

    def no_process(*args: object, **kw: object) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(journal_writer, "spawn", no_process)
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3)) as engine:
        config = AppConfig(tokenizer=str(qwen3), engines=[f"sglang={engine}"],
                           settings=Settings(journal_dir=str(tmp_path / "j")))
        try:
            with pytest.raises(RuntimeError, match="writer process could not be started.*temporarily unavailable"):
                async with running_server(config, port=free_ports(1)[0]):
                    pass
        finally:
            durability.FATAL.clear()
