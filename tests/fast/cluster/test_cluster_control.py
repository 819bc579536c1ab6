"""Through the proxy: the control plane of a real `session-server cluster`.

A trainer holds one URL, the proxy's. A pause sent there reaches whichever worker
HAProxy picks; that worker relays it to its peers (the cluster told each worker the
others), so every instance is paused when the pause returns, in-flight turns on every
instance are aborted and resubmitted after resume, and no token is lost or changed:
each episode commits exactly the tokens and logprobs of an uninterrupted run (the
pause-storm check of `tests/fast/control/test_control_across_instances.py`, here through
HAProxy). A worker killed while one of its turns is in flight answers that turn with
a 502 in our envelope naming the instance. Skipped only when `haproxy` is absent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from session_server.sim import running_sim

from .test_cluster import needs_haproxy, running_cluster

TASK = "Refactor the config loader and run the tests."


async def _episode(http: httpx.AsyncClient, max_tokens: int = 120) -> dict[str, Any]:
    """Two chat turns through the proxy with the real `openai` client; the session's branch."""
    made = (await http.post("/sessions", json={})).json()
    agent = AsyncOpenAI(base_url=made["base_url"], api_key=made["api_key"], max_retries=0, timeout=120)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for _ in range(2):
        resp = await agent.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                   logprobs=True)
        msgs += [{"role": "assistant", "content": resp.choices[0].message.content or ""},
                 {"role": "user", "content": "next"}]
    await agent.close()
    r = await http.get(f"/sessions/{made['session_id']}/trajectory")
    assert r.status_code == 200, r.text
    branches = r.json()["branches"]
    assert len(branches) == 1
    return {"sid": made["session_id"], **branches[0]}


async def _states(direct: httpx.AsyncClient, urls: list[str]) -> list[dict[str, Any]]:
    """Each worker's `/control/state`, asked directly (not through the proxy)."""
    out = []
    for u in urls:
        r = await direct.get(f"{u}/control/state")
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


@needs_haproxy
async def test_pause_through_the_proxy_aborts_and_resumes_turns_on_every_instance(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=3, latency_ms=2) as engine, \
            running_cluster(qwen3, engine, 3, tmp_path) as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=120) as http, \
            httpx.AsyncClient(timeout=30) as direct:
        workers = [url for _, url in sorted(cl.workers.values())]
        assert len(workers) == 3, cl.log_text()[-2000:]
        # a client's x-tito-relayed is dropped at the proxy: the pause still reaches every instance
        r = await http.post("/control/pause", json={"mode": "abort"}, headers={"x-tito-relayed": "1"})
        assert r.status_code == 200 and len(r.json()["instances"]) == 2, r.text
        assert (await http.post("/control/resume", json={})).status_code == 200
        ref = await _episode(http)  # uninterrupted: what every episode must commit
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        cycles_with_all_in_flight = 0

        async def storm() -> int:
            nonlocal cycles_with_all_in_flight
            cycles = 0
            while not stop.is_set() and cycles < 6:
                # pause at a moment when every instance has a turn in flight (bounded wait)
                deadline = loop.time() + 5
                while not stop.is_set() and loop.time() < deadline:
                    if all(s["in_flight"] >= 1 for s in await _states(direct, workers)):
                        cycles_with_all_in_flight += 1
                        break
                    await asyncio.sleep(0.01)
                r = await http.post("/control/pause", json={"mode": "abort"})
                body = r.json()
                assert r.status_code == 200 and body["ok"] and body["failed_instances"] == [], r.text
                # the receiving worker relayed to the other two, by their own URLs
                assert len(body["instances"]) == 2 and set(body["instances"]) < set(workers), body
                assert all(s["paused"] for s in await _states(direct, workers))
                await asyncio.sleep(0.03)
                r = await http.post("/control/resume", json={})
                assert r.status_code == 200 and r.json()["ok"], r.text
                assert not any(s["paused"] for s in await _states(direct, workers))
                cycles += 1
            return cycles

        storm_task = asyncio.create_task(storm())
        results = await asyncio.gather(*(_episode(http) for _ in range(24)))
        stop.set()
        cycles = await storm_task
        assert cycles >= 1 and cycles_with_all_in_flight >= 1, (cycles, cycles_with_all_in_flight)

        on = {r["sid"].split(".")[0] for r in results}
        assert on == set(cl.workers), on  # sessions created through the proxy landed everywhere
        for got in results:  # no lost or mismatched token on any instance
            assert got["token_ids"] == ref["token_ids"], got["sid"]
            assert got["logprobs"] == ref["logprobs"], got["sid"]
            assert got["loss_mask"] == ref["loss_mask"], got["sid"]
            assert [t["finish_reason"] for t in got["turns"]] == [t["finish_reason"] for t in ref["turns"]]
        states = await _states(direct, workers)
        # every instance paused and resumed once per cycle (relayed once, never back)
        assert [s["counters"]["pauses"] for s in states] == [cycles + 1] * 3  # + the one above
        assert [s["counters"]["resumes"] for s in states] == [cycles + 1] * 3
        # and on every instance a pause cut a turn that then resumed to the same tokens
        assert all(s["counters"]["aborts"] >= 1 and s["counters"]["resubmits"] >= 1 for s in states), \
            [s["counters"] for s in states]

        r = await http.post("/control/weight_version", json={"version": 4})
        assert r.status_code == 200 and r.json()["ok"], r.text
        assert [s["weight_version"] for s in await _states(direct, workers)] == [4, 4, 4]


