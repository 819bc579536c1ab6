"""The control plane across instances.

N in-process `serve` apps on ports chosen beforehand, each listing the others as
`peers`, over the same simulated engine(s). A control request sent to one instance is
applied there and relayed to every peer (marked `x-tito-relayed`, never relayed again);
the answer is 200 only when every instance acknowledged, else 207 naming each failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.control.relay import RELAYED_HEADER
from session_server.ops.harness import free_port, running_server
from session_server.sim import running_sim

MSGS = [{"role": "user", "content": "Refactor the config loader and run the tests."}]


@dataclass
class Cluster:
    urls: list[str]
    engines: list[str]
    clients: list[httpx.AsyncClient]

    async def state(self, i: int) -> dict[str, Any]:
        r = await self.clients[i].get("/control/state")
        assert r.status_code == 200, r.text
        return dict(r.json())


@contextlib.asynccontextmanager
async def live_cluster(
    tokenizer_dir: Path, n: int = 2, *, latency_ms: float = 0.0, tokens: Sequence[str | None] | None = None,
    extra_peers: Sequence[str] = (), **settings: Any,
) -> AsyncIterator[Cluster]:
    """`n` instances over one simulated SGLang engine; instance i has admin token `tokens[i]`."""
    tokens = list(tokens) if tokens is not None else [None] * n
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(running_sim("sglang", str(tokenizer_dir), seed=3, latency_ms=latency_ms))
        ports = [free_port() for _ in range(n)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        clients = []
        for i, port in enumerate(ports):
            peers = [u for j, u in enumerate(urls) if j != i] + (list(extra_peers) if i == 0 else [])
            cfg = AppConfig(tokenizer=str(tokenizer_dir), engines=[f"sglang={engine}"],
                            settings=Settings(peers=peers, admin_token=tokens[i], peer_timeout_s=10, **settings))
            await stack.enter_async_context(running_server(cfg, port=port))
            headers = {"authorization": f"Bearer {tokens[i]}"} if tokens[i] else {}
            clients.append(await stack.enter_async_context(
                httpx.AsyncClient(base_url=urls[i], timeout=60, headers=headers)))
        yield Cluster(urls, [engine], clients)


def _branch(traj: dict[str, Any]) -> dict[str, Any]:
    assert len(traj["branches"]) == 1
    return dict(traj["branches"][0])


async def _episode(http: httpx.AsyncClient) -> dict[str, Any]:
    sid = (await http.post("/sessions", json={})).json()["session_id"]
    msgs: list[dict[str, Any]] = list(MSGS)
    for _ in range(2):
        r = await http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": msgs, "max_tokens": 120})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        msgs += [{k: v for k, v in msg.items() if v is not None}, {"role": "user", "content": "next"}]
    r = await http.get(f"/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    return _branch(r.json())


async def test_pause_through_one_instance_pauses_all_and_loses_no_token(qwen3_dir: Path) -> None:
    """The pause-storm check across 3 instances: every pause sent to instance A returns
    only once all instances paused; turns on every instance commit exactly the tokens of
    an uninterrupted run."""
    async with live_cluster(qwen3_dir, 3, latency_ms=2) as cl:
        a = cl.clients[0]
        ref = await _episode(a)
        stop = asyncio.Event()

        async def storm() -> int:
            cycles = 0
            while not stop.is_set() and cycles < 5:
                await asyncio.sleep(0.04)
                r = await a.post("/control/pause", json={"mode": "abort"})
                body = r.json()
                assert r.status_code == 200 and body["ok"] and body["failed_instances"] == [], r.text
                assert set(body["instances"]) == set(cl.urls[1:])
                # cluster-wide: every instance is paused when the pause returns
                assert all([(await cl.state(i))["paused"] for i in range(3)])
                await asyncio.sleep(0.02)
                r = await a.post("/control/resume", json={})
                assert r.status_code == 200 and r.json()["ok"], r.text
                assert not any([(await cl.state(i))["paused"] for i in range(3)])
                cycles += 1
            return cycles

        storm_task = asyncio.create_task(storm())
        results = await asyncio.gather(*(_episode(cl.clients[i % 3]) for i in range(24)))
        stop.set()
        cycles = await storm_task
        assert cycles >= 1
        for got in results:
            assert got["token_ids"] == ref["token_ids"]
            assert got["logprobs"] == ref["logprobs"]
            assert [t["finish_reason"] for t in got["turns"]] == [t["finish_reason"] for t in ref["turns"]]
        states = [await cl.state(i) for i in range(3)]
        # each instance paused once per cycle: relayed once, never relayed back (no loop)
        assert [s["counters"]["pauses"] for s in states] == [cycles] * 3
        assert [s["counters"]["resumes"] for s in states] == [cycles] * 3
        assert sum(s["counters"]["aborts"] for s in states) >= 1

        r = await cl.clients[1].post("/control/weight_version", json={"version": 7})
        assert r.status_code == 200 and r.json()["ok"] and r.json()["weight_version"] == 7, r.text
        assert [(await cl.state(i))["weight_version"] for i in range(3)] == [7, 7, 7]
        # a version older than the receiver's is a 400 there and is relayed nowhere
        assert (await a.post("/control/weight_version", json={"version": 3})).status_code == 400


async def test_a_peer_down_is_207_naming_it(qwen3_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with live_cluster(qwen3_dir, 2, extra_peers=[dead]) as cl:
        a = cl.clients[0]
        r = await a.post("/control/pause", json={"mode": "abort"})
        assert r.status_code == 207, r.text
        body = r.json()
        assert body["ok"] is False and body["failed_instances"] == [dead]
        assert body["instances"][cl.urls[1]]["ok"] is True
        assert body["instances"][dead]["ok"] is False and body["instances"][dead]["error"]
        assert body["failed"] == []  # this instance's engines all paused
        assert (await cl.state(0))["paused"] and (await cl.state(1))["paused"]
        r = await a.post("/control/resume", json={})
        assert r.status_code == 207 and r.json()["failed_instances"] == [dead], r.text
        assert not (await cl.state(0))["paused"] and not (await cl.state(1))["paused"]
        r = await a.post("/control/weight_version", json={"version": 2})
        assert r.status_code == 207 and r.json()["failed_instances"] == [dead], r.text
        assert (await cl.state(1))["weight_version"] == 2


async def test_relayed_requests_are_not_relayed_again(qwen3_dir: Path) -> None:
    async with live_cluster(qwen3_dir, 2) as cl:
        b = cl.clients[1]
        r = await b.post("/control/pause", json={"mode": "keep"}, headers={RELAYED_HEADER: "1"})
        assert r.status_code == 200 and "instances" not in r.json(), r.text
        assert (await cl.state(1))["paused"] and not (await cl.state(0))["paused"]
        assert (await b.post("/control/resume", json={}, headers={RELAYED_HEADER: "1"})).status_code == 200
        assert (await cl.state(0))["counters"]["pauses"] == 0


async def test_auth_is_enforced_on_relayed_requests(qwen3_dir: Path) -> None:
    async with live_cluster(qwen3_dir, 2, tokens=["token-a", "token-b"]) as cl:
        a, b = cl.clients
        # the marker grants nothing: a relayed request without the admin token is refused
        async with httpx.AsyncClient(base_url=cl.urls[1]) as anon:
            r = await anon.post("/control/pause", json={}, headers={RELAYED_HEADER: "1"})
            assert r.status_code == 401, r.text
        # A relays with its own admin token, which B does not accept: B is named, not paused
        r = await a.post("/control/pause", json={"mode": "abort"})
        assert r.status_code == 207, r.text
        failed = r.json()["instances"][cl.urls[1]]
        assert r.json()["failed_instances"] == [cl.urls[1]] and failed["status"] == 401, failed
        assert not (await cl.state(1))["paused"]
        assert (await a.post("/control/resume", json={})).status_code == 207
    async with live_cluster(qwen3_dir, 2, tokens=["shared", "shared"]) as cl:
        r = await cl.clients[0].post("/control/pause", json={"mode": "abort"})
        assert r.status_code == 200 and r.json()["ok"], r.text
        assert (await cl.state(1))["paused"]
        assert (await cl.clients[0].post("/control/resume", json={})).status_code == 200


async def test_engines_added_and_removed_on_every_instance(qwen3_dir: Path) -> None:
    async with live_cluster(qwen3_dir, 2) as cl, running_sim("vllm", str(qwen3_dir), seed=5) as second:
        a, b = cl.clients

        async def urls(c: httpx.AsyncClient) -> list[str]:
            return sorted(e["base_url"] for e in (await c.get("/engines")).json()["engines"])

        r = await a.post("/engines", json={"url": f"vllm={second}"})
        assert r.status_code == 201 and r.json()["ok"], r.text
        assert r.json()["instances"][cl.urls[1]]["status"] == 201
        assert await urls(a) == await urls(b) == sorted([cl.engines[0], second])
        # adding it again anywhere is success everywhere (already there)
        r = await b.post("/engines", json={"url": f"vllm={second}/"})
        assert r.status_code == 200 and r.json()["existing"] is True, r.text
        assert r.json()["instances"][cl.urls[0]] == {"ok": True, "status": 200, "report": r.json()["instances"][
            cl.urls[0]]["report"]} and r.json()["instances"][cl.urls[0]]["report"]["existing"] is True
        assert len(await urls(a)) == 2
        # removal by this instance's id reaches the peer by URL, whatever its id there
        eid = next(e["id"] for e in (await a.get("/engines")).json()["engines"] if e["base_url"] == second)
        assert (await a.delete(f"/engines/{eid}")).status_code == 204
        assert await urls(a) == await urls(b) == [cl.engines[0]]
        assert (await a.delete(f"/engines/{eid}")).status_code == 404
        # a peer that no longer has it counts as removed there
        r = await b.post("/engines", json={"url": f"vllm={second}"}, headers={RELAYED_HEADER: "1"})
        assert r.status_code == 201
        eid_b = r.json()["id"]
        assert (await b.delete(f"/engines/{eid_b}")).status_code == 204
        assert await urls(a) == await urls(b) == [cl.engines[0]]


async def test_engines_removed_by_url_whatever_their_id_on_each_instance(qwen3_dir: Path) -> None:
    """Behind a proxy the trainer cannot pick the instance that reads an engine id, and
    ids differ between instances (each numbers its own). `DELETE /engines?url=` names
    the engine the same way everywhere."""
    async with live_cluster(qwen3_dir, 2) as cl, running_sim("vllm", str(qwen3_dir), seed=5) as second, \
            running_sim("vllm", str(qwen3_dir), seed=6) as third:
        a, b = cl.clients
        # b learns `third` first, a `second` first: their ids differ per instance
        assert (await b.post("/engines", json={"url": f"vllm={third}"}, headers={RELAYED_HEADER: "1"})).status_code == 201
        assert (await a.post("/engines", json={"url": f"vllm={second}"})).status_code == 201
        assert (await a.post("/engines", json={"url": f"vllm={third}"})).status_code == 201

        def ids(view: dict) -> dict[str, str]:
            return {e["base_url"]: e["id"] for e in view["engines"]}

        ids_a, ids_b = ids((await a.get("/engines")).json()), ids((await b.get("/engines")).json())
        assert ids_a[second] != ids_b[second]
        r = await b.delete("/engines", params={"url": f"vllm={second}/"})
        assert r.status_code == 204, r.text
        for c in (a, b):
            assert sorted(ids((await c.get("/engines")).json())) == sorted([cl.engines[0], third])
        # gone everywhere: a 404; an instance that still has it makes it a removal
        assert (await a.delete("/engines", params={"url": second})).status_code == 404
        assert (await a.delete("/engines", params={"url": third}, headers={RELAYED_HEADER: "1"})).status_code == 204
        assert (await a.delete("/engines", params={"url": third})).status_code == 204  # b still had it
        assert third not in ids((await b.get("/engines")).json())
        assert (await a.delete("/engines", params={"url": "nope=http://x"})).status_code == 400


async def test_a_lora_wait_pause_that_cannot_drain_on_a_peer_is_a_504(qwen3_dir: Path) -> None:
    """A per-adapter wait pause whose drain times out on another instance is the 504 it is
    on the instance asked (it used to merge into a 207 with the peer's failure inside)."""
    from session_server.ops.harness import live_apps

    async with live_cluster(qwen3_dir, 2, pause_drain_timeout_s=0.2) as cl:
        a, _ = cl.clients
        peer = live_apps[cl.urls[1]].state.ctx.control
        with peer.track_flight("r-lora", engine=cl.engines[0], lora="adapter-a"):  # a turn that does not end
            r = await a.post("/control/pause", json={"mode": "wait", "lora": "adapter-a"})
        assert r.status_code == 504, r.text
        body = r.json()
        assert body["error"]["type"] == "drain_timeout" and cl.urls[1] in body["error"]["message"], body
        assert (await a.post("/control/resume", json={"lora": "adapter-a"})).status_code == 200
