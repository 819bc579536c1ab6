"""A stop-string turn through a real `session-server cluster` (HAProxy, 3 instances, one
engine) cut by a pause: it commits the uninterrupted turn.

The simulated SGLang engine holds the turn on the step that completes the client's stop
string (`hold_on_stop`: that step then comes back `abort`, SGLang checking its abort flag
first) or on the step before it (`hold_before_stop`: the string's first part is in the
kept partial, its last token in the resubmission, whose own output the engine matches
alone). The pause is sent to the proxy while the turn is held; after resume the turn
must commit exactly the tokens, logprobs and finish of the same turn never paused.
Skipped only when `haproxy` is absent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

from session_server.sim import running_sim
from trajectory.codec.probe import decode_text

from .test_cluster import needs_haproxy, running_cluster

TASK = "Refactor the config loader and run the tests."


async def _turn(http: httpx.AsyncClient, stop: list[str] | None) -> tuple[dict[str, Any], str, str | None]:
    """One chat turn in a new session through the proxy: (its branch, session id, finish)."""
    made = (await http.post("/sessions", json={})).json()
    agent = AsyncOpenAI(base_url=made["base_url"], api_key=made["api_key"], max_retries=0, timeout=120)
    try:
        resp = await agent.chat.completions.create(
            model="m", messages=[{"role": "user", "content": TASK}], max_tokens=64, logprobs=True,
            stop=stop)
    finally:
        await agent.close()
    r = await http.get(f"/sessions/{made['session_id']}/trajectory")
    assert r.status_code == 200, r.text
    (branch,) = r.json()["branches"]
    return branch, made["session_id"], resp.choices[0].finish_reason


async def _held(engine: str, direct: httpx.AsyncClient) -> None:
    for _ in range(2000):
        if (await direct.get(f"{engine}/sim/held")).json()["held"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the turn never reached its stop step")


@needs_haproxy
async def test_a_stop_string_turn_cut_by_a_pause_commits_the_uninterrupted_turn(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, load_tokenizer: Any,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]
    tok = load_tokenizer("qwen3")
    async with running_sim("sglang", str(qwen3), seed=3, latency_ms=2) as engine, \
            running_cluster(qwen3, engine, 3, tmp_path) as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=120) as http, \
            httpx.AsyncClient(timeout=30) as direct:
        free, _, _ = await _turn(http, None)
        (turn,) = free["turns"]
        out = free["token_ids"][turn["output_start"]:turn["output_end"]]
        stop = decode_text(tok, out[10:13])[1:]  # three tokens' text, from inside the first
        assert len(stop.strip()) >= 3, stop
        ref, _, ref_finish = await _turn(http, [stop])
        assert ref_finish == "stop" and len(ref["token_ids"]) < len(free["token_ids"])
        for fault in ("hold_on_stop", "hold_before_stop"):
            assert (await direct.post(f"{engine}/sim/faults", json={"kind": fault})).status_code == 200
            chat = asyncio.create_task(_turn(http, [stop]))
            await _held(engine, direct)
            r = await http.post("/control/pause", json={"mode": "abort"})
            assert r.status_code == 200 and r.json()["ok"], r.text
            assert (await http.post("/control/resume", json={})).status_code == 200
            got, sid, finish = await chat
            for key in ("token_ids", "logprobs", "loss_mask"):
                assert got[key] == ref[key], f"{fault}: {key} differs from the uninterrupted turn"
            assert finish == "stop" and got["turns"][0]["finish_reason"] == ref["turns"][0]["finish_reason"]
            view = (await http.get(f"/sessions/{sid}")).json()
            # the pause really cut the turn: on the stop step it ends there, before it it resubmits
            assert view["control"]["aborts"] == (0 if fault == "hold_on_stop" else 1), (fault, view["control"])
            assert view["control"]["resubmits"] == (0 if fault == "hold_on_stop" else 1), (fault, view["control"])
        aborted = (await direct.get(f"{engine}/sim/aborts")).json()["aborted"]
        assert len(aborted) == 2, aborted

