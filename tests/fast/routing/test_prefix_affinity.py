"""Prefix affinity end to end: 2 simulated engines x 4 DP ranks behind the server.

A session keeps one home target; every later turn is a prefix hit for all but
its new tokens; when the home engine dies the session is re-homed and the next
turn succeeds with the trajectory intact. Engines can be added and removed at
runtime through the API.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.ops.demo import TOOLS, run_tool
from session_server.ops.harness import running_server
from session_server.sim import running_sim

from ..e2e.test_openai_client_episodes import assert_trajectory_matches_engine


async def _turn(http: httpx.AsyncClient, sid: str, msgs: list[dict[str, Any]]) -> dict[str, Any]:
    r = await http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 96})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    msgs.append({k: v for k, v in msg.items() if v is not None})
    for tc in msg.get("tool_calls") or []:
        msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": run_tool(tc["function"]["name"], tc["function"]["arguments"])})
    if not msg.get("tool_calls"):
        msgs.append({"role": "user", "content": "Keep going."})
    return r.json()


async def test_session_keeps_one_home_and_survives_home_death(qwen3_dir: Path) -> None:
    engine_ctx = [contextlib.AsyncExitStack(), contextlib.AsyncExitStack()]
    urls = [await engine_ctx[i].enter_async_context(running_sim("sglang", str(qwen3_dir), seed=i, dp=4)) for i in range(2)]
    try:
        config = AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={u}" for u in urls],
                           settings=Settings(health_check_interval_s=3600))
        async with running_server(config) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            engines = (await http.get("/engines")).json()
            assert [e["dp_size"] for e in engines["engines"]] == [4, 4]
            assert len(engines["targets"]) == 8
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "Investigate the failing build."}]
            for _ in range(4):
                await _turn(http, sid, msgs)
            view = (await http.get(f"/sessions/{sid}")).json()
            home = view["home"]
            traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
            turns = traj["branches"][0]["turns"]
            assert {t["engine"] for t in turns} == {home}, "every turn went to the home target"
            for t in turns[1:]:
                assert t["cached_tokens"] == t["prompt_start"], "all but the new tokens were cached"
            home_engine = int(home.split("/")[0].removeprefix("e"))
            async with httpx.AsyncClient() as c:
                log = (await c.get(f"{urls[home_engine]}/sim/requests")).json()
            assert {r["dp_rank"] for r in log} == {int(home.split("/")[1])}
            assert all(r["pinned"] for r in log)
            before = traj["branches"][0]

            await engine_ctx[home_engine].aclose()  # the home engine dies
            await _turn(http, sid, msgs)
            view = (await http.get(f"/sessions/{sid}")).json()
            assert view["home"].split("/")[0] != home.split("/")[0], "re-homed onto the survivor"
            after = (await http.get(f"/sessions/{sid}/trajectory")).json()["branches"][0]
            n = len(before["token_ids"])
            assert after["token_ids"][:n] == before["token_ids"][:n]
            assert after["loss_mask"][:n] == before["loss_mask"][:n]
            assert len(after["turns"]) == len(before["turns"]) + 1
            assert after["turns"][-1]["engine"] == view["home"]
            survivor = 1 - home_engine
            async with httpx.AsyncClient() as c:
                slog = (await c.get(f"{urls[survivor]}/sim/requests")).json()
            assert slog[-1]["input_ids"] == after["token_ids"][: after["turns"][-1]["output_start"]]
            state = (await http.get("/engines")).json()
            assert [e["healthy"] for e in state["engines"]][home_engine] is False
    finally:
        for ctx in engine_ctx:
            await ctx.aclose()


async def test_engines_added_and_removed_at_runtime(qwen3_dir: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(running_sim("vllm", str(qwen3_dir), seed=1))
        second = await stack.enter_async_context(running_sim("vllm", str(qwen3_dir), seed=2, dp=2))
        config = AppConfig(tokenizer=str(qwen3_dir), engines=[f"vllm={first}"], settings=Settings())
        url = await stack.enter_async_context(running_server(config))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
        r = await http.post("/engines", json={"url": f"vllm={second}", "dp_size": 2})
        assert r.status_code == 201, r.text
        added = r.json()["id"]
        assert len((await http.get("/engines")).json()["targets"]) == 3
        assert (await http.delete("/engines/e0")).status_code == 204
        assert (await http.delete("/engines/e0")).status_code == 404
        sid = (await http.post("/sessions", json={})).json()["session_id"]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Go."}]
        await _turn(http, sid, msgs)
        await _turn(http, sid, msgs)
        view = (await http.get(f"/sessions/{sid}")).json()
        assert view["home"].startswith(f"{added}/")
        traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
        async with httpx.AsyncClient() as c:
            log = (await c.get(f"{second}/sim/requests")).json()
        assert_trajectory_matches_engine(traj["branches"][0], log, "runtime-added vllm engine")
        assert (await http.post("/engines", json={"url": "", "dp_size": 0})).status_code == 400
        # removing the only engine while a turn runs on it: that good generation is delivered
        slow = await stack.enter_async_context(running_sim("vllm", str(qwen3_dir), seed=3, latency_ms=10))
        r = await http.post("/engines", json={"url": f"vllm={slow}", "dp_size": 1})
        assert r.status_code == 201, r.text
        slow_id = r.json()["id"]
        assert (await http.delete(f"/engines/{added}")).status_code == 204
        sid2 = (await http.post("/sessions", json={})).json()["session_id"]
        import asyncio
        turn = asyncio.create_task(http.post(
            f"/sessions/{sid2}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Go."}],
                                                          "max_tokens": 64}))
        await asyncio.sleep(0.2)
        assert not turn.done()
        assert (await http.delete(f"/engines/{slow_id}")).status_code == 204
        r = await turn
        assert r.status_code == 200, r.text
        assert len((await http.get(f"/sessions/{sid2}/trajectory")).json()["branches"][0]["turns"]) == 1


async def test_home_engine_dying_mid_turn_is_retried_on_the_new_home(qwen3_dir: Path) -> None:
    import asyncio

    engine_ctx = [contextlib.AsyncExitStack(), contextlib.AsyncExitStack()]
    urls = [await engine_ctx[i].enter_async_context(running_sim("sglang", str(qwen3_dir), seed=i, latency_ms=20))
            for i in range(2)]
    try:
        config = AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={u}" for u in urls],
                           settings=Settings(health_check_interval_s=3600))
        async with running_server(config) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "Investigate."}]
            chat = asyncio.create_task(
                http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": msgs, "max_tokens": 64}))
            home = None
            for _ in range(400):
                view = (await http.get(f"/sessions/{sid}")).json()
                if view["busy"] and view["home"]:
                    home = view["home"]
                    break
                await asyncio.sleep(0.005)
            assert home is not None
            await asyncio.sleep(0.1)  # tokens are being generated on the home engine
            await engine_ctx[int(home.split("/")[0].removeprefix("e"))].aclose()
            r = await chat
            assert r.status_code == 200, r.text
            view = (await http.get(f"/sessions/{sid}")).json()
            assert view["home"] != home and view["turns"] == 1
            traj = (await http.get(f"/sessions/{sid}/trajectory")).json()["branches"][0]
            assert traj["turns"][0]["engine"] == view["home"]
    finally:
        for ctx in engine_ctx:
            await ctx.aclose()


async def test_graceful_shutdown_drains_in_flight_turns(qwen3_dir: Path) -> None:
    import asyncio

    async with running_sim("sglang", str(qwen3_dir), latency_ms=10) as engine:
        config = AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={engine}"], settings=Settings())
        async with httpx.AsyncClient(timeout=60) as http:
            async with running_server(config) as url:
                sid = (await http.post(f"{url}/sessions", json={})).json()["session_id"]
                chat = asyncio.create_task(http.post(
                    f"{url}/sessions/{sid}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Go."}], "max_tokens": 64}))
                for _ in range(400):
                    if (await http.get(f"{url}/sessions/{sid}")).json()["busy"]:
                        break
                    await asyncio.sleep(0.005)
            # the server has shut down: the in-flight turn was drained, not cut
            r = await chat
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "tool_calls", "length")
