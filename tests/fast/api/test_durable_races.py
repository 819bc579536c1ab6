"""Durable sessions under races and restarts: what a live session has, its recovered
copy must have too, and orderings where a record lands after its session's tombstone
or a committed turn is reported as discarded."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from session_server import durability
from session_server.app import AppConfig
from session_server.context import Settings
from session_server.journal import Journal
from session_server.journal_writer import REC
from session_server.ops.harness import live_apps, running_server
from session_server.sessions import _deadline
from session_server.sim import running_sim

from ..stack import metric_value


@contextlib.asynccontextmanager
async def _server(tokenizer: Path, engine: str, jdir: Path, **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    config = AppConfig(tokenizer=str(tokenizer), engines=[f"sglang={engine}"],
                       settings=Settings(journal_dir=str(jdir), instance_id="w0", **settings))
    try:
        async with running_server(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            yield http, live_apps[url].state.ctx
    finally:
        durability.FATAL.clear()  # a module global: it would fail every later server of this process


async def test_a_reward_that_waited_for_the_lock_of_a_deleted_session_leaves_a_journal_that_replays(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """A reward waits for the session lock (held by a commit awaiting its journal write,
    or a trajectory export); meanwhile the idle session is DELETEd (DELETE does not take
    the lock) and its tombstone deletes its records. The reward then writes its record
    for a session the journal no longer has: the next start must still replay."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3)) as engine:
        async with _server(qwen3, engine, tmp_path / "j") as (http, ctx):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            s = ctx.store.get(sid)
            await s.lock.acquire()  # as a commit awaiting its journal write holds it
            reward = asyncio.ensure_future(http.post(f"/sessions/{sid}/reward", json={"reward": 1.0}))
            await asyncio.sleep(0.3)  # the reward is queued on the lock
            assert (await http.delete(f"/sessions/{sid}")).status_code == 204
            s.lock.release()
            await reward  # (200 today: it stored its record after the tombstone)
        async with _server(qwen3, engine, tmp_path / "j") as (http, _):  # RuntimeError: did not replay
            assert (await http.get(f"/sessions/{sid}")).status_code == 410


async def test_a_client_that_leaves_during_the_journal_write_of_a_committed_turn_is_not_counted_discarded(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The turn's record is stored and the commit stands (a cancel does not interrupt the
    write); the session must not then count that committed turn as discarded too."""
    real_hand_over = Journal._hand_over
    writing = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_hand_over(self: Journal) -> None:
        if any(op[0] == REC and op[2] == "turn" for op in self._tick) and self.writer_pid is not None:
            os.kill(self.writer_pid, signal.SIGSTOP)  # a slow fsync: the writer stands still for 0.5 s
            loop.call_later(0.5, os.kill, self.writer_pid, signal.SIGCONT)
            writing.set()
        real_hand_over(self)

    monkeypatch.setattr(Journal, "_hand_over", slow_hand_over)
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3)) as engine:
        async with _server(qwen3, engine, tmp_path / "j") as (http, _):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            host, port = str(http.base_url).removeprefix("http://").rstrip("/").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            data = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            writer.write(f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
            await writer.drain()
            await asyncio.wait_for(writing.wait(), 30)
            writer.close()  # the client leaves while its turn's record is being written
            await asyncio.sleep(2.0)
            view = (await http.get(f"/sessions/{sid}")).json()
            metrics = (await http.get("/metrics")).text
    assert view["turns"] == 1  # committed and journaled
    assert (view["turns_discarded"], metric_value(metrics, "tito_turns_total", outcome="discarded")) == (0, 0), view


async def test_a_session_kept_alive_by_reads_keeps_its_ttl_deadline_over_a_restart(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """A read (view, trajectory, samples) pushes a session's TTL back; the recovered
    session's deadline must be the live one's, not its last record's."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3)) as engine:
        async with _server(qwen3, engine, tmp_path / "j") as (http, ctx):
            sid = (await http.post("/sessions", json={"ttl_s": 600})).json()["session_id"]
            await asyncio.sleep(3.0)
            assert (await http.get(f"/sessions/{sid}")).status_code == 200  # a read: the TTL restarts
            live_left, live_at = _deadline(ctx.store.get(sid)) - ctx.store.clock(), time.time()
        async with _server(qwen3, engine, tmp_path / "j") as (http, ctx):
            back_left, back_at = _deadline(ctx.store.get(sid)) - ctx.store.clock(), time.time()
    downtime = back_at - live_at  # counts as idle time (docs/api.md, "Durable sessions")
    assert back_left == pytest.approx(live_left - downtime, abs=0.5), (live_left, downtime, back_left)


