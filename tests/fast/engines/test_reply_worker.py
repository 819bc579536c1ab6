"""The reply worker makes a generation request itself once its kind is known to answer
large: the result is what `serve` would have parsed, errors keep their types, a turn
that gives up closes the engine connection, and a worker that dies fails only what it
had in flight and is started again."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from session_server.engines import reply_decoder
from session_server.engines.base import parsed_without_routed
from session_server.engines.http import EngineHTTP
from session_server.engines.reply_decoder import ReplyDecoder
from session_server.engines.reply_worker import CALL
from session_server.engines.sglang import parse_sglang_generate
from session_server.engines.streams import run_inline
from session_server.errors import (
    EngineError,
    InternalInvariant,
    ReplyWorkerLost,
    UpstreamHTTPError,
    UpstreamTimeout,
    UpstreamTransportError,
)
from session_server.offload import CpuOffload

PADDING = b"[" + b",".join([b"[0.1,0.2,0.3]"] * 4000) + b"]"  # ~56 KB of routed experts
PARSE = partial(parsed_without_routed, parse_sglang_generate)
_HERE = parse_sglang_generate  # another kind (routed experts kept): not known large, made here


def _reply(rid: str) -> bytes:
    return (b'{"text":"x","output_ids":[5,6],"meta_info":{"id":"' + rid.encode() + b'","finish_reason":{"type":"stop",'
            b'"matched":6},"prompt_tokens":3,"completion_tokens":2,"cached_tokens":1,'
            b'"output_token_logprobs":[[-0.5,5,null],[-0.25,6,null]],"routed_experts":' + PADDING + b"}}")


class _Engine:
    """An aiohttp engine whose `/generate` answers a large reply, after `delay_s`, or
    `status`; it counts the requests it saw and those whose client went away."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.held: dict[str, float] = {}  # request id -> its own delay
        self.status = 200
        self.seen = 0
        self.gone = 0
        self.started = asyncio.Event()

    async def generate(self, request: web.Request) -> web.Response:
        self.seen += 1
        self.started.set()
        rid = orjson.loads(await request.read())["rid"]
        try:
            await asyncio.sleep(self.held.get(rid, self.delay_s))
        except asyncio.CancelledError:
            self.gone += 1
            raise
        if self.status != 200:
            return web.Response(status=self.status, text="engine says no")
        return web.Response(body=_reply(rid), content_type="application/json")


@asynccontextmanager
async def _serving(engine: _Engine) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/generate", engine.generate)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _decoder() -> AsyncIterator[ReplyDecoder]:
    threads = CpuOffload(1)
    decoder = ReplyDecoder(threads, processes=1, large_reply_bytes=16 * 1024)
    await decoder.start()
    try:
        yield decoder
    finally:
        await decoder.aclose()
        threads.shutdown()


@asynccontextmanager
async def _stack(retries: int = 2) -> AsyncIterator[tuple[_Engine, EngineHTTP, ReplyDecoder]]:
    """An engine, its `EngineHTTP` and a reply decoder with one worker."""
    engine = _Engine()
    async with _serving(engine) as url, _decoder() as decoder:
        http = EngineHTTP(url, protocol="sglang", retries=retries)
        try:
            yield engine, http, decoder
        finally:
            await http.aclose()


async def _generate(http: EngineHTTP, decoder: ReplyDecoder, rid: str, timeout_s: float = 10.0) -> object:
    body = orjson.dumps({"rid": rid})
    return await http.generate("/generate", body, PARSE, what=f"sglang {rid}", timeout_s=timeout_s,
                               offload=decoder.run, remote=decoder, parse_kw={"request_id": rid, "engine": "e"})


async def _a_slow_fetch(http: EngineHTTP, decoder: ReplyDecoder, engine: _Engine) -> asyncio.Task[object]:
    """A request the worker makes (its kind learnt first) that the engine holds for 30 s."""
    await _generate(http, decoder, "r1")
    engine.held["r2"], engine.started = 30.0, asyncio.Event()
    turn = asyncio.create_task(_generate(http, decoder, "r2"))
    await asyncio.wait_for(engine.started.wait(), 10)
    return turn


