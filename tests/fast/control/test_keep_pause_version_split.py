"""A `keep` pause across a weight update on SGLang, which reports one version per request
(read at its end): a streamed turn is split exactly where the update took effect, from
the tokens the server had received before the engines resumed; a turn not streamed has
no such knowledge and is stamped with SGLang's one version, whole (docs/engines.md).

The simulated engine logs the version each token was really sampled with
(`version_spans` in `GET /sim/requests`), the truth the committed spans are held to."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.sim.engine import EngineCore

from ..stack import Stack, live_stack, until_in_flight

MSGS = [{"role": "user", "content": "Refactor the config loader and run the tests."}]
LONG = " ".join(f"step {i} of the refactor reads the loader, moves one function and reruns the tests." for i in range(40))


async def _streamed_chat(st: Stack, sid: str, body: dict[str, Any]) -> int:
    """A streamed chat turn; how many content/reasoning chunks it showed."""
    chunks = 0
    async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), line
                chunks += 1
    return chunks


async def _keep_paused_turn(st: Stack, stream: bool) -> tuple[list[tuple[int, int, int]], list[list[Any]]]:
    """One turn frozen by a `keep` pause while the version goes 1 -> 2: (the committed
    spans relative to the turn's output, the engine's true per-token versions)."""
    sid = await st.session()
    async with httpx.AsyncClient() as sim:  # an answer longer than the turn's budget: still sampling at the pause
        r = await sim.post(f"{st.engines[0]}/sim/script", json={"turns": [{"content": LONG}], "session": sid})
        assert r.status_code == 200, r.text
    body = {"model": "m", "messages": MSGS, "max_tokens": 160}
    chat = asyncio.create_task(_streamed_chat(st, sid, body) if stream else st.chat(sid, body))
    await until_in_flight(st, sid)
    await asyncio.sleep(0.15)  # some tokens sampled under version 1
    assert (await st.http.post("/control/pause", json={"mode": "keep"})).json()["ok"]
    await asyncio.sleep(0.05)
    r = await st.http.post("/control/weight_version", json={"version": 2})  # pushed to the engine too
    assert r.status_code == 200 and r.json()["ok"], r.text
    assert (await st.http.post("/control/resume", json={})).json()["ok"]
    got = await chat
    if not stream:
        assert got.status_code == 200, got.text
    (branch,) = (await st.trajectory(sid))["branches"]
    (turn,) = branch["turns"]
    rel = [(s - turn["output_start"], e - turn["output_start"], v) for s, e, v in turn["weight_spans"]]
    async with httpx.AsyncClient() as sim:
        log = (await sim.get(f"{st.engines[0]}/sim/requests")).json()
    entry = log[-1]  # one engine request: frozen, never resubmitted
    assert entry["output_ids"] == branch["token_ids"][turn["output_start"]:turn["output_end"]]
    return rel, entry["version_spans"]


async def test_a_streamed_keep_paused_turn_is_split_where_the_update_took_effect(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "sglang", latency_ms=4) as st:
        assert (await st.http.post("/control/weight_version", json={"version": 1})).json()["ok"]
        spans, truth = await _keep_paused_turn(st, stream=True)
        assert [v for _, _, v in spans] == [1, 2], spans
        assert [[s, e, int(v)] for s, e, v in truth] == [list(sp) for sp in spans]  # exactly the engine's
        assert 0 < spans[0][1] < spans[1][1]

        # not streamed: the server saw no token arrive, SGLang's one version stamps it whole
        assert (await st.http.post("/control/weight_version", json={"version": 1, "force": True})).json()["ok"]
        spans, truth = await _keep_paused_turn(st, stream=False)
        assert [int(v) for _, _, v in truth] == [1, 2] and [v for _, _, v in spans] == [2], (spans, truth)


async def test_a_vllm_reporting_only_its_unset_version_is_split_like_sglang(
        qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM without dev mode reports per-token spans of `"default"` only: they say nothing,
    so a streamed keep-paused turn is split by the server as on SGLang."""

    def forget(self: EngineCore, raw: bytes, *, honours_abort_all: bool) -> tuple[dict[str, Any], int]:
        # the engine forgets every version pushed to it (as after a restart); before, a
        # task reset it every 2 ms, and a token sampled inside those 2 ms said "2"
        return {"success": True, "new_version": self.weight_version}, 200

    monkeypatch.setattr(EngineCore, "set_weight_version", forget)
    async with live_stack(qwen3_dir, "vllm", latency_ms=4) as st:
        assert (await st.http.post("/control/weight_version", json={"version": 1})).json()["ok"]
        spans, truth = await _keep_paused_turn(st, stream=True)
        assert {v for _, _, v in truth} == {"default"}
        assert [v for _, _, v in spans] == [1, 2] and 0 < spans[0][1] < spans[1][1], spans
