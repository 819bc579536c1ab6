"""`POST /samples` through `session-server cluster`: one URL for a batch of every instance's sessions.

The batch lands on one instance (the proxy's pick), which serves its own sessions and
gathers the others from their owners: the payload, in each format, holds exactly the
samples each owner returns for its own sessions, in the batch's order, streamed;
`close` closes every session on its owner; an unknown session or a dead owner is a
clear error with nothing read or closed, never a partial 200. Skipped only when
`haproxy` is absent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx

from session_server.sim import running_sim
from trajectory.sample_formats import (
    load_samples_json,
    load_samples_npz,
    load_samples_safetensors,
    samples_to_json,
)

from .test_cluster import needs_haproxy, running_cluster

LOADERS = {"json": load_samples_json, "npz": load_samples_npz, "safetensors": load_samples_safetensors}


async def _sessions(http: httpx.AsyncClient, per_instance: int, instances: int) -> list[str]:
    """Sessions through the proxy until each instance holds `per_instance`, each with a turn
    and a reward and its turn's; interleaved by instance so the batch order crosses instances."""
    on: dict[str, list[str]] = {}
    for _ in range(200):
        sid = (await http.post("/sessions", json={"metadata": {"task": "t"}})).json()["session_id"]
        mine = on.setdefault(sid.split(".")[0], [])
        if len(mine) < per_instance:
            mine.append(sid)
        if len(on) == instances and all(len(v) == per_instance for v in on.values()):
            break
    assert len(on) == instances and all(len(v) == per_instance for v in on.values()), on
    order = [sid for group in zip(*on.values(), strict=True) for sid in group]
    for k, sid in enumerate(order):
        r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": f"task {k}"}], "max_tokens": 12},
                            headers={"x-tito-agent": "explorer" if k % 2 else "main"})  # lineage, per session
        assert r.status_code == 200, r.text
        r = await http.post(f"/sessions/{sid}/reward",
                            json={"reward": k / 10, "turn_rewards": [{"turn": 0, "reward": -k / 10}]})
        assert r.status_code == 200, r.text
    return order


async def _batch(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[httpx.Response, bytes, int]:
    """POST /samples streamed: the response, its body and how many chunks it came in."""
    async with http.stream("POST", "/samples", json=body) as r:
        chunks = [c async for c in r.aiter_raw()]
    return r, b"".join(chunks), len(chunks)


@needs_haproxy
async def test_a_batch_of_every_instances_sessions_through_the_proxy_is_what_each_owner_returns(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=3) as engine, \
            running_cluster(qwen3, engine, 3, tmp_path, "--no-restart") as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=120) as http, \
            httpx.AsyncClient(timeout=60) as direct:
        url_of = {name: url for name, (_, url) in cl.workers.items()}
        order = await _sessions(http, 2, 3)
        for fmt, load in LOADERS.items():
            # what each owner returns for its own session, asked directly
            want = []
            for sid in order:
                r = await direct.post(f"{url_of[sid.split('.')[0]]}/samples", json={"session_ids": [sid], "format": fmt})
                assert r.status_code == 200, r.text
                want += load(r.content)
            r, raw, _ = await _batch(http, {"session_ids": order, "format": fmt})
            assert r.status_code == 200, raw[:500]
            assert r.headers.get("transfer-encoding") == "chunked", r.headers  # streamed, not buffered
            got = load(raw)
            assert [s.metadata["session_id"] for s in got] == order
            assert [s.turn_rewards for s in got] == [[-k / 10] for k in range(len(order))]  # per turn, gathered
            assert samples_to_json(got) == samples_to_json(want), fmt  # every field, bit-exact
            # the agent filter reaches every owner: only the sub-agent's sessions, its turns labelled
            r, raw, _ = await _batch(http, {"session_ids": order, "format": fmt, "agent": "explorer"})
            assert r.status_code == 200, raw[:500]
            picked = load(raw)
            assert [s.metadata["session_id"] for s in picked] == order[1::2], fmt
            assert {lin["agent"] for s in picked for lin in s.turn_lineage} == {"explorer"}
        # close: every session is closed on its owner (a tombstone: 410, the cluster journals)
        r, raw, chunks = await _batch(http, {"session_ids": order, "format": "json", "close": True})
        assert r.status_code == 200 and len(load_samples_json(raw)) == len(order), raw[:500]
        assert chunks >= 2  # the head, then the sessions as they are read
        for sid in order:
            gone = await direct.get(f"{url_of[sid.split('.')[0]]}/sessions/{sid}")
            assert gone.status_code == 410 and gone.json()["error"]["type"] == "session_gone", (sid, gone.text)

        # errors are answered whole, before a byte, and nothing is read or closed
        fresh = await _sessions(http, 1, 3)
        unknown = fresh[1].split(".")[0] + "." + "0" * 32
        r, raw, _ = await _batch(http, {"session_ids": [*fresh, unknown], "close": True})
        assert r.status_code == 404, raw
        err = httpx.Response(404, content=raw).json()["error"]
        assert err["type"] == "session_not_found" and unknown in err["message"], err
        nowhere = "w9." + "0" * 32
        r, raw, _ = await _batch(http, {"session_ids": [*fresh, nowhere]})
        assert r.status_code == 404 and b"not in this cluster" in raw, raw
        for sid in fresh:
            assert (await http.get(f"/sessions/{sid}")).status_code == 200
        victim = fresh[2].split(".")[0]
        os.kill(cl.workers[victim][0], signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:  # until HAProxy marks it down (a connection it had open may just drop)
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"/sessions/{fresh[2]}")).status_code == 503:
                    break
            assert loop.time() < deadline
            await asyncio.sleep(0.2)
        for _ in range(3):  # whichever live instance the proxy picks
            r, raw, _ = await _batch(http, {"session_ids": fresh, "close": True})
            assert r.status_code == 503, raw
            err = httpx.Response(503, content=raw).json()["error"]
            assert err["type"] == "instance_unavailable" and victim in err["message"], err
        for sid in fresh[:2]:  # the live owners' sessions were not closed
            assert (await http.get(f"/sessions/{sid}")).status_code == 200
