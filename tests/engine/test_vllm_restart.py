"""A real vLLM that dies mid-turn and comes back: the turn fails cleanly with nothing
committed, and the session continues on the restarted engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from session_server.ops.harness import free_port

from .conftest import serve_process
from .helpers import new_session, own_turns, trajectory, wait_until
from .recorder import PACE_MS, recording_proxy
from .vllm_engine import ENGINE_FLAGS, kill, vllm_server

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me more."}], "max_tokens": 16}


async def test_engine_death_fails_the_turn_and_a_restart_serves_the_session(
        qwen3_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    with vllm_server(qwen3_dir, tmp_path, extra=ENGINE_FLAGS, port=port) as engine:
        async with recording_proxy(engine.url) as rec, \
                serve_process(rec.url, qwen3_dir, tmp_path / "serve.log", "--health-check-interval-s", "1") as url, \
                httpx.AsyncClient(base_url=url, timeout=600) as http:
            sid = await new_session(http)
            first = await http.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT)
            assert first.status_code == 200, first.text
            before = await trajectory(http, sid)
            follow = {**CHAT, "max_tokens": 2000, "messages": [
                *CHAT["messages"], first.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]}
            sent = len(rec.generations())

            async def running() -> bool:  # at the engine, not answered yet
                return any(not e.done for e in rec.generations()[sent:])

            with rec.paced(PACE_MS):  # 20 s or more at the engine: the kill lands mid-turn on any machine
                turn = asyncio.create_task(http.post(f"/sessions/{sid}/v1/chat/completions", json=follow))
                await wait_until(running, 60, "the long turn to run")
                await asyncio.sleep(0.5)
                kill(engine)
            r = await turn
            assert r.status_code in (502, 503), r.text
            assert r.json()["error"]["type"].startswith(("upstream", "no_healthy")), r.text
            assert await trajectory(http, sid) == before, "nothing of the failed turn is committed"

            with vllm_server(qwen3_dir, tmp_path, extra=ENGINE_FLAGS, port=port):
                async def healthy() -> bool:
                    engines = (await http.get("/engines")).json()
                    return all(e["healthy"] for e in engines["engines"])

                await wait_until(healthy, 60, "the server to see the engine again")
                again = await http.post(f"/sessions/{sid}/v1/chat/completions", json={**follow, "max_tokens": 16})
                assert again.status_code == 200, again.text
                line, _, _, turns = own_turns(await trajectory(http, sid))
    assert len(turns) == 2
    prompt = rec.generations()[-1].request["token_ids"]
    assert prompt[: turns[0]["output_end"]] == line[: turns[0]["output_end"]].tolist()