async def test_a_responses_turn_rerendered_after_a_restart_can_be_chained_by_its_id(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process dies after a Responses turn's record is durable and before its stored
    object's record is (two writes, two syncs): the SDK's retry after the restart gets the
    turn rendered again (`Rerender`), with a response id; a Responses agent chains its next
    request by that id, so the id must name a stored response."""
    from session_server.api import turn_endpoint

    async def died_before(ctx: Any, sid: str, kept: Any) -> None:
        return None  # the crash: the object's record is never written

    qwen3 = tokenizer_dirs["qwen3"]
    body = {"model": "m", "input": "List the files.", "max_output_tokens": 8}
    async with running_sim("sglang", str(qwen3), seed=4) as engine:
        async with _server(qwen3, engine, tmp_path / "j") as (http, _):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            url = f"/sessions/{sid}/v1/responses"
            with monkeypatch.context() as m:
                m.setattr(turn_endpoint, "_journal_kept", died_before)
                lost = await http.post(url, json=body, headers={"x-stainless-retry-count": "0"})
                assert lost.status_code == 200, lost.text  # (its response dies with the process)
        async with _server(qwen3, engine, tmp_path / "j") as (http, _):
            retry = await http.post(url, json=body, headers={"x-stainless-retry-count": "1"})
            assert retry.status_code == 200, retry.text
            rid = retry.json()["id"]
            got = await http.get(f"{url}/{rid}")
            nxt = await http.post(url, json={"model": "m", "input": "Open the first.", "max_output_tokens": 8,
                                             "previous_response_id": rid})
    assert (got.status_code, nxt.status_code) == (200, 200), (got.text, nxt.text)


async def test_a_create_record_that_does_not_replay_stops_the_start_naming_it(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """A record with a good checksum that this version cannot rebuild (a journal written
    by another version: its session config has a field this one lacks) must stop the
    start naming the record (exit status 65 under `serve`), not leave the instance
    answering 503 recovering for ever."""
    from session_server.journal import journal_path
    from session_server.journal_records import CREATE, encode

    j = Journal(journal_path(tmp_path / "j", "w0"))
    list(j.read())
    j.start(asyncio.get_running_loop())
    await j.append("w0.aaaa", CREATE, encode({"token": "t", "wall": time.time(), "config": {
        "ttl_s": 60.0, "metadata": {}, "max_context_tokens": None, "sampling": {}, "lora": None,
        "chat_template_kwargs": {}, "history_policy": "append", "routing_replay": False, "max_weight_lag": None,
        "a_later_versions_field": 1}}))
    await j.close()
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3)) as engine:
        with pytest.raises(RuntimeError, match="record 1"):  # today: hangs in recovering (TypeError in the task)
            await asyncio.wait_for(_server(qwen3, engine, tmp_path / "j").__aenter__(), 20)
    durability.FATAL.clear()


async def test_per_turn_rewards_come_back_after_a_restart_and_one_racing_a_delete_is_410(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """Per-turn rewards are session state: journaled with the reward record, restored by
    the replay (the session view and the samples after a restart). One that waited for
    the lock of a session DELETEd meanwhile answers 410, as the trajectory reward does."""
    qwen3 = tokenizer_dirs["qwen3"]
    chat = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    async with running_sim("sglang", str(qwen3)) as engine:
        async with _server(qwen3, engine, tmp_path / "j") as (http, ctx):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            doomed = (await http.post("/sessions", json={})).json()["session_id"]
            for s in (sid, doomed):
                r = await http.post(f"/sessions/{s}/v1/chat/completions", json=chat)
                assert r.status_code == 200, r.text
            r = await http.post(f"/sessions/{sid}/reward", json={"turn_rewards": [{"turn": 0, "reward": 0.5}]})
            assert r.status_code == 200, r.text
            before = (await http.get(f"/sessions/{sid}/samples")).json()["samples"]
            assert [s["turn_rewards"] for s in before] == [[0.5]]
            s = ctx.store.get(doomed)
            await s.lock.acquire()  # as a commit awaiting its journal write holds it
            late = asyncio.ensure_future(http.post(f"/sessions/{doomed}/reward", json={"turn": 0, "reward": 1.0}))
            await asyncio.sleep(0.3)  # the reward is queued on the lock
            assert (await http.delete(f"/sessions/{doomed}")).status_code == 204
            s.lock.release()
            r = await late
            assert r.status_code == 410 and r.json()["error"]["type"] == "session_gone", r.text
        async with _server(qwen3, engine, tmp_path / "j") as (http, _):
            view = (await http.get(f"/sessions/{sid}")).json()
            assert view["turn_rewards"] == {"0": 0.5}
            assert (await http.get(f"/sessions/{sid}/samples")).json()["samples"] == before
            assert (await http.get(f"/sessions/{doomed}")).status_code == 410
