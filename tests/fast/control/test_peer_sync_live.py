"""An instance that (re)starts in a running cluster joins its control state.

Live servers over simulated engines. Instance A runs alone while the trainer pauses,
sets weight version 3, adds engine e1 and removes e0 at runtime; B then starts with
`--peers A` and the start-up flags of a stale worker (engine e0, no version). Before
it answers `/health` 200 it has A's pause, version and engines; the trainer's resume
sent to B reaches A; B's first turn is stamped with version 3 and runs on e1."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.ops.harness import free_port, running_server
from session_server.sim import running_sim

MSGS = [{"role": "user", "content": "Refactor the config loader and run the tests."}]


async def _until_healthy(http: httpx.AsyncClient, within_s: float = 20.0) -> list[str]:
    """Poll `/health` until 200; the statuses seen before it."""
    loop = asyncio.get_running_loop()
    deadline, seen = loop.time() + within_s, []
    while (r := await http.get("/health")).status_code != 200:
        assert r.status_code == 503, r.text
        seen.append(r.json()["status"])
        assert loop.time() < deadline, seen[-3:]
        await asyncio.sleep(0.01)
    return seen


async def test_a_starting_instance_adopts_pause_version_and_engines_from_its_peer(qwen3_dir: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        e0 = await stack.enter_async_context(running_sim("sglang", str(qwen3_dir), seed=3))
        e1 = await stack.enter_async_context(running_sim("vllm", str(qwen3_dir), seed=4))
        a_port, b_port = free_port(), free_port()
        a_url, b_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"

        def cfg(peer: str) -> AppConfig:
            return AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={e0}"],
                             settings=Settings(peers=[peer], peer_timeout_s=5))

        await stack.enter_async_context(running_server(cfg(b_url), port=a_port))
        a = await stack.enter_async_context(httpx.AsyncClient(base_url=a_url, timeout=30))
        await _until_healthy(a)  # B is down: A joined nobody and serves
        # the trainer moves the cluster on while B is down (each answer names B as failed)
        assert (await a.post("/engines", json={"url": f"vllm={e1}"})).status_code == 207
        e0_id = next(e["id"] for e in (await a.get("/engines")).json()["engines"] if e["base_url"] == e0)
        assert (await a.delete(f"/engines/{e0_id}")).status_code == 207
        assert (await a.post("/control/weight_version", json={"version": 3})).status_code == 207
        r = await a.post("/control/pause", json={"mode": "keep"})
        assert r.status_code == 207 and r.json()["failed_instances"] == [b_url], r.text

        await stack.enter_async_context(running_server(cfg(a_url), port=b_port))
        b = await stack.enter_async_context(httpx.AsyncClient(base_url=b_url, timeout=30))
        await _until_healthy(b)  # B reads A right after it starts listening
        st = (await b.get("/control/state")).json()
        assert st["synced"] and st["paused"] and st["mode"] == "keep" and st["weight_version"] == 3, st
        assert [e["base_url"] for e in (await b.get("/engines")).json()["engines"]] == [e1]
        assert st["counters"]["pauses"] == 0  # adopted: B paused no engine itself

        sid = (await b.post("/sessions", json={})).json()["session_id"]
        r = await b.post("/control/resume", json={})  # relayed to A: one URL resumes the cluster
        assert r.status_code == 200 and r.json()["ok"], r.text
        assert not (await a.get("/control/state")).json()["paused"]
        r = await b.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200, r.text
        turn = (await b.get(f"/sessions/{sid}/trajectory")).json()["branches"][0]["turns"][0]
        assert turn["weight_version"] == 3 and turn["engine"].startswith("e"), turn
        assert (await b.get(f"/sessions/{sid}")).json()["home"].split("/")[0] == \
            (await b.get("/engines")).json()["engines"][0]["id"]


async def test_while_it_reads_its_peers_health_is_503_and_turns_wait_at_the_gate(qwen3_dir: Path) -> None:
    """A peer that accepts connections but never answers holds the read until the read
    timeout: meanwhile /health is 503 "syncing" and a turn waits; then the instance
    serves with its own state and the turn runs."""
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up
        writer.close()

    hang = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    hang_url = f"http://127.0.0.1:{hang.sockets[0].getsockname()[1]}"
    try:
        async with running_sim("sglang", str(qwen3_dir), seed=3) as e0, \
                running_server(AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={e0}"],
                                         settings=Settings(peers=[hang_url], peer_timeout_s=2))) as url, \
                httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "syncing", r.text
            st = (await http.get("/control/state")).json()
            assert st["synced"] is False and st["paused"] is False  # not a pause: a join
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            turn = asyncio.create_task(http.post(f"/sessions/{sid}/v1/chat/completions",
                                                 json={"messages": MSGS, "max_tokens": 4}))
            await asyncio.sleep(0.5)
            assert not turn.done() and (await http.get("/control/state")).json()["waiting_at_gate"] == 1
            seen = await _until_healthy(http)
            assert set(seen) == {"syncing"}
            r = await turn
            assert r.status_code == 200, r.text
    finally:
        hang.close()
        await hang.wait_closed()
