"""How an engine removal travels between the instances of a cluster.

Engine ids are per instance, so a removal reaches a peer by the engine's URL, in the
public by-URL form `DELETE /engines?url=URL`, whichever removal route the trainer used.
An instance of the previous release relays `DELETE /engines/by-url?base_url=URL`
instead; that form still removes the engine, so a cluster can be upgraded one
instance at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from aiohttp import web

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.control.relay import RELAYED_HEADER
from session_server.ops.harness import running_server
from session_server.sim import running_sim


@contextlib.asynccontextmanager
async def recording_peer() -> AsyncIterator[tuple[str, list[tuple[str, str, dict[str, str], str | None]]]]:
    """A peer that answers every request 204 (404 to the GETs of a peer sync: it has no
    state to offer) and records (method, path, query, relayed marker)."""
    seen: list[tuple[str, str, dict[str, str], str | None]] = []

    async def answer(request: web.Request) -> web.Response:
        if request.method == "GET":
            return web.Response(status=404)
        seen.append((request.method, request.path, dict(request.query), request.headers.get(RELAYED_HEADER)))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield "http://{}:{}".format(*runner.addresses[0][:2]), seen
    finally:
        await runner.cleanup()


async def _healthy(http: httpx.AsyncClient) -> None:
    for _ in range(400):
        if (await http.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the instance never became healthy")


async def _engine_id(http: httpx.AsyncClient, url: str) -> str:
    return str(next(e["id"] for e in (await http.get("/engines")).json()["engines"] if e["base_url"] == url))


async def test_a_removal_reaches_the_peers_by_url_whichever_route_the_trainer_used(qwen3_dir: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(running_sim("sglang", str(qwen3_dir), seed=3))
        second = await stack.enter_async_context(running_sim("vllm", str(qwen3_dir), seed=4))
        peer, seen = await stack.enter_async_context(recording_peer())
        cfg = AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={first}", f"vllm={second}"],
                        settings=Settings(peers=[peer], peer_timeout_s=5))
        base = await stack.enter_async_context(running_server(cfg))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=30))
        await _healthy(http)

        r = await http.delete(f"/engines/{await _engine_id(http, first)}")
        assert r.status_code == 204, r.text
        r = await http.delete("/engines", params={"url": f"vllm={second}/"})
        assert r.status_code == 204, r.text
        assert (await http.get("/engines")).json()["engines"] == []
    assert seen == [("DELETE", "/engines", {"url": first}, "1"), ("DELETE", "/engines", {"url": second}, "1")]


async def test_a_removal_relayed_in_the_previous_release_form_still_removes_the_engine(qwen3_dir: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(running_sim("sglang", str(qwen3_dir), seed=3))
        second = await stack.enter_async_context(running_sim("vllm", str(qwen3_dir), seed=4))
        cfg = AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={first}", f"vllm={second}"])
        base = await stack.enter_async_context(running_server(cfg))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=30))
        relayed = {RELAYED_HEADER: "1"}

        r = await http.delete("/engines/by-url", params={"base_url": second}, headers=relayed)
        assert r.status_code == 204, r.text
        assert [e["base_url"] for e in (await http.get("/engines")).json()["engines"]] == [first]
        # gone here: the 404 its relayer counts as "absent", not as a failure
        r = await http.delete("/engines/by-url", params={"base_url": second}, headers=relayed)
        assert r.status_code == 404, r.text