async def test_a_kind_known_to_answer_large_is_fetched_by_the_worker_and_parsed_the_same() -> None:
    async with _stack() as (engine, http, decoder):
        first = await _generate(http, decoder, "r1")
        assert decoder.fetched == 0, "the first of a kind is made here: its size is not known yet"
        second = await _generate(http, decoder, "r1")
        assert decoder.fetched == 1
    assert first == second == PARSE(_reply("r1"), request_id="r1", engine="e")
    assert engine.seen == 2


async def test_errors_from_the_worker_keep_their_types() -> None:
    async with _stack(retries=0) as (engine, http, decoder):
        await _generate(http, decoder, "r1")  # learnt: large
        engine.status = 503
        with pytest.raises(UpstreamHTTPError) as info:
            await _generate(http, decoder, "r2")
        assert info.value.http_status == 503 and "engine says no" in str(info.value)
        assert info.value.engine == http.base_url
        engine.status, engine.delay_s = 200, 5.0
        with pytest.raises(UpstreamTimeout) as timed_out:
            await _generate(http, decoder, "r3", timeout_s=0.2)
        assert timed_out.value.engine == http.base_url
        assert decoder.fetched == 2


async def test_a_turn_that_gives_up_closes_the_engine_connection_from_the_worker() -> None:
    async with _stack() as (engine, http, decoder):
        turn = await _a_slow_fetch(http, decoder, engine)
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        deadline = time.monotonic() + 10
        while engine.gone == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert engine.gone == 1, "the engine never learnt that nobody waits for its reply"
        assert http._in_flight == 0


