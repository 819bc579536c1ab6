"""Session lifecycle hardening (a client that goes away, state that leaks,
branch cap, TTL refreshed by reads, Retry-After): live stack against the simulated engines."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from session_server.context import Settings
from session_server.errors import (
    BranchLimit,
    EngineAborted,
    NoHealthyEngine,
    OverCapacity,
    PausedTooLong,
    ServiceError,
)
from session_server.ops.harness import live_apps
from session_server.sessions import SessionConfig, SessionStore

from ..stack import CHAT, Stack, live_stack, metric_value

SLOW = {**CHAT, "max_tokens": 400}  # 400 tokens at 50 ms each: still generating when cut


def _ctx(st: Stack) -> Any:
    return live_apps[st.url].state.ctx


async def _until(pred: Any, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await pred():
            return True
        await asyncio.sleep(0.01)
    return False


async def _busy(st: Stack, sid: str) -> bool:
    return bool((await st.http.get(f"/sessions/{sid}")).json()["busy"])


async def _until_engine_has_request(st: Stack) -> str:
    """The rid of the first generate request the engine received (the turn is at the engine)."""
    async def seen() -> bool:
        return bool(await st.engine_log()) or bool(_ctx(st).control.in_flight())

    assert await _until(seen), "the turn never reached the engine"
    flights = _ctx(st).control.in_flight()
    assert len(flights) == 1
    return str(flights[0])


def _assert_no_routing_state(ctx: Any, sid: str) -> None:
    engines = ctx.pool
    assert sid not in engines._cached and sid not in engines._pending
    assert all(sid not in t.sessions for t in engines.targets.values())


# -- a client that goes away ------------------------------------------------------


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_client_disconnect_aborts_commits_nothing_and_retry_gets_200(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=50) as st:
        sid = await st.session()
        writer = await st.raw_chat(sid, SLOW)
        rid = await _until_engine_has_request(st)
        writer.close()  # a real socket disconnect, mid-generation
        await writer.wait_closed()

        async def released() -> bool:
            return not await _busy(st, sid)

        assert await _until(released, timeout_s=1.0), "claim still held a second after the client left"
        r = await st.chat(sid, {**CHAT, "max_tokens": 8})  # the agent's immediate retry
        assert r.status_code == 200, r.text

        await _ctx(st).control.drain_aborts()
        assert rid in await st.aborted_rids(), "the engine request was not aborted"
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["turns_discarded"] == 1
        assert view["turns"] == 1 and len(view["branches"]) == 1  # only the retry was committed
        traj = await st.trajectory(sid)
        assert [t["extra"]["request_id"] for t in traj["branches"][0]["turns"]] != [rid]
        metrics = (await st.http.get("/metrics")).text
        assert metric_value(metrics, "tito_turns_total", outcome="discarded") == 1
        assert metric_value(metrics, "tito_turns_total", outcome="committed") == 1


async def test_disconnect_watch_does_not_disturb_normal_turns(qwen3_dir: Path) -> None:
    """The watcher returns nothing while the client waits: keep-alive turns commit."""
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        r = await st.chat(sid)
        assert r.status_code == 200, r.text
        follow = {"messages": [*CHAT["messages"], r.json()["choices"][0]["message"],
                               {"role": "user", "content": "Again."}], "max_tokens": 16, "stream": True}
        r = await st.chat(sid, follow)
        assert r.status_code == 200 and "[DONE]" in r.text
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["turns"] == 2 and view["turns_discarded"] == 0


# -- DELETE during a turn -------------------------------------------------


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_delete_during_turn_aborts_and_answers_409(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=50) as st:
        sid = await st.session()
        turn = asyncio.create_task(st.chat(sid, SLOW))
        rid = await _until_engine_has_request(st)
        d = await st.http.delete(f"/sessions/{sid}")
        assert d.status_code == 204
        r = await asyncio.wait_for(turn, 2.0)  # cancelled, not left to run its 400 tokens
        assert r.status_code == 409, r.text
        assert r.json()["error"]["type"] == "session_closed"
        await _ctx(st).control.drain_aborts()
        assert rid in await st.aborted_rids()
        assert (await st.http.get(f"/sessions/{sid}")).status_code == 404  # the DELETE holds
        assert sid not in _ctx(st).store.all()
        _assert_no_routing_state(_ctx(st), sid)  # not re-added by the turn's completion
        metrics = (await st.http.get("/metrics")).text
        assert metric_value(metrics, "tito_turns_total", outcome="discarded") == 1
        assert metric_value(metrics, "tito_turns_total", outcome="committed") == 0


# -- state that leaks -------------------------------------------------------------


async def test_ttl_expiry_forgets_routing_state(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(sweep_interval_s=0.05)) as st:
        r = await st.http.post("/sessions", json={"ttl_s": 0.2})
        sid = r.json()["session_id"]
        assert (await st.chat(sid)).status_code == 200
        ctx = _ctx(st)
        home = ctx.store.get(sid).home  # the turn left an affinity estimate: its home has the context cached
        assert home is not None and ctx.pool.uncached_tokens(sid, home, 10**6) < 10**6

        async def gone() -> bool:
            return sid not in ctx.store.all()

        assert await _until(gone)
        _assert_no_routing_state(ctx, sid)


async def test_churn_10k_sessions_leaves_every_per_session_table_empty(qwen3_dir: Path) -> None:
    """10K sessions: created, used, then expired (short TTL + sweep) or deleted; every
    table keyed by session id ends empty. A subset runs real turns over HTTP; the rest
    are used cheaply (a view read, and the routing bookkeeping a turn does)."""
    n_total, n_http = 10_000, 40
    settings = Settings(sweep_interval_s=0.05, max_sessions=20_000)
    async with live_stack(qwen3_dir, n_engines=2, settings=settings) as st:
        ctx = _ctx(st)
        # the store's clock stands still while sessions are used (a loaded machine must not
        # expire one between its create and its chat), then jumps past every TTL
        now = [ctx.store._clock()]
        ctx.store._clock = lambda: now[0]

        async def real(i: int) -> None:  # create, chat, then delete or leave to expire
            sid = (await st.http.post("/sessions", json={"ttl_s": 1.0})).json()["session_id"]
            r = await st.chat(sid)
            assert r.status_code == 200, r.text
            if i % 2 == 0:
                assert (await st.http.delete(f"/sessions/{sid}")).status_code == 204

        await asyncio.gather(*(real(i) for i in range(n_http)))
        peak = 0
        for i in range(n_total - n_http):
            s = ctx.store.create(SessionConfig(ttl_s=1.0))
            if i % 50 == 0:
                assert (await st.http.get(f"/sessions/{s.id}")).status_code == 200
            target = ctx.pool.select(s.id, s.home, context_tokens=100 + i % 7)
            s.home = target.id
            ctx.pool.on_turn_complete(target, s.id, ok=True, total_tokens=120)
            peak = max(peak, len(ctx.pool._cached))
            if i % 2 == 0:
                ctx.store.close(s.id)  # what DELETE does
        assert peak > 1000  # the tables did fill up
        assert len(ctx.store) == n_total // 2  # nothing expired early
        now[0] += 2.0  # every TTL (1 s) has passed: the sweeper takes the rest

        async def all_gone() -> bool:
            return len(ctx.store) == 0

        assert await _until(all_gone, timeout_s=20.0), f"{len(ctx.store)} sessions left"
        engines = ctx.pool
        assert engines._cached == {} and engines._pending == {}
        for t in engines.targets.values():
            assert t.sessions == set() and t.resident_tokens == 0
            assert t.pending_prefill_tokens == 0 and t.in_flight == 0
        assert ctx.control.in_flight() == []
        assert not any(ctx.admission._waiting.values()) and not any(ctx.admission._active.values())
        metrics = (await st.http.get("/metrics")).text
        assert metric_value(metrics, "tito_sessions_expired_total") == n_total // 2


# -- branch cap -------------------------------------------------------------------


async def test_branch_cap_refuses_retry_past_max_branches(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(max_branches=3)) as st:
        sid = await st.session()
        for _ in range(3):  # turn 0, then two retries of it: branches 0, 1, 2
            r = await st.chat(sid)
            assert r.status_code == 200, r.text
        before = (await st.http.get(f"/sessions/{sid}")).json()
        assert len(before["branches"]) == 3
        r = await st.chat(sid)  # a third retry needs a fourth branch
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "branch_limit" and "max_branches=3" in err["message"]
        assert r.headers["retry-after"] == "60"
        after = (await st.http.get(f"/sessions/{sid}")).json()
        assert after["branches"] == before["branches"] and after["turns"] == before["turns"]
        follow = {"messages": [*CHAT["messages"], (await st.trajectory(sid))["branches"][-1]["messages"][-1],
                               {"role": "user", "content": "Go on."}], "max_tokens": 16}
        assert (await st.chat(sid, follow)).status_code == 200  # appending needs no branch


def test_max_branches_is_a_cli_flag_defaulting_to_64() -> None:
    from session_server.ops.cli import build_parser, settings_from_args

    parser = build_parser()
    base = ["serve", "--tokenizer", "qwen3", "--engine", "sglang=http://127.0.0.1:1"]
    assert settings_from_args(parser.parse_args([*base, "--max-branches", "7"])).max_branches == 7
    assert settings_from_args(parser.parse_args(base)).max_branches == Settings().max_branches == 64


# -- TTL refreshed by reads; Retry-After ---------------------------------------


def test_touch_keeps_a_read_session_alive() -> None:
    now = [0.0]
    store = SessionStore(clock=lambda: now[0])
    removed: list[str] = []
    store.on_remove.append(lambda s: removed.append(s.id))
    read, idle = store.create(SessionConfig(ttl_s=10)), store.create(SessionConfig(ttl_s=10))
    now[0] = 8.0
    store.touch(read)
    now[0] = 12.0
    assert store.expire() == [idle.id]
    assert removed == [idle.id]  # the one removal path runs the hook
    now[0] = 18.5
    assert store.expire() == [read.id]


async def test_view_and_trajectory_reads_refresh_ttl(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        s = _ctx(st).store.all()[sid]
        for path in (f"/sessions/{sid}", f"/sessions/{sid}/trajectory"):
            s.last_used -= 100.0  # as if idle for 100 s
            stale = s.last_used
            assert (await st.http.get(path)).status_code == 200
            assert s.last_used >= stale + 100.0, path


async def test_overload_and_unavailable_answers_carry_retry_after(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(max_sessions=1)) as st:
        sid = await st.session()
        r = await st.http.post("/sessions", json={})
        assert (r.status_code, r.json()["error"]["type"], r.headers.get("retry-after")) == (429, "over_capacity", "5")
        ctx = _ctx(st)
        for eid in list(ctx.pool.engines):
            ctx.pool.mark_failed(eid)
        r = await st.chat(sid)
        assert (r.status_code, r.json()["error"]["type"], r.headers.get("retry-after")) == (503, "no_healthy_engine", "5")
        for eid in list(ctx.pool.engines):
            ctx.pool.mark_healthy(eid)
        assert (await st.http.post("/control/pause", json={"mode": "abort"})).status_code == 200
        r = await st.chat(sid, {**CHAT, "timeout_s": 0.2})
        assert (r.status_code, r.json()["error"]["type"], r.headers.get("retry-after")) == (503, "paused", "10")
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        r = await st.chat(sid)
        assert r.status_code == 200 and "retry-after" not in r.headers


@pytest.mark.parametrize(("cls", "seconds"), [(OverCapacity, 5), (BranchLimit, 60), (NoHealthyEngine, 5),
                                              (PausedTooLong, 10), (EngineAborted, 1), (ServiceError, None)])
def test_each_retryable_error_names_its_retry_after_seconds(cls: type[ServiceError], seconds: int | None) -> None:
    assert cls.retry_after_s == seconds


async def test_openapi_declares_retry_after(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        doc = (await st.http.get("/openapi.json")).json()
        chat = doc["paths"]["/sessions/{sid}/v1/chat/completions"]["post"]["responses"]
        assert "Retry-After" in chat["429"]["headers"] and "Retry-After" in chat["503"]["headers"]
        assert "headers" not in chat["400"]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_streamed_client_that_hangs_up_mid_turn_is_counted_discarded(qwen3_dir: Path, protocol: str) -> None:
    """The stream's end and the disconnect watcher both cancel the turn: whichever lands
    first, and a second cancellation landing while the first unwinds, the turn is counted
    discarded exactly once and the claim goes back."""
    body = {**SLOW, "stream": True}
    async with live_stack(qwen3_dir, protocol, latency_ms=10) as st:
        sid = await st.session()
        async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions", json=body) as r:
            chunks = r.aiter_bytes()
            for _ in range(12):  # tokens are flowing
                await anext(chunks)

        async def counted() -> bool:
            view = (await st.http.get(f"/sessions/{sid}")).json()
            return bool(view["turns_discarded"] == 1 and not view["busy"])

        assert await _until(counted, timeout_s=5.0), (await st.http.get(f"/sessions/{sid}")).json()
        view = (await st.http.get(f"/sessions/{sid}")).json()
        metrics = (await st.http.get("/metrics")).text
    assert view["turns"] == 0 and view["turns_discarded"] == 1
    assert metric_value(metrics, "tito_turns_total", outcome="discarded") == 1


async def test_a_delete_landing_as_a_queued_chat_is_handed_the_session_ends_that_chat_at_once(qwen3_dir: Path) -> None:
    """The claim passes to the queued chat before its task wakes; a DELETE in between finds
    no turn to cancel. The chat must see the session closing as it wakes: a 409
    session_closed at once, no engine request, and the session removed."""
    async with live_stack(qwen3_dir, latency_ms=20) as st:
        sid = await st.session()
        store = _ctx(st).store
        first = asyncio.create_task(st.chat(sid, SLOW))
        await _until(lambda: _busy(st, sid))
        queued = asyncio.create_task(st.chat(sid, {**CHAT, "messages": [{"role": "user", "content": "queued"}]}))
        await _until(lambda: _has_waiter(store, sid))
        release = store.release

        def release_then_delete(session: Any, claim: Any) -> None:
            release(session, claim)
            if session.id == sid and session.inflight is not None:  # handed to the queued chat
                store.close(sid)  # the DELETE lands before the queued chat's task runs

        store.release = release_then_delete  # type: ignore[method-assign]
        r1, r2 = await first, await asyncio.wait_for(queued, 5)
        log = await st.engine_log()
        gone = await st.http.get(f"/sessions/{sid}")
    assert r1.status_code == 200 and r2.status_code == 409, (r1.text, r2.text)
    assert r2.json()["error"]["type"] == "session_closed"
    assert len(log) == 1, "the chat of a deleted session reached the engine"
    assert gone.status_code == 404


async def _has_waiter(store: Any, sid: str) -> bool:
    return bool(store.get(sid).waiters)
