"""Weight-update control plane through the HTTP server.

A turn interrupted by pauses must commit exactly the tokens an uninterrupted
turn produces (the simulated engine is deterministic in its context), with weight
versions per span; a per-LoRA pause leaves other adapters flowing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from session_server.ops.harness import live_apps

from ..stack import live_stack, metric_value, until_in_flight

MSGS = [{"role": "user", "content": "Refactor the config loader and run the tests."}]


def _branch(traj: dict[str, Any]) -> dict[str, Any]:
    assert len(traj["branches"]) == 1
    return traj["branches"][0]


async def test_pauses_mid_turn_commit_the_uninterrupted_tokens(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4) as st:
        ref_sid = await st.session()
        assert (await st.chat(ref_sid, {"messages": MSGS, "max_tokens": 200})).status_code == 200
        ref = _branch(await st.trajectory(ref_sid))

        for mode in ("abort", "keep", "wait"):
            sid = await st.session()
            chat = asyncio.create_task(st.chat(sid, {"messages": MSGS, "max_tokens": 200}))
            await until_in_flight(st, sid)
            for _ in range(3):
                await asyncio.sleep(0.03)
                r = await st.http.post("/control/pause", json={"mode": mode})
                assert r.status_code == 200 and r.json()["ok"], r.text
                assert (await st.http.get("/control/state")).json()["paused"] is True
                await asyncio.sleep(0.03)
                assert (await st.http.post("/control/resume", json={})).status_code == 200
            r = await chat
            assert r.status_code == 200, f"{mode}: {r.text}"
            got = _branch(await st.trajectory(sid))
            for key in ("token_ids", "loss_mask", "logprobs"):
                assert got[key] == ref[key], f"{mode}: {key} differs from the uninterrupted turn"
            assert got["turns"][0]["finish_reason"] == ref["turns"][0]["finish_reason"], mode
            if mode == "abort":
                view = (await st.http.get(f"/sessions/{sid}")).json()
                assert view["control"]["aborts"] >= 1 and view["control"]["resubmits"] >= 1
        metrics = (await st.http.get("/metrics")).text
        assert metric_value(metrics, "tito_turn_aborts_total") >= 1  # the abort-mode pauses
        assert metric_value(metrics, "tito_turn_resubmits_total") >= 1


async def test_an_abort_pause_records_the_output_offset_where_the_engine_stopped_and_the_resubmit_began(
        qwen3_dir: Path) -> None:
    """No weight update: only the recorded segments say where the pause cut the turn."""
    script = [{"content": "step " * 150}]  # ~150 tokens at 4 ms each: the pause lands mid-turn
    async with live_stack(qwen3_dir, latency_ms=4, script=script) as st, httpx.AsyncClient() as sim:
        sid = await st.session()
        chat = asyncio.create_task(st.chat(sid, {"messages": MSGS, "max_tokens": 200}))
        await until_in_flight(st, sid)
        await asyncio.sleep(0.08)
        assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
        await asyncio.sleep(0.03)
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        assert (await chat).status_code == 200
        log = (await sim.get(f"{st.engines[0]}/sim/requests")).json()
        line = _branch(await st.trajectory(sid))
    turn = line["turns"][0]
    assert [r["finish_reason"] for r in log][0] == "abort" and len(log) == 2, log
    cut = len(log[0]["output_ids"])
    n = turn["output_end"] - turn["output_start"]
    assert 0 < cut < n
    engine = turn["engine"]
    assert turn["extra"]["segments"] == [
        {"start": 0, "end": cut, "ended": "abort", "request_id": log[0]["rid"], "engine": engine},
        {"start": cut, "end": n, "ended": log[1]["finish_reason"], "request_id": log[1]["rid"], "engine": engine},
    ]
    ids = line["token_ids"][turn["output_start"]:turn["output_end"]]
    assert ids[:cut] == log[0]["output_ids"] and ids[cut:] == log[1]["output_ids"]


async def test_weight_version_spans_across_a_bump_mid_turn(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4) as st:
        assert (await st.http.post("/control/weight_version", json={"version": 1})).status_code == 200
        async with httpx.AsyncClient() as sim:
            await sim.post(f"{st.engines[0]}/sim/weight_version", json={"version": 1})
            sid = await st.session()
            chat = asyncio.create_task(st.chat(sid, {"messages": MSGS, "max_tokens": 200}))
            await until_in_flight(st, sid)
            await asyncio.sleep(0.05)
            assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
            await sim.post(f"{st.engines[0]}/sim/weight_version", json={"version": 2})  # the update
            assert (await st.http.post("/control/weight_version", json={"version": 2})).status_code == 200
            assert (await st.http.post("/control/resume", json={})).status_code == 200
            assert (await chat).status_code == 200
            log = (await sim.get(f"{st.engines[0]}/sim/requests")).json()
        turn = _branch(await st.trajectory(sid))["turns"][0]
        spans = turn["weight_spans"]
        assert [str(v) for _, _, v in spans] == ["1", "2"], spans
        assert spans[0][0] == turn["output_start"] and spans[-1][1] == turn["output_end"]
        assert spans[0][1] == spans[1][0]
        # each segment ran in its weight version's KV namespace; the resubmit after the
        # update got no cache hit from KV computed under version 1
        assert [r["cache_salt"] for r in log] == ["wv-1", "wv-2"]
        assert log[1]["cached_tokens"] == 0
        assert (await st.http.post("/control/weight_version", json={"version": 1})).status_code == 400
        assert (await st.http.post("/control/weight_version", json={"version": True})).status_code == 400
        # the reset path over HTTP: backwards only with force, and the state says so
        r = await st.http.post("/control/weight_version", json={"version": 1, "force": True})
        assert r.status_code == 200 and r.json().get("forced") is True, r.text
        assert (await st.http.get("/control/state")).json()["weight_version"] == 1
        assert (await st.http.post("/control/weight_version", json={"version": 1, "force": "yes"})).status_code == 400


async def test_per_lora_pause_leaves_other_adapters_flowing(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=2) as st:
        a = await st.session(lora="adapter-a")
        b = await st.session(lora="adapter-b")
        assert (await st.http.post("/control/pause", json={"mode": "abort", "lora": "adapter-a"})).json()["ok"]
        chat_a = asyncio.create_task(st.chat(a, {"messages": MSGS, "max_tokens": 64}))
        r_b = await st.chat(b, {"messages": MSGS, "max_tokens": 64})
        assert r_b.status_code == 200, "adapter-b flows while adapter-a is paused"
        await asyncio.sleep(0.1)
        assert not chat_a.done(), "adapter-a waits in the server while paused"
        state = (await st.http.get("/control/state")).json()
        assert "adapter-a" in state["lora_pauses"] and state["paused"] is False
        assert (await st.http.post("/control/resume", json={"lora": "adapter-a"})).status_code == 200
        assert (await chat_a).status_code == 200


async def test_paused_past_deadline_is_503_and_releases(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
        r = await st.chat(sid, {"messages": MSGS, "max_tokens": 32, "timeout_s": 0.3})
        assert r.status_code == 503 and r.json()["error"]["type"] == "paused", r.text
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        assert (await st.chat(sid, {"messages": MSGS, "max_tokens": 32})).status_code == 200
        assert (await st.http.post("/control/pause", json={"mode": "sideways"})).status_code == 400


async def test_pause_storm_under_load_loses_nothing(qwen3_dir: Path) -> None:
    """A bounded version of bench/pause_storm: 40 sessions x 2 turns, 6 abort cycles."""
    async with live_stack(qwen3_dir, latency_ms=2) as st:

        async def episode(sid: str) -> dict[str, Any]:
            msgs: list[dict[str, Any]] = list(MSGS)
            for _ in range(2):
                r = await st.chat(sid, {"messages": msgs, "max_tokens": 120})
                assert r.status_code == 200, r.text
                msg = r.json()["choices"][0]["message"]
                msgs += [{k: v for k, v in msg.items() if v is not None}, {"role": "user", "content": "next"}]
            return _branch(await st.trajectory(sid))

        ref = await episode(await st.session())
        sids = [await st.session() for _ in range(40)]
        stop = asyncio.Event()

        async def storm() -> int:
            cycles = 0
            while not stop.is_set() and cycles < 6:
                await asyncio.sleep(0.04)
                assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
                await asyncio.sleep(0.02)
                assert (await st.http.post("/control/resume", json={})).status_code == 200
                cycles += 1
            return cycles

        storm_task = asyncio.create_task(storm())
        results = await asyncio.gather(*(episode(s) for s in sids))
        stop.set()
        assert await storm_task >= 1
        for got in results:
            assert got["token_ids"] == ref["token_ids"]
            assert got["logprobs"] == ref["logprobs"]
            assert [t["finish_reason"] for t in got["turns"]] == [t["finish_reason"] for t in ref["turns"]]
        state = (await st.http.get("/control/state")).json()
        assert state["counters"]["aborts"] >= 1


async def test_partial_pause_failure_is_207_and_names_the_engine(qwen3_dir: Path) -> None:
    from session_server.ops.harness import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    async with live_stack(qwen3_dir, extra_engines=[f"sglang={dead}"]) as st:
        r = await st.http.post("/control/pause", json={"mode": "abort"})
        assert r.status_code == 207, r.text
        report = r.json()
        assert report["ok"] is False and dead in report["failed"]
        assert report["engines"][st.engines[0]]["ok"] is True
        r = await st.http.post("/control/resume", json={})
        assert r.status_code == 207 and r.json()["failed"] == [dead]
        assert (await st.http.get("/control/state")).json()["paused"] is False
        sid = await st.session()
        assert (await st.chat(sid, {"messages": MSGS, "max_tokens": 32})).status_code == 200


async def test_a_wait_pause_whose_drain_times_out_answers_504_and_pauses_no_engine(qwen3_dir: Path) -> None:
    """A turn longer than the drain timeout: the pause answers 504 drain_timeout naming
    what is left, never 200 ok; the engine was not frozen (the turn finishes, one span,
    the old weights), the gate stays closed until a later wait pause (now drained: 200)
    and a resume."""
    from session_server.ops.harness import live_apps

    async with live_stack(qwen3_dir, latency_ms=15) as st:
        live_apps[st.url].state.ctx.control.drain_timeout_s = 0.3
        assert (await st.http.post("/control/weight_version", json={"version": 1})).status_code == 200
        sid = await st.session()
        chat = asyncio.create_task(st.chat(sid, {"messages": MSGS, "max_tokens": 150}))
        await until_in_flight(st, sid)
        r = await st.http.post("/control/pause", json={"mode": "wait"})
        assert r.status_code == 504, r.text
        body = r.json()
        assert body["error"]["type"] == "drain_timeout" and "1 turn(s) still in flight" in body["error"]["message"]
        assert body["ok"] is False and body["drained"] is False and body["engines_paused"] is False
        assert body["engines"] == {} and body["in_flight"] == 1
        state = (await st.http.get("/control/state")).json()
        assert state["paused"] and state["mode"] == "wait"  # the gate stays closed
        done = await asyncio.wait_for(chat, 30)  # not frozen: the turn runs to its end
        assert done.status_code == 200, done.text
        turn = _branch(await st.trajectory(sid))["turns"][0]
        assert turn["weight_spans"] == [[turn["output_start"], turn["output_end"], 1]], turn
        r = await st.http.post("/control/pause", json={"mode": "wait"})  # nothing left: drained, frozen
        assert r.status_code == 200 and r.json()["ok"] and r.json()["engines_paused"], r.text
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        assert not (await st.http.get("/control/state")).json()["paused"]


async def test_pauses_mid_turn_with_large_replies_fetched_by_the_reply_worker_commit_the_uninterrupted_tokens(
        qwen3_dir: Path) -> None:
    """Every reply carries 1.36 MB of routed experts nobody asked for: after the first,
    the reply worker makes the requests itself (engines/reply_worker.py), and a pause's
    abort and resubmission come out as they do for requests made here."""
    async with live_stack(qwen3_dir, latency_ms=4, padding="floats") as st:
        decoder = live_apps[st.url].state.ctx.decoder
        ref_sid = await st.session()
        assert (await st.chat(ref_sid, {"messages": MSGS, "max_tokens": 120})).status_code == 200
        ref = _branch(await st.trajectory(ref_sid))
        for mode in ("abort", "keep"):
            sid = await st.session()
            chat = asyncio.create_task(st.chat(sid, {"messages": MSGS, "max_tokens": 120}))
            await until_in_flight(st, sid)
            await asyncio.sleep(0.05)
            r = await st.http.post("/control/pause", json={"mode": mode})
            assert r.status_code == 200 and r.json()["ok"], r.text
            assert not chat.done(), f"{mode}: the pause landed after the turn"
            await asyncio.sleep(0.03)
            assert (await st.http.post("/control/resume", json={})).status_code == 200
            fetched = decoder.fetched
            r = await chat
            assert r.status_code == 200, f"{mode}: {r.text}"
            assert decoder.fetched >= fetched >= 1, "the reply worker made none of the requests"
            got = _branch(await st.trajectory(sid))
            for key in ("token_ids", "loss_mask", "logprobs"):
                assert got[key] == ref[key], f"{mode}: {key} differs from the uninterrupted turn"
            view = (await st.http.get(f"/sessions/{sid}")).json()
            if mode == "abort":
                assert view["control"]["aborts"] >= 1 and view["control"]["resubmits"] >= 1
            else:  # frozen in place at the engine: nothing aborted, nothing resubmitted
                assert view["control"]["aborts"] == 0 and view["control"]["resubmits"] == 0
