"""A streamed request that waits before its turn starts is never silent (live.py).

A stream queued for its session (behind a turn held at the pause gate of a weight
update) used to send nothing, not even its status, until its own turn started: client
idle watchdogs killed it. Now its response begins once it has waited `keepalive_s`
(200, the SSE headers, the dialect's opening frames) and keep-alives flow until the
turn's frames do; an error after that point is the dialect's error event, one before it
an HTTP status. The replay log still stores exactly the turn's frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from session_server.context import Settings

from ..stack import CHAT, Stack, live_stack

KEEPALIVE_S = 0.4
HOLD_S = 2.4  # the pause the turn ahead waits out: several keepalive_s

MESSAGES = {"model": "m", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "Fix the failing test, please."}]}
RESPONSES = {"model": "m", "input": "Fix the failing test, please.", "stream": True, "max_output_tokens": 64}
ROUTES = {
    "chat": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Another question."}],
                                      "stream": True}),
    "messages": ("/v1/messages", MESSAGES),
    "responses": ("/v1/responses", RESPONSES),
}


IN_PROGRESS = b"event: response.in_progress\n"


def _is_keepalive(frame: bytes) -> bool:
    """An SSE comment (chat) or Anthropic `ping`: the keep-alives that are never turn
    frames (Responses' is `response.in_progress`, see `_turn_frames`)."""
    return frame.startswith(b":") or frame.startswith(b"event: ping\n")


def _turn_frames(frames: list[bytes]) -> list[bytes]:
    """`frames` without keep-alives: comments, pings (but the turn's own, right after
    `message_start`), and every `response.in_progress` after the first (the first is the
    turn's own, after `response.created`)."""
    out: list[bytes] = []
    for f in frames:
        own_ping = f.startswith(b"event: ping\n") and out and out[-1].startswith(b"event: message_start\n")
        if (_is_keepalive(f) and not own_ping) or \
                (f.startswith(IN_PROGRESS) and any(g.startswith(IN_PROGRESS) for g in out)):
            continue
        out.append(f)
    return out


async def _frames(resp: httpx.Response) -> AsyncIterator[tuple[float, bytes]]:
    """The SSE frames of a streamed response as they arrive, with their arrival time."""
    buf = b""
    async for chunk in resp.aiter_raw():
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            yield time.monotonic(), frame + b"\n\n"


@contextlib.asynccontextmanager
async def _turn_held_at_the_pause_gate(st: Stack, sid: str) -> AsyncIterator[asyncio.Task[httpx.Response]]:
    """A non-streamed chat holds the session's claim while it waits at the closed pause
    gate (a weight update); resumed (and answered) when the block ends."""
    r = await st.http.post("/control/pause", json={"mode": "abort"})
    assert r.status_code == 200, r.text
    ahead = asyncio.create_task(st.chat(sid))
    try:
        for _ in range(400):
            if (await st.http.get(f"/sessions/{sid}")).json()["busy"]:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the turn ahead never took the session")
        yield ahead
    finally:
        await st.http.post("/control/resume", json={})
        with contextlib.suppress(Exception):
            await ahead


async def _read_queued(st: Stack, sid: str, route: str, body: dict[str, Any],
                       headers: dict[str, str] | None = None) -> tuple[float, float, list[tuple[float, bytes]]]:
    """Send `body` as a stream queued behind a held turn; resume after HOLD_S. Returns
    (when its headers came, when the pause ended, its frames with their times)."""
    async with _turn_held_at_the_pause_gate(st, sid) as ahead:
        t0 = time.monotonic()
        frames: list[tuple[float, bytes]] = []

        async def read() -> float:
            async with st.http.stream("POST", f"/sessions/{sid}{route}", json=body, headers=headers or {}) as resp:
                got = time.monotonic()
                assert resp.status_code == 200, await resp.aread()
                assert resp.headers["content-type"].startswith("text/event-stream")
                async for item in _frames(resp):
                    frames.append(item)
            return got

        reader = asyncio.create_task(read())
        await asyncio.sleep(HOLD_S)
        resumed = time.monotonic()
    assert (await ahead).status_code == 200
    headers_at = await reader
    return headers_at - t0, resumed - t0, [(t - t0, f) for t, f in frames]


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
async def test_a_queued_stream_sends_headers_and_keepalives_while_it_waits_then_its_whole_turn(
        qwen3_dir: Path, dialect: str) -> None:
    route, body = ROUTES[dialect]
    settings = Settings(keepalive_s=KEEPALIVE_S, busy_wait_s=30)
    async with live_stack(qwen3_dir, settings=settings) as st:
        sid = await st.session()
        key = {"idempotency-key": f"queued-{dialect}"}  # recorded: a retry gets the stored response
        headers_at, resumed, frames = await _read_queued(st, sid, route, body, headers=key)
        traj = await st.trajectory(sid)
        replay = await st.http.post(f"/sessions/{sid}{route}", json=body, headers=key)
    assert headers_at < resumed - KEEPALIVE_S, f"no status or headers while queued ({headers_at:.2f}s)"
    waiting = [f for t, f in frames if t < resumed]
    turn = _turn_frames([f for _, f in frames])
    if dialect == "responses":  # opened with response.created; response.in_progress keeps it alive
        assert waiting[0].startswith(b"event: response.created\n"), waiting[:2]
        assert sum(f.startswith(IN_PROGRESS) for f in waiting) >= 4, "Codex counts events: keep-alives are events"
        created = orjson.loads(turn[0].split(b"data: ", 1)[1])["response"]["id"]
        done = orjson.loads(turn[-1].split(b"data: ", 1)[1])
        assert done["type"] in ("response.completed", "response.incomplete") and done["response"]["id"] == created
    else:  # nothing of the turn before it starts: keep-alives only (a ping may precede message_start)
        assert all(_is_keepalive(f) for f in waiting) and len(waiting) >= 3, waiting
        first, last = (b'"role":"assistant"', b"data: [DONE]") if dialect == "chat" else \
            (b"event: message_start\n", b"event: message_stop\n")
        assert first in turn[0] and turn[-1].startswith(last), turn
    assert sum(len(b["turns"]) for b in traj["branches"]) == 2, "both turns committed, once each"
    # a retry gets the stored response: exactly the turn's frames, no keep-alive
    assert replay.status_code == 200
    assert [f + b"\n\n" for f in replay.content.split(b"\n\n") if f] == turn


async def test_a_replay_of_a_queued_stream_follows_it_from_its_first_frame(qwen3_dir: Path) -> None:
    """An SDK retry of a stream still queued (its client timed out) follows the original
    once that one's response began: keep-alives, then every frame of the one turn."""
    route, body = ROUTES["chat"]
    settings = Settings(keepalive_s=KEEPALIVE_S, busy_wait_s=30)
    async with live_stack(qwen3_dir, settings=settings) as st:
        sid = await st.session()
        async with _turn_held_at_the_pause_gate(st, sid):
            original = asyncio.create_task(st.http.post(f"/sessions/{sid}{route}", json=body,
                                                        headers={"x-stainless-retry-count": "0"}))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            later = asyncio.create_task(asyncio.sleep(HOLD_S))
            frames: list[tuple[float, bytes]] = []
            async with st.http.stream("POST", f"/sessions/{sid}{route}", json=body,
                                      headers={"x-stainless-retry-count": "1"}) as resp:
                headers_at = time.monotonic() - t0
                assert resp.status_code == 200
                later.add_done_callback(lambda _: asyncio.ensure_future(st.http.post("/control/resume", json={})))
                async for t, f in _frames(resp):
                    frames.append((t - t0, f))
            await later
        first = (await original).content
        traj = await st.trajectory(sid)
    assert headers_at < HOLD_S - KEEPALIVE_S, f"the retry was silent while the original waited ({headers_at:.2f}s)"
    waiting = [f for t, f in frames if t < HOLD_S]
    assert len(waiting) >= 2 and all(_is_keepalive(f) for f in waiting), waiting
    original_turn = _turn_frames([f + b"\n\n" for f in first.split(b"\n\n") if f])
    assert _turn_frames([f for _, f in frames]) == original_turn and original_turn[-1] == b"data: [DONE]\n\n"
    assert sum(len(b["turns"]) for b in traj["branches"]) == 2, "the retry ran no turn of its own"


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
async def test_a_queued_stream_that_times_out_after_its_response_began_gets_the_error_event(
        qwen3_dir: Path, dialect: str) -> None:
    """`busy_wait_s` passed after the response began: the dialect's error event (the
    status is sent); nothing was committed for it."""
    route, body = ROUTES[dialect]
    settings = Settings(keepalive_s=KEEPALIVE_S, busy_wait_s=4 * KEEPALIVE_S)
    async with live_stack(qwen3_dir, settings=settings) as st:
        sid = await st.session()
        _, _, frames = await _read_queued(st, sid, route, body)
        traj = await st.trajectory(sid)
    assert any(t < 4 * KEEPALIVE_S for t, _ in frames), "the response began while the request waited"
    events = _turn_frames([f for _, f in frames])
    if dialect == "chat":
        assert len(events) == 2 and events[1] == b"data: [DONE]\n\n", events
        err = orjson.loads(events[0].removeprefix(b"data: "))["error"]
        assert (err["type"], err["code"]) == ("session_busy", 409)
    elif dialect == "messages":
        assert len(events) == 1 and events[0].startswith(b"event: error\n"), events
        err = orjson.loads(events[0].split(b"data: ", 1)[1])["error"]
        assert err["type"] == "conflict_error" and "in flight" in err["message"]
    else:
        kinds = [f.split(b"\n", 1)[0] for f in events]
        assert kinds == [b"event: response.created", b"event: response.in_progress", b"event: error",
                         b"event: response.failed"], kinds
        assert orjson.loads(events[2].split(b"data: ", 1)[1])["code"] == "session_busy"
    assert sum(len(b["turns"]) for b in traj["branches"]) == 1, "only the turn ahead committed"


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
async def test_a_stream_refused_before_keepalive_s_is_still_an_http_error(qwen3_dir: Path, dialect: str) -> None:
    """A quick failure keeps its status: a 409 after a `busy_wait_s` shorter than
    `keepalive_s`, and a malformed body (now refused before it queues at all)."""
    route, body = ROUTES[dialect]
    settings = Settings(keepalive_s=10 * KEEPALIVE_S, busy_wait_s=KEEPALIVE_S)
    async with live_stack(qwen3_dir, settings=settings) as st:
        sid = await st.session()
        async with _turn_held_at_the_pause_gate(st, sid):
            busy = await st.http.post(f"/sessions/{sid}{route}", json=body)
            t0 = time.monotonic()
            bad = await st.http.post(f"/sessions/{sid}{route}", json={**body, "stream": "yes"})
            bad_s = time.monotonic() - t0
    assert busy.status_code == 409 and busy.headers["content-type"] == "application/json", busy.text
    assert bad.status_code == 400, bad.text
    assert bad_s < KEEPALIVE_S, "a malformed request waited in the queue"
