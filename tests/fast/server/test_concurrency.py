"""The in-flight gate under concurrency: busy is a fast 409 that never reaches an
engine; different sessions run in parallel; a delete beats an in-flight commit."""

from __future__ import annotations

import asyncio
from pathlib import Path

from .conftest import CHAT, live_stack, metric_value


async def _until_busy(st, sid: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(400):
        if (await st.http.get(f"/sessions/{sid}")).json()["busy"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the chat never became in flight")


async def test_second_chat_on_busy_session_is_409_and_never_reaches_engine(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=20) as st:
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
    0.5 s, 1 s: likely still busy); session_busy says 2 s, in each route's error shape."""
    async with live_stack(qwen3_dir, latency_ms=20) as st:
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