@needs_haproxy
async def test_a_worker_killed_mid_turn_answers_that_turn_with_502_naming_it(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=3, latency_ms=25) as engine, \
            running_cluster(qwen3, engine, 2, tmp_path) as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=120) as http, \
            httpx.AsyncClient(timeout=30) as direct:
        made = (await http.post("/sessions", json={})).json()
        victim = made["session_id"].split(".")[0]
        pid, url = cl.workers[victim]
        agent = AsyncOpenAI(base_url=made["base_url"], api_key=made["api_key"], max_retries=0, timeout=120)
        turn = asyncio.create_task(agent.chat.completions.create(
            model="m", messages=[{"role": "user", "content": TASK}], max_tokens=400))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while (await direct.get(f"{url}/control/state")).json()["in_flight"] < 1:
            assert loop.time() < deadline and not turn.done(), "the turn never started"
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as exc:
            await turn
        assert exc.value.status_code == 502
        err = exc.value.response.json()["error"]
        assert err["type"] == "instance_unavailable" and f"instance {victim} failed" in err["message"], err
        await agent.close()
        # the other worker still serves new sessions
        fresh = (await http.post("/sessions", json={})).json()
        assert not fresh["session_id"].startswith(victim + ".")
        r = await http.post(f"/sessions/{fresh['session_id']}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text


@needs_haproxy
async def test_a_restarted_worker_joins_the_paused_cluster_at_its_version_and_engines(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """The supervisor restarts a dead worker (same instance id and port). Meanwhile the
    trainer, through the proxy, added an engine, set weight version 5 and paused: the
    restarted worker comes back paused at version 5 with both engines before the proxy
    sends it anything; one resume through the proxy resumes every instance; the old
    sessions of that worker are back from its journal, new ones on it are stamped version 5."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=3) as engine, \
            running_sim("vllm", str(qwen3), seed=4) as second, \
            running_cluster(qwen3, engine, 2, tmp_path, "--restart-backoff-s", "4") as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=120) as http, \
            httpx.AsyncClient(timeout=30) as direct:
        on: dict[str, str] = {}
        for _ in range(20):  # a session on each instance
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            on.setdefault(sid.split(".")[0], sid)
        assert sorted(on) == ["w0", "w1"], on
        victim_pid, victim_url = cl.workers["w1"]
        os.kill(victim_pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while "worker w1 exited" not in cl.log_text():
            assert loop.time() < deadline, cl.log_text()[-2000:]
            await asyncio.sleep(0.05)
        # the trainer moves on while w1 is down (restarted after 4 s): w1 is named as failed each time
        for path, body in (("/engines", {"url": f"vllm={second}"}), ("/control/weight_version", {"version": 5}),
                           ("/control/pause", {"mode": "abort"})):
            r = await http.post(path, json=body)
            assert r.status_code == 207 and r.json()["failed_instances"] == [victim_url], r.text
        deadline = loop.time() + 120
        while True:  # restarted (after its backoff) and joined: healthy only once synced
            if "worker w1 restarted" in cl.log_text():
                with contextlib.suppress(httpx.HTTPError):
                    if (await direct.get(f"{victim_url}/health")).status_code == 200:
                        break
            assert loop.time() < deadline, cl.log_text()[-3000:]
            await asyncio.sleep(0.1)
        st = (await direct.get(f"{victim_url}/control/state")).json()
        assert st["synced"] and st["paused"] and st["mode"] == "abort" and st["weight_version"] == 5, st
        engines = sorted(e["base_url"] for e in (await direct.get(f"{victim_url}/engines")).json()["engines"])
        assert engines == sorted([engine, second])

        r = await http.post("/control/resume", json={})
        assert r.status_code == 200 and r.json()["ok"] and r.json()["failed_instances"] == [], r.text
        assert not any([(await direct.get(f"{u}/control/state")).json()["paused"] for _, u in cl.workers.values()])
        # w1's old session came back from its journal (the cluster journals by default); w0's is intact
        deadline = loop.time() + 30
        while (r := await http.get(f"/sessions/{on['w1']}")).status_code == 503:  # until HAProxy sees it up
            assert loop.time() < deadline, r.text
            await asyncio.sleep(0.2)
        assert r.status_code == 200 and r.json()["session_id"] == on["w1"], r.text
        assert (await http.get(f"/sessions/{on['w0']}")).status_code == 200
        # retire the SGLang engine by URL through the proxy (engine ids differ per instance now:
        # w1 numbered its engines anew); the SGLang sim stamps its own "default" version, the
        # vLLM one none, so a turn on the vLLM engine carries the version the instance holds
        r = await http.delete("/engines", params={"url": engine})
        assert r.status_code == 204, r.text
        for _, u in cl.workers.values():
            assert [e["base_url"] for e in (await direct.get(f"{u}/engines")).json()["engines"]] == [second]
        # new sessions reach the restarted worker again and carry the cluster's version
        fresh = None
        for _ in range(20):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            if sid.startswith("w1."):
                fresh = sid
                break
        assert fresh is not None
        r = await http.post(f"/sessions/{fresh}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": TASK}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        turn = (await http.get(f"/sessions/{fresh}/trajectory")).json()["branches"][0]["turns"][0]
        assert turn["weight_version"] == 5, turn


@needs_haproxy
async def test_a_wait_pause_lets_every_instances_turn_finish_under_the_old_version(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """Three instances share one SGLang engine, each with a turn in flight (of different
    lengths). A `wait` pause through the proxy answers 200 only once every instance's turn
    has left the engine, and no instance froze the shared engine under another's turn: each
    turn is one span of the old version, although the weights change right after."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=3, latency_ms=10) as engine, \
            running_cluster(qwen3, engine, 3, tmp_path) as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=120) as http, \
            httpx.AsyncClient(timeout=30) as direct:
        workers = [url for _, url in sorted(cl.workers.values())]
        assert (await http.post("/control/weight_version", json={"version": 1})).status_code == 200
        on: dict[str, str] = {}
        for _ in range(60):  # a session on each instance
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            on.setdefault(sid.split(".")[0], sid)
            if len(on) == 3:
                break
        assert sorted(on) == ["w0", "w1", "w2"], on
        turns = {name: asyncio.create_task(http.post(
            f"/sessions/{sid}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": TASK}], "max_tokens": 50 + 40 * i}))
            for i, (name, sid) in enumerate(sorted(on.items()))}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not all(s["in_flight"] >= 1 for s in await _states(direct, workers)):
            assert loop.time() < deadline and not any(t.done() for t in turns.values()), "turns never all in flight"
            await asyncio.sleep(0.01)
        r = await http.post("/control/pause", json={"mode": "wait"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ok"] and body["drained"] and body["engines_paused"] and body["failed_instances"] == [], body
        assert all(out["report"]["drained"] for out in body["instances"].values()), body
        states = await _states(direct, workers)
        # 200 only once no instance has a turn's request left at the engine (they all ended)
        assert [s["in_flight"] for s in states] == [0, 0, 0], states
        assert all(s["paused"] and s["mode"] == "wait" for s in states)
        assert (await http.post("/control/weight_version", json={"version": 2})).status_code == 200
        assert (await http.post("/control/resume", json={})).status_code == 200
        for name, t in turns.items():
            resp = await t
            assert resp.status_code == 200, (name, resp.text)
            got = (await http.get(f"/sessions/{on[name]}/trajectory")).json()["branches"][0]["turns"]
            assert len(got) == 1 and got[0]["finish_reason"] in ("stop", "length"), (name, got)
            assert got[0]["weight_spans"] == [[got[0]["output_start"], got[0]["output_end"], 1]], (name, got)
