"""A journal that cannot be written (a full disk, here its quota; its writer process
killed) commits nothing: the turn, rollback, fork, reward or session it could not store
answers 503 `journal_unavailable` in the client's shape, and the session is exactly as
before."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from session_server import journal
from session_server.context import Settings
from session_server.ops.harness import live_apps

from ..stack import live_stack

BIG = "Here is the whole log of the failing run. " * 80  # ~3.4 KB per user message


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": 8}


async def test_a_full_journal_commits_nothing_and_answers_503(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(journal, "FAILURE_HOLD_S", 0.0)  # every request reaches its commit
    settings = Settings(journal_dir=str(tmp_path / "j"), journal_max_bytes=65536)
    async with live_stack(tokenizer_dirs["qwen3"], settings=settings) as st:
        sid = await st.session()
        messages: list[dict[str, Any]] = [{"role": "user", "content": BIG}]
        full = None
        for _ in range(40):
            r = await st.chat(sid, _body(messages))
            if r.status_code != 200:
                full = r
                break
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": BIG}]
        assert full is not None, "the quota never filled"
        assert full.status_code == 503 and full.json()["error"]["type"] == "journal_unavailable", full.text
        assert full.headers["retry-after"] == "10"
        before = await st.trajectory(sid)
        assert len(before["branches"][0]["turns"]) >= 1

        rollback = messages[:1]  # the first question again: a new branch from checkpoint 0
        fork = [{"role": "user", "content": "A different task altogether. " + BIG}]
        for attempt in (messages, rollback, fork):
            r = await st.chat(sid, _body(attempt))
            assert r.status_code == 503 and r.json()["error"]["type"] == "journal_unavailable", r.text
            assert await st.trajectory(sid) == before  # not a token, branch or turn more
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["turns"] == len(before["branches"][0]["turns"]) and len(view["branches"]) == 1

        # after a failed write, new changes are refused up front for a while (small ones that
        # might still fit too: the disk is known full)
        monkeypatch.setattr(journal, "FAILURE_HOLD_S", 30.0)
        r = await st.http.post(f"/sessions/{sid}/reward", json={"reward": 1.0})
        assert r.status_code == 503, r.text
        assert (await st.http.get(f"/sessions/{sid}")).json()["reward"] is None
        r = await st.http.post("/sessions", json={})
        assert r.status_code == 503 and r.json()["error"]["type"] == "journal_unavailable", r.text

        anthropic = await st.http.post(f"/sessions/{sid}/v1/messages", json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": BIG}]})
        assert anthropic.status_code == 503 and anthropic.json()["type"] == "error", anthropic.text  # its own shape

        # what the operator sees: the records that were stored, the failed transactions
        # and the writer process's CPU (its transactions did run)
        metrics = (await st.http.get("/metrics")).text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("tito_journal_") and not line.startswith("#")}
        assert values["tito_journal_records_total"] >= 2 and values["tito_journal_syncs_total"] >= 1
        assert values["tito_journal_failures_total"] >= 1
        assert values["tito_journal_writer_cpu_seconds_total"] > 0
        assert values['tito_journal_info{sync="full"}'] == 1  # the mode it runs, the default


async def test_a_turn_waiting_for_a_killed_writer_answers_503_and_so_does_every_later_change(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """The writer process dies with the turn's record sent and not acknowledged: the
    turn is a 503, never a 200 (its record may or may not be in the file), and every
    change after it too; reads still answer."""
    settings = Settings(journal_dir=str(tmp_path / "j"))
    async with live_stack(tokenizer_dirs["qwen3"], settings=settings) as st:
        j = live_apps[st.url].state.ctx.journal
        sid = await st.session()
        first = await st.chat(sid, _body([{"role": "user", "content": "hi"}]))
        assert first.status_code == 200, first.text
        before = await st.trajectory(sid)
        pid = j.writer_pid
        os.kill(pid, signal.SIGSTOP)  # the next record reaches the writer and stays there
        sent = len(j._waiting)  # (a read's touch record may be on its way too)
        turn = asyncio.ensure_future(st.chat(sid, _body([{"role": "user", "content": "hi"}, first.json()[
            "choices"][0]["message"], {"role": "user", "content": "go on"}])))
        for _ in range(600):  # the turn's record is sent: it waits for the writer's ack
            if len(j._waiting) > sent:
                break
            await asyncio.sleep(0.01)
        assert len(j._waiting) > sent and not turn.done()
        os.kill(pid, signal.SIGKILL)
        r = await turn
        assert r.status_code == 503 and r.json()["error"]["type"] == "journal_unavailable", r.text
        assert await st.trajectory(sid) == before
        again = await st.chat(sid, _body([{"role": "user", "content": "hi"}]))
        assert again.status_code == 503 and again.json()["error"]["type"] == "journal_unavailable", again.text
        r = await st.http.post("/sessions", json={})
        assert r.status_code == 503 and r.json()["error"]["type"] == "journal_unavailable", r.text
        assert (await st.http.get(f"/sessions/{sid}")).status_code == 200
        health = await st.http.get("/health")  # a proxy routes away; an operator restarts it
        assert health.status_code == 503 and health.json()["status"] == "journal_down", health.text
