"""Through HTTP: the staleness bound per turn (`max_weight_lag`).

A session (`POST /sessions {"max_weight_lag": K}`) or one request may bound how many
weight versions a turn's tokens span; a turn that would span more is ended at the
update (finish `abort`, flagged `stale_bound`, its partial tokens kept with their
versions) instead of being resubmitted, and counted in `/metrics`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from trajectory.sample_formats import load_samples_json

from ..stack import Stack, live_stack, metric_value, until_in_flight

MSGS = [{"role": "user", "content": "Refactor the config loader and run the tests."}]
BODY = {"messages": MSGS, "max_tokens": 200}
# ~120 tokens at 4 ms each: still sampling through every update a test makes, then a stop
LONG = " ".join(f"step {i} of the refactor reads the loader, moves one function and reruns the tests." for i in range(7))


async def _set_version(st: Stack, version: int) -> None:
    async with httpx.AsyncClient() as sim:
        assert (await sim.post(f"{st.engines[0]}/sim/weight_version", json={"version": version})).status_code == 200
    assert (await st.http.post("/control/weight_version", json={"version": version})).status_code == 200


async def _update(st: Stack, version: int, mode: str = "abort") -> None:
    """A weight update as a trainer does it: pause, update engine and server, resume."""
    assert (await st.http.post("/control/pause", json={"mode": mode})).json()["ok"]
    await _set_version(st, version)
    assert (await st.http.post("/control/resume", json={})).status_code == 200


async def _long_session(st: Stack, **body: Any) -> str:
    """A session whose answer is LONG (scripted): its turn outlasts the updates made during it."""
    sid = await st.session(**body)
    await st.script(sid, {"content": LONG})
    return sid


async def _chat_through(st: Stack, sid: str, versions: list[int], body: dict[str, Any] | None = None,
                        gap_s: float = 0.04) -> httpx.Response:
    """One chat with a weight update to each of `versions` while it runs."""
    chat = asyncio.create_task(st.chat(sid, body or BODY))
    await until_in_flight(st, sid)
    for v in versions:
        await asyncio.sleep(gap_s)
        await _update(st, v)
    return await chat


async def _turn(st: Stack, sid: str) -> dict[str, Any]:
    traj = await st.trajectory(sid)
    return dict(traj["branches"][0]["turns"][-1])


async def _reference(st: Stack) -> dict[str, Any]:
    sid = await _long_session(st)
    assert (await st.chat(sid, BODY)).status_code == 200
    return await _turn(st, sid)


def _versions(turn: dict[str, Any]) -> list[str]:
    return [str(v) for _, _, v in turn["weight_spans"]]


async def test_k1_ends_the_turn_at_the_first_update(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4) as st:
        await _set_version(st, 1)
        sid = await _long_session(st, max_weight_lag=1)
        r = await _chat_through(st, sid, [2])
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "abort"  # as SGLang's own OpenAI server says it
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]  # the parsed partial
        turn = await _turn(st, sid)
        log = await st.engine_log()
        assert len(log) == 1 and log[0]["finish_reason"] == "abort"  # never resubmitted
        n = turn["output_end"] - turn["output_start"]
        assert n == len(log[0]["output_ids"]) == r.json()["usage"]["completion_tokens"] > 0
        assert turn["finish_reason"] == "abort" and _versions(turn) == ["1"]
        assert turn["extra"]["stale_bound"] == {"max_weight_lag": 1, "versions": [1], "next_version": 2}
        traj = (await st.trajectory(sid))["branches"][0]
        out = slice(turn["output_start"], turn["output_end"])
        assert traj["token_ids"][out] == log[0]["output_ids"] and all(traj["loss_mask"][out])
        # visible in the session view, the samples and the metrics
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["control"]["ended_stale"] == 1
        notes = [d for d in view["diagnostics"] if d["kind"] == "stale_bound"]
        assert [(d["turn"], d["max_weight_lag"], d["versions"]) for d in notes] == [(0, 1, [1])]
        samples = load_samples_json((await st.http.get(f"/sessions/{sid}/samples", params={"format": "json"})).content)
        assert samples[0].status == "aborted"
        assert samples[0].diagnostics[-1]["stale_bound"]["max_weight_lag"] == 1
        metrics = (await st.http.get("/metrics")).text
        assert metric_value(metrics, "tito_turns_ended_stale_total") == 1
        assert (await st.http.get("/control/state")).json()["counters"]["turns_ended_stale"] == 1
        # the agent goes on: its next turn runs under the new version
        msgs = [*MSGS, choice["message"], {"role": "user", "content": "Go on."}]
        r2 = await st.chat(sid, {"messages": msgs, "max_tokens": 16})
        assert r2.status_code == 200, r2.text
        assert _versions(await _turn(st, sid)) == ["2"]


async def test_k2_resubmits_once_then_ends_at_the_second_update(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4) as st:
        await _set_version(st, 1)
        sid = await _long_session(st, max_weight_lag=2)
        r = await _chat_through(st, sid, [2, 3])
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort", r.text
        turn = await _turn(st, sid)
        log = await st.engine_log()
        assert len(log) == 2  # resubmitted after the first update only
        assert _versions(turn) == ["1", "2"]
        assert turn["extra"]["stale_bound"]["next_version"] == 3
        out = (await st.trajectory(sid))["branches"][0]["token_ids"][turn["output_start"]:turn["output_end"]]
        assert out == log[0]["output_ids"] + log[1]["output_ids"]


async def test_unbounded_resubmits_through_every_update(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4) as st:
        await _set_version(st, 1)
        ref = await _reference(st)
        sid = await _long_session(st)
        r = await _chat_through(st, sid, [2, 3, 4], gap_s=0.03)
        assert r.status_code == 200, r.text
        turn = await _turn(st, sid)
        assert turn["finish_reason"] == ref["finish_reason"] != "abort"
        assert "stale_bound" not in turn["extra"] and len(set(_versions(turn))) >= 3
        metrics = (await st.http.get("/metrics")).text
        assert metric_value(metrics, "tito_turns_ended_stale_total") == 0


async def test_an_update_before_the_first_token_resubmits(qwen3_dir: Path) -> None:
    # a slow prefill: the pause aborts the request before it sampled anything
    async with live_stack(qwen3_dir, latency_ms=4, request_latency_ms=300) as st:
        await _set_version(st, 1)
        sid = await st.session(max_weight_lag=1)
        r = await _chat_through(st, sid, [2], gap_s=0.05)
        assert r.status_code == 200, r.text
        turn = await _turn(st, sid)
        log = await st.engine_log()
        assert [len(e["output_ids"]) for e in log][:1] == [0] and len(log) == 2
        assert turn["finish_reason"] != "abort" and _versions(turn) == ["2"]
        assert "stale_bound" not in turn["extra"]


async def test_the_request_overrides_the_session(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4) as st:
        await _set_version(st, 1)
        loose = await _long_session(st, max_weight_lag=1)
        r = await _chat_through(st, loose, [2], body={**BODY, "max_weight_lag": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] != "abort", r.text
        assert _versions(await _turn(st, loose)) == ["1", "2"]
        strict = await _long_session(st)
        r = await _chat_through(st, strict, [3], body={**BODY, "max_weight_lag": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort", r.text
        assert _versions(await _turn(st, strict)) == ["2"]


async def test_invalid_bounds_are_400_in_the_envelope(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        for bad in (0, -1, 1.5, "2", True):
            r = await st.http.post("/sessions", json={"max_weight_lag": bad})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", (bad, r.text)
        sid = await st.session(max_weight_lag=3)
        for bad in (0, "1", 2.5, False):
            r = await st.chat(sid, {**BODY, "max_weight_lag": bad})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", (bad, r.text)
            r = await st.http.post(f"/sessions/{sid}/v1/messages",
                                   json={"messages": MSGS, "max_tokens": 8, "max_weight_lag": bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (bad, r.text)  # its envelope
            r = await st.http.post(f"/sessions/{sid}/v1/responses",
                                   json={"input": "hi", "max_output_tokens": 8, "max_weight_lag": bad})
            assert r.status_code == 400, (bad, r.text)
        # accepted in every dialect
        r = await st.http.post(f"/sessions/{sid}/v1/messages", json={"messages": MSGS, "max_tokens": 8, "max_weight_lag": 1})
        assert r.status_code == 200, r.text
        r = await st.http.post(f"/sessions/{sid}/v1/responses", json={"input": "hi", "max_output_tokens": 8, "max_weight_lag": 1})
        assert r.status_code == 200, r.text


async def test_anthropic_and_responses_report_the_cut_turn_as_incomplete(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4) as st:
        await _set_version(st, 1)
        sid = await _long_session(st, max_weight_lag=1)
        chat = asyncio.create_task(st.http.post(f"/sessions/{sid}/v1/messages",
                                                json={"messages": MSGS, "max_tokens": 200}))
        await until_in_flight(st, sid)
        await asyncio.sleep(0.04)
        await _update(st, 2)
        r = await chat
        assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text
        sid = await _long_session(st, max_weight_lag=1)
        resp = asyncio.create_task(st.http.post(f"/sessions/{sid}/v1/responses",
                                                json={"input": MSGS[0]["content"], "max_output_tokens": 200}))
        await until_in_flight(st, sid)
        await asyncio.sleep(0.04)
        await _update(st, 3)
        r = await resp
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "incomplete" and r.json()["incomplete_details"] == {"reason": "max_output_tokens"}