async def test_a_worker_that_dies_fails_its_requests_and_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its requests fail as `ReplyWorkerLost` (not an engine error: routing health must
    not blame the engine), a request made here meanwhile is untouched, the dead process
    is reaped, and the next large reply a second later starts it again."""
    monkeypatch.setattr(reply_decoder, "RESTART_AFTER_S", 3600.0)  # not started again until said below
    async with _stack() as (engine, http, decoder):
        turn = await _a_slow_fetch(http, decoder, engine)
        worker = decoder._workers[0]
        assert worker.proc is not None
        engine.held["h"] = 0.5  # made here, its reply arrives after the worker's death
        here = asyncio.create_task(http.generate("/generate", orjson.dumps({"rid": "h"}), _HERE, what="h",
                                                 timeout_s=10, offload=decoder.run, remote=decoder,
                                                 parse_kw={"request_id": "h", "engine": "e"}))
        dead = worker.proc
        os.kill(dead.pid, signal.SIGKILL)
        with pytest.raises(ReplyWorkerLost, match="reply worker process ended") as info:
            await turn
        assert not isinstance(info.value, EngineError) and info.value.status == 503
        assert (await here).request_id == "h"  # made here: the worker's death is not its business
        # meanwhile the request is made here, then the worker is back
        assert await _generate(http, decoder, "r3") == PARSE(_reply("r3"), request_id="r3", engine="e")
        assert decoder.fetched == 1
        monkeypatch.setattr(reply_decoder, "RESTART_AFTER_S", 0.0)
        deadline = time.monotonic() + 30
        while not worker.ready and time.monotonic() < deadline:
            decoder._worker()
            await asyncio.sleep(0.05)
        assert worker.ready and worker.proc is not dead
        assert dead.returncode == -signal.SIGKILL, "the dead worker was reaped"
        assert await _generate(http, decoder, "r4") == PARSE(_reply("r4"), request_id="r4", engine="e")
        assert decoder.fetched == 2


async def test_a_closed_client_refuses_and_ends_what_the_worker_makes() -> None:
    async with _stack() as (engine, http, decoder):
        turn = await _a_slow_fetch(http, decoder, engine)
        await http.aclose()
        with pytest.raises(UpstreamTransportError, match="closed during the request") as info:
            await turn
        assert info.value.transient is False
        with pytest.raises(UpstreamTransportError, match="closed"):
            await _generate(http, decoder, "r3")
        deadline = time.monotonic() + 10
        while engine.gone == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert engine.gone == 1, "the worker kept the closed client's request open"


async def test_a_stuck_worker_is_killed_on_serves_clock_and_no_engine_is_blamed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reply_decoder, "ANSWER_GRACE_S", 0.2)
    async with _stack() as (_engine, http, decoder):
        await _generate(http, decoder, "r1")
        worker = decoder._workers[0]
        assert worker.proc is not None
        os.kill(worker.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ReplyWorkerLost, match="did not answer POST") as info:
            await _generate(http, decoder, "r2", timeout_s=0.3)
        assert not isinstance(info.value, EngineError)
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 10
        while worker.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not worker.alive, "the stuck worker was left to take the next request"


async def test_an_answer_that_cannot_travel_fails_only_its_own_request() -> None:
    async with _stack() as (engine, http, decoder):
        turn = await _a_slow_fetch(http, decoder, engine)
        worker = decoder._workers[0]
        with pytest.raises(InternalInvariant, match="could not send back"):
            await worker.ask(CALL, (threading.Lock, (), {}))  # a result that does not pickle
        with pytest.raises(InternalInvariant, match="ValueError"):
            await worker.ask(CALL, (int, ("not a number",), {}))  # a bug, not the engine's: the 500 it is in serve
        assert worker.alive and not turn.done()
        turn.cancel()


async def test_without_a_worker_every_request_is_made_here() -> None:
    engine = _Engine()
    async with _serving(engine) as url:
        http = EngineHTTP(url, protocol="sglang")
        try:
            for rid in ("r1", "r2"):
                got = await http.generate("/generate", orjson.dumps({"rid": rid}), PARSE, what=rid, timeout_s=5,
                                          offload=run_inline, parse_kw={"request_id": rid, "engine": "e"})
                assert got == PARSE(_reply(rid), request_id=rid, engine="e")
        finally:
            await http.aclose()


def _sockets(pid: int) -> int:
    return sum(1 for fd in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(fd).startswith("socket:"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads a process's sockets from /proc (Linux)")
async def test_a_closed_client_has_the_worker_close_its_engine_connections() -> None:
    async with _stack() as (_engine, http, decoder):
        await _generate(http, decoder, "r1")
        await _generate(http, decoder, "r2")  # made by the worker: it keeps the connection alive
        worker = decoder._workers[0]
        assert worker.proc is not None
        held = _sockets(worker.proc.pid)
        await http.aclose()
        deadline = time.monotonic() + 2  # well inside the keep-alive (4 s idle): closed by FORGET
        while _sockets(worker.proc.pid) >= held and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert _sockets(worker.proc.pid) == held - 1, "the worker kept the closed client's connection"
        assert worker.alive


async def test_a_worker_stuck_in_a_parse_is_killed_and_the_reply_parsed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reply_decoder, "CALL_TIMEOUT_S", 0.3)
    async with _decoder() as decoder:
        worker = decoder._workers[0]
        assert worker.proc is not None
        os.kill(worker.proc.pid, signal.SIGSTOP)
        got = await decoder.run(PARSE, _reply("r1"), request_id="r1", engine="e")
        assert got == PARSE(_reply("r1"), request_id="r1", engine="e")  # the reply was in hand
        deadline = time.monotonic() + 10
        while worker.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not worker.alive, "the stuck worker was left running"


async def test_a_refused_connection_from_the_worker_is_transient_and_names_the_engine() -> None:
    """Nothing listens any more: the worker retries as `serve` would, then answers the
    same `transient=True` error (safe to retry: nothing reached an engine)."""
    async with _stack(retries=1) as (_engine, http, decoder):
        await _generate(http, decoder, "r1")
        known = dict(http._reply_bytes)
    async with _decoder() as decoder2:
        http2 = EngineHTTP(http.base_url, protocol="sglang", retries=1)
        try:
            http2._reply_bytes = known  # known large: the worker makes it
            with pytest.raises(UpstreamTransportError) as info:
                await _generate(http2, decoder2, "r2")
            assert decoder2.fetched == 1
            assert info.value.transient is True and info.value.engine == http.base_url
        finally:
            await http2.aclose()
