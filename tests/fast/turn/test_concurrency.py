"""The in-flight gate under concurrency: a chat on a busy session waits for the turn
in flight (bounded; past the bound, or with `busy_wait_s=0`, a 409 that never reaches an
engine); different sessions run in parallel; a delete beats an in-flight commit."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from session_server.context import Settings

from ..stack import CHAT, live_stack, metric_value


async def _until_busy(st, sid: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(400):
        if (await st.http.get(f"/sessions/{sid}")).json()["busy"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the chat never became in flight")


async def test_second_chat_on_busy_session_is_409_and_never_reaches_engine(qwen3_dir: Path) -> None:
    from session_server.context import Settings

    async with live_stack(qwen3_dir, latency_ms=20, settings=Settings(busy_wait_s=0)) as st:
        sid = await st.session()
        first = asyncio.create_task(st.chat(sid))
        await _until_busy(st, sid)
        busy = await st.chat(sid)
        assert busy.status_code == 409
        assert busy.json()["error"]["type"] == "session_busy"
        assert first.done() is False, "the 409 came back while the first turn was still generating"
        assert (await first).status_code == 200
        log = await st.engine_log()
        assert len(log) == 1, "the busy request must not reach the engine"


async def test_different_sessions_run_in_parallel(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=10) as st:
        sids = [await st.session() for _ in range(4)]
        results = await asyncio.gather(*(st.chat(s) for s in sids))
        assert all(r.status_code == 200 for r in results)
        log = await st.engine_log()
    spans = [(r["finished_s"] - r["e2e_s"], r["finished_s"]) for r in log]
    assert len(spans) == 4
    latest_start = max(s for s, _ in spans)
    earliest_end = min(e for _, e in spans)
    assert latest_start < earliest_end, "the engine saw all four turns overlapping"


async def test_delete_during_chat_means_no_commit_and_then_404(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=20) as st:
        sid = await st.session()
        chat = asyncio.create_task(st.chat(sid))
        await _until_busy(st, sid)
        d = await st.http.delete(f"/sessions/{sid}")
        assert d.status_code == 204
        r = await chat
        assert r.status_code == 409
        assert r.json()["error"]["type"] == "session_closed"
        assert (await st.chat(sid)).status_code == 404
        assert (await st.http.get(f"/sessions/{sid}")).status_code == 404


async def test_unknown_session_oversized_body_and_metrics(qwen3_dir: Path) -> None:
    from session_server.context import Settings

    async with live_stack(qwen3_dir, settings=Settings(max_body_bytes=4096)) as st:
        r = await st.chat("0" * 32)
        assert r.status_code == 404 and r.json()["error"]["type"] == "session_not_found"
        sid = await st.session()
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
        r = await st.chat(sid, big)
        assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"
        assert (await st.chat(sid)).status_code == 200
        m = (await st.http.get("/metrics")).text
        assert 'tito_turn_phase_seconds_count{phase="generate"} 1.0' in m
        assert 'tito_errors_total{type="payload_too_large"} 1.0' in m
        branch = (await st.trajectory(sid))["branches"][0]
        assert metric_value(m, "tito_sampled_tokens_total") == sum(branch["loss_mask"]) > 0
        npz = await st.http.get(f"/sessions/{sid}/trajectory", params={"format": "npz"})
        assert npz.status_code == 200 and npz.content[:2] == b"PK"
        from trajectory.export import from_npz_bytes, to_dict

        assert to_dict(from_npz_bytes(npz.content))["branches"] == (await st.trajectory(sid))["branches"]
        d = await st.http.delete(f"/sessions/{sid}", params={"return_trajectory": "true"})
        assert d.status_code == 200 and d.json()["branches"][0]["turns"]


async def test_busy_409_carries_retry_after_on_every_dialect(qwen3_dir: Path) -> None:
    """The openai and anthropic SDKs retry a 409 and wait what `Retry-After` says (else
    0.5 s, 1 s: likely still busy); session_busy says 2 s, in each route's error shape
    (here a server that answers busy at once: `busy_wait_s` 0)."""
    async with live_stack(qwen3_dir, latency_ms=20, settings=Settings(busy_wait_s=0)) as st:
        sid = await st.session()
        first = asyncio.create_task(st.chat(sid))
        await _until_busy(st, sid)
        busy = await st.chat(sid)
        anthropic = await st.http.post(f"/sessions/{sid}/v1/messages",
                                       json={"max_tokens": 8, "messages": CHAT["messages"]})
        assert (await first).status_code == 200
        assert busy.status_code == 409 and busy.headers["retry-after"] == "2", busy.headers
        assert busy.json()["error"]["type"] == "session_busy"
        assert anthropic.status_code == 409 and anthropic.headers["retry-after"] == "2", anthropic.headers
        assert anthropic.json()["error"]["type"] == "conflict_error"


async def test_chat_on_a_busy_session_waits_and_is_served_after_the_turn_in_flight(qwen3_dir: Path) -> None:
    """The second request waits for the first turn (no 409), then runs: two engine
    requests, two commits, in arrival order; the second's messages fork a branch."""
    async with live_stack(qwen3_dir, latency_ms=20) as st:
        sid = await st.session()
        first = asyncio.create_task(st.chat(sid))
        await _until_busy(st, sid)
        other = {**CHAT, "messages": [{"role": "user", "content": "Generate a short title."}]}
        second = asyncio.create_task(st.chat(sid, other))
        r1, r2 = await first, await second
        assert (r1.status_code, r2.status_code) == (200, 200), (r1.text, r2.text)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert len(log) == 2
    a, b = sorted(log, key=lambda r: r["finished_s"] - r["e2e_s"])
    assert b["finished_s"] - b["e2e_s"] >= a["finished_s"] - 1e-3, "the queued turn overlapped the first"
    assert [len(br["turns"]) for br in traj["branches"]] == [1, 1]
    firsts = [br["messages"][0]["content"] for br in traj["branches"]]
    assert firsts == ["Fix the failing test.", "Generate a short title."], "commits out of arrival order"


async def test_busy_wait_is_bounded_and_a_client_that_leaves_the_queue_takes_nothing(qwen3_dir: Path) -> None:
    """Past `busy_wait_s` the queued request is a 409; a queued client that hangs up is
    dropped from the queue; the next queued request still gets the claim."""
    import httpx

    from session_server.context import Settings

    async with live_stack(qwen3_dir, latency_ms=40, settings=Settings(busy_wait_s=0.2)) as st:
        sid = await st.session()
        first = asyncio.create_task(st.chat(sid))
        await _until_busy(st, sid)
        busy = await st.chat(sid, {**CHAT, "messages": [{"role": "user", "content": "late"}]})
        assert busy.status_code == 409 and busy.json()["error"]["type"] == "session_busy", busy.text
        assert "waiting" in busy.json()["error"]["message"]
        assert (await first).status_code == 200
        # a client leaves the queue: its place is skipped, nothing of it reaches the engine
        slow = asyncio.create_task(st.chat(sid, {**CHAT, "messages": [{"role": "user", "content": "slow one"}]}))
        await _until_busy(st, sid)
        with contextlib.suppress(httpx.TimeoutException):
            await st.chat(sid, {**CHAT, "messages": [{"role": "user", "content": "gone"}]}, timeout=0.05)
        assert (await slow).status_code == 200
        assert (await st.chat(sid, {**CHAT, "messages": [{"role": "user", "content": "next"}]})).status_code == 200
        log = await st.engine_log()
    prompts = [r["input_ids"] for r in log]
    assert len(prompts) == 3, "the request whose client left must never reach the engine"
