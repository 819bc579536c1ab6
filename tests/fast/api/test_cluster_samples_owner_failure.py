"""`POST /samples` across in-process instances: what happens when an owner fails mid-batch.

The batch was checked by every owner, headers (200) and the first sessions are sent;
then an owner fails. The stream is cut before the payload ends, so the client sees a
broken transfer, never a complete-looking partial batch."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from session_server.api import samples_cluster
from session_server.errors import InstanceUnavailable

from ..control.test_control_across_instances import live_cluster


async def test_an_owner_failing_mid_batch_cuts_the_stream_never_a_partial_200(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with live_cluster(qwen3_dir, 2) as cl:
        a, b = cl.clients
        sids = []
        for http in (a, b, a, b):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            assert r.status_code == 200, r.text
            sids.append(sid)
        r = await a.post("/samples", json={"session_ids": sids})  # the whole batch, gathered by a
        assert r.status_code == 200 and [s["metadata"]["session_id"] for s in r.json()["samples"]] == sids

        real = samples_cluster.Peers.samples
        calls = 0

        async def dies_second(self: samples_cluster.Peers, ctx: object, sid: str) -> object:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise InstanceUnavailable("the owner died mid-batch")
            return await real(self, ctx, sid)  # type: ignore[arg-type]

        monkeypatch.setattr(samples_cluster.Peers, "samples", dies_second)
        with pytest.raises(httpx.RemoteProtocolError):
            async with a.stream("POST", "/samples", json={"session_ids": sids}) as resp:
                assert resp.status_code == 200  # sent before the failure: the body must not end cleanly
                async for _ in resp.aiter_raw():
                    pass
        assert calls == 2


async def test_a_client_check_of_a_batch_spanning_instances_validates_it_everywhere_and_reads_nothing(
    qwen3_dir: Path,
) -> None:
    """`?check=1` from a client means what it means on one instance: the whole batch is
    validated (here and on its owners), nothing is streamed or closed, an unknown id on
    another instance is its 404."""
    async with live_cluster(qwen3_dir, 2) as cl:
        a, b = cl.clients
        sids = []
        for http in (a, b):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            assert r.status_code == 200, r.text
            sids.append(sid)
        checked = await a.post("/samples?check=1", json={"session_ids": sids, "close": True})
        assert checked.status_code == 200 and checked.json() == {"ok": True, "sessions": 2}, checked.text
        for http, sid in zip((a, b), sids, strict=True):  # nothing was closed
            assert (await http.get(f"/sessions/{sid}")).status_code == 200
        prefix = sids[1].rsplit(".", 1)[0]
        unknown = await a.post("/samples?check=1", json={"session_ids": [sids[0], f"{prefix}.{'0' * 32}"]})
        assert unknown.status_code == 404, unknown.text
