"""Durable sessions end to end: a `serve` killed with SIGKILL mid-run loses nothing.

200 agents run 5-turn episodes against a journaling server (one forks at turn 1, one
in ten rolls back at turn 3; every session pauses between turns 1 and 2 while the
trainer sets a new weight version). During turn 2, with turns in flight, the server
is killed with SIGKILL and started again on the same journal; each agent retries what
failed as an SDK does (same body, `x-stainless-retry-count` > 0). The same episodes
run once more without the crash (the simulated engine is seeded: same context, same
tokens), and every session's training samples must be byte-identical between the two
runs: every committed turn is back, none is committed twice, versions are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.engines.base import derive_seed
from session_server.ops.cluster import free_ports
from session_server.sim import running_sim
from trajectory.sample_formats import load_samples_json

SESSIONS = 200
TURNS = 5
PAUSE_AFTER = 2  # turns done by every session before the trainer's pause and update
READY_S = 240.0
RETRY_S = 180.0


class Server:
    """One `serve` process on a fixed port and journal directory (restartable)."""

    def __init__(self, tokenizer: Path, engine: str, journal: Path, log: Path, *extra: str) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "session_server.ops.cli", "serve", "--tokenizer", str(tokenizer),
                     "--engine", f"sglang={engine}", "--port", str(self.port), "--journal-dir", str(journal),
                     "--instance-id", "w0", "--cpu-workers", "1", "--decode-processes", "0",
                     "--log-level", "warning", *extra]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        async with httpx.AsyncClient(timeout=2) as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + READY_S
            while True:
                assert self.proc.poll() is None, self.log.read_text()[-3000:]
                assert loop.time() < deadline, self.log.read_text()[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                await asyncio.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.asynccontextmanager
async def serving(*args: Any) -> AsyncIterator[Server]:
    server = Server(*args)
    try:
        await server.start()
        yield server
    finally:
        server.stop()


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    """A request as an SDK sends it: retried on a dead connection or a 5xx, with the same
    body and a growing `x-stainless-retry-count` (the replay log's retry marker)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETRY_S
    attempt = 0
    while True:
        try:
            r = await http.post(url, json=body, headers={"x-stainless-retry-count": str(attempt)})
            if r.status_code < 500:
                r.raise_for_status()
                return r
        except (httpx.TransportError, httpx.RemoteProtocolError):
            pass
        attempt += 1
        assert loop.time() < deadline, f"{url}: no answer within {RETRY_S} s"
        await asyncio.sleep(0.2)


class Agent:
    """Agent `k`'s deterministic episode (its messages depend only on `k` and replies)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.sid = ""
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": f"Session {k}: fix the failing test."}]

    async def turn(self, http: httpx.AsyncClient, base: str, t: int) -> None:
        if t == 1 and self.k % 50 == 0:  # the agent rewrites its task: a fork (before the crash)
            self.messages[0] = {"role": "user", "content": f"Session {self.k}: fix the failing tests, all of them."}
        if t == 3 and self.k % 10 == 1:  # it drops its last exchange and asks again: a rollback (after)
            del self.messages[-2:]
            self.messages[-1] = {"role": "user", "content": f"Session {self.k}, step 2 again: try another way."}
        body = {"model": "m", "messages": self.messages, "max_tokens": 16}
        r = await _post(http, f"{base}/sessions/{self.sid}/v1/chat/completions", body)
        reply = r.json()["choices"][0]["message"]
        self.messages.append({"role": "assistant", "content": reply["content"] or ""})
        self.messages.append({"role": "user", "content": f"Session {self.k}, step {t}: go on."})


async def _episodes(base: str, during_crash_turn: Callable[[int], Any] | None = None) -> dict[int, bytes]:
    """Every agent's episode against `base`; `during_crash_turn(done)` is called as turns
    of turn `PAUSE_AFTER` complete. Returns each agent's samples, session id masked."""
    agents = [Agent(k) for k in range(SESSIONS)]
    limits = httpx.Limits(max_connections=SESSIONS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        for a in agents:
            a.sid = (await _post(http, f"{base}/sessions", {"metadata": {"agent": a.k}})).json()["session_id"]
        for t in range(TURNS):
            if t == PAUSE_AFTER:  # the trainer's update: pause, new weights, resume
                await _post(http, f"{base}/control/pause", {"mode": "abort"})
                await _post(http, f"{base}/control/weight_version", {"version": 7})
                await _post(http, f"{base}/control/resume", {})
            done = 0

            async def one(a: Agent, t: int = t) -> None:
                nonlocal done
                await a.turn(http, base, t)
                done += 1
                if t == PAUSE_AFTER and during_crash_turn is not None:
                    await during_crash_turn(done)

            await asyncio.gather(*(one(a) for a in agents))
        for a in agents:
            await _post(http, f"{base}/sessions/{a.sid}/reward", {"reward": a.k / 10})
        out = {}
        for a in agents:
            r = await http.get(f"{base}/sessions/{a.sid}/samples")
            r.raise_for_status()
            out[a.k] = r.content.replace(a.sid.encode(), b"SID")
        return out


async def test_a_killed_server_restarts_with_every_committed_turn_and_identical_samples(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=11, latency_ms=4.0) as engine:
        async with serving(qwen3, engine, tmp_path / "j-clean", tmp_path / "clean.log") as clean:
            expected = await _episodes(clean.url)

    async with running_sim("sglang", str(qwen3), seed=11, latency_ms=4.0) as engine:
        server = Server(qwen3, engine, tmp_path / "j-crash", tmp_path / "crash.log")
        crashed = asyncio.Event()

        async def crash(done: int) -> None:
            if done >= SESSIONS * 2 // 5 and not crashed.is_set():
                crashed.set()
                server.kill()  # turns are in flight: some committed and unanswered, some not committed
                await server.start()

        try:
            await server.start()
            got = await _episodes(server.url, crash)
        finally:
            server.stop()
    assert crashed.is_set()
    log = (tmp_path / "crash.log").read_text()
    assert "sessions" in log and "from" in log  # the recovery line
    different = [k for k in expected if expected[k] != got[k]]
    assert not different, (f"{len(different)} sessions differ, e.g. {different[0]}:\n"
                           f"{expected[different[0]][:600]!r}\n{got[different[0]][:600]!r}")


@pytest.mark.parametrize("reason", ["deleted"])
async def test_a_closed_session_is_gone_after_a_restart(tokenizer_dirs: dict[str, Path], tmp_path: Path,
                                                        reason: str) -> None:
    """410 with the tombstone's reason, before and after a restart; an unknown id stays 404."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3)) as engine:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            assert (await http.delete(f"/sessions/{sid}")).status_code == 204
            r = await http.get(f"/sessions/{sid}")
            assert r.status_code == 410 and r.json()["error"]["type"] == "session_gone"
            server.kill()
            await server.start()
            r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 410 and "closed by DELETE" in r.json()["error"]["message"]
            assert (await http.get("/sessions/w0.0123456789abcdef0123456789abcdef")).status_code == 404




async def test_a_retry_of_a_turn_committed_before_a_crash_gets_that_turn(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """The response of a committed turn dies with the process: the SDK's retry after the
    restart is answered from the journaled turn (rendered again), never a second turn."""
    qwen3 = tokenizer_dirs["qwen3"]
    body = {"model": "m", "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 16}
    async with running_sim("sglang", str(qwen3), seed=2, latency_ms=25.0) as engine:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log", "--replay-grace-s", "30") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            url = f"/sessions/{sid}/v1/chat/completions"
            with pytest.raises(httpx.TimeoutException):  # the SDK gives up; the turn runs on (replay grace)
                await http.post(url, json=body, headers={"x-stainless-retry-count": "0"}, timeout=0.05)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while (await http.get(f"/sessions/{sid}")).json()["turns"] == 0:
                assert loop.time() < deadline
                await asyncio.sleep(0.05)
            server.kill()  # committed and journaled; its answer was never sent
            await server.start()
            retry = await http.post(url, json=body, headers={"x-stainless-retry-count": "1"})
            assert retry.status_code == 200, retry.text
            traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
            assert [len(b["turns"]) for b in traj["branches"]] == [1]  # no second turn, no new branch
            turn = traj["branches"][0]["turns"][0]
            assert retry.json()["choices"][0]["message"]["content"] == turn["assistant_message"]["content"]
            again = await http.post(url, json=body, headers={"x-stainless-retry-count": "2"})
            assert again.content == retry.content  # stored now: the same bytes


async def test_with_auth_a_session_token_gets_410_for_its_closed_session(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """Auth cannot check a token against a session it no longer holds: the tombstone's
    410 (its agent stops), not a 401 that would send it fixing its key."""
    qwen3 = tokenizer_dirs["qwen3"]
    admin = {"Authorization": "Bearer admin-token-for-tests"}
    async with running_sim("sglang", str(qwen3)) as engine:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log",
                           "--admin-token", "admin-token-for-tests") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            made = (await http.post("/sessions", json={}, headers=admin)).json()
            sid, own = made["session_id"], {"Authorization": f"Bearer {made['api_key']}"}
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert (await http.post(f"/sessions/{sid}/v1/chat/completions", headers=own, json=chat)).status_code == 200
            assert (await http.delete(f"/sessions/{sid}", headers=admin)).status_code == 204
            r = await http.post(f"/sessions/{sid}/v1/chat/completions", headers=own, json=chat)
            assert r.status_code == 410 and r.json()["error"]["type"] == "session_gone"
            unknown = "/sessions/w0.0123456789abcdef0123456789abcdef/v1/chat/completions"
            assert (await http.post(unknown, headers=own, json=chat)).status_code == 401


async def test_stored_responses_and_previous_response_id_survive_a_restart(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """A Responses agent that chains by `previous_response_id` (it never resends history)
    goes on after a restart: the stored objects came back with the session."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=4) as engine:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            url = f"/sessions/{sid}/v1/responses"
            first = (await http.post(url, json={"model": "m", "input": "List the files.", "max_output_tokens": 8}))
            assert first.status_code == 200, first.text
            rid = first.json()["id"]
            server.kill()
            await server.start()
            got = await http.get(f"{url}/{rid}")
            assert got.status_code == 200 and got.json()["output"] == first.json()["output"], got.text
            nxt = await http.post(url, json={"model": "m", "input": "Now open the first.", "max_output_tokens": 8,
                                             "previous_response_id": rid})
            assert nxt.status_code == 200, nxt.text
            traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
            assert [len(b["turns"]) for b in traj["branches"]] == [2]  # appended to the first turn, no fork


async def test_a_damaged_journal_stops_serve_with_status_65_naming_the_record(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    from session_server.journal import JOURNAL_EXIT_STATUS, Journal, journal_path

    path = journal_path(tmp_path / "j", "w0")
    j = Journal(path)
    list(j.read())
    j.start(asyncio.get_running_loop())
    await j.append("w0.aaaa", "create", b"MARKER-" + b"z" * 40)
    await j.close()
    data = bytearray(path.read_bytes())
    data[data.index(b"MARKER-") + 3] ^= 0x20
    path.write_bytes(bytes(data))
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3)) as engine:
        server = Server(qwen3, engine, tmp_path / "j", tmp_path / "log")
        with (tmp_path / "log").open("ab") as out:
            proc = subprocess.Popen(server.args, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        try:
            rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, READY_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    log = (tmp_path / "log").read_text()
    assert rc == JOURNAL_EXIT_STATUS, log[-2000:]
    assert "record 1 (create of session 'w0.aaaa') fails its checksum" in log, log[-2000:]


READ = {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


async def _chat_episode(http: httpx.AsyncClient, sid: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."},
                                      {"role": "user", "content": "Find the bug in main.py."}]
    for t in range(3):
        r = await http.post(f"/sessions/{sid}/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 48, "logprobs": True,
            "tools": [{"type": "function", "function": READ}]})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        messages.append({k: v for k, v in msg.items() if v is not None})
        for call in msg.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"line {t}: x = 1 / 0"})
        if not msg.get("tool_calls"):
            messages.append({"role": "user", "content": f"Step {t}: go on."})


async def _messages_episode(http: httpx.AsyncClient, sid: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find the bug in main.py."}]
    tool = {"name": READ["name"], "description": READ["description"], "input_schema": READ["parameters"]}
    for t in range(3):
        r = await http.post(f"/sessions/{sid}/v1/messages", json={
            "model": "m", "system": "You fix bugs.", "messages": messages, "max_tokens": 48, "tools": [tool]})
        assert r.status_code == 200, r.text
        content = r.json()["content"]
        messages.append({"role": "assistant", "content": content})
        uses = [b for b in content if b["type"] == "tool_use"]
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u["id"], "content": f"line {t}: x = 1 / 0"} for u in uses
        ] or f"Step {t}: go on."})


async def _responses_episode(http: httpx.AsyncClient, sid: str) -> None:
    body: dict[str, Any] = {"model": "m", "instructions": "You fix bugs.", "input": "Find the bug in main.py.",
                            "max_output_tokens": 48, "tools": [{"type": "function", **READ}]}
    for t in range(3):
        r = await http.post(f"/sessions/{sid}/v1/responses", json=body)
        assert r.status_code == 200, r.text
        calls = [o for o in r.json()["output"] if o["type"] == "function_call"]
        body = {**body, "previous_response_id": r.json()["id"], "input": [
            {"type": "function_call_output", "call_id": c["call_id"], "output": f"line {t}: x = 1 / 0"} for c in calls
        ] or f"Step {t}: go on."}


async def test_every_dialect_with_tools_comes_back_byte_for_byte(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Chat, Messages and Responses episodes with tool calls and results: the trajectory
    and the samples read after a SIGKILL and restart are the bytes read before it."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=8) as engine:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            sids = [(await http.post("/sessions", json={"metadata": {"d": d}})).json()["session_id"] for d in range(3)]
            await asyncio.gather(_chat_episode(http, sids[0]), _messages_episode(http, sids[1]),
                                 _responses_episode(http, sids[2]))
            await http.post(f"/sessions/{sids[0]}/reward", json={"reward": 1.0, "metadata": {"judge": "tests"}})
            reads = ("trajectory", "trajectory?format=npz", "samples")
            before = {(s, p): (await http.get(f"/sessions/{s}/{p}")).content for s in sids for p in reads}
            calls = sum(b"tool_call" in before[(s, "trajectory")] for s in sids)
            server.kill()
            await server.start()
            after = {(s, p): (await http.get(f"/sessions/{s}/{p}")).content for s in sids for p in reads}
    assert calls >= 2, "the episodes should include tool calls"
    assert [k for k in before if before[k] != after[k]] == []


async def test_ttl_deadlines_carry_over_a_restart(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A session's TTL clock counts from its last use, a read included, across a restart
    (the downtime is idle time); past it, the session expires with a 410 tombstone."""
    qwen3 = tokenizer_dirs["qwen3"]
    ttl = 12.0
    loop = asyncio.get_running_loop()
    async with running_sim("sglang", str(qwen3)) as engine:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log", "--sweep-interval-s", "0.2") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            sid = (await http.post("/sessions", json={"ttl_s": ttl})).json()["session_id"]
            assert (await http.post(f"/sessions/{sid}/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})).status_code == 200
            turn_at = loop.time()
            await asyncio.sleep(5)
            assert (await http.get(f"/sessions/{sid}")).status_code == 200  # a read: the TTL starts again
            read_at = loop.time()
            await asyncio.sleep(0.5)  # a read's TTL record is not waited for (a read pays no sync)
            server.kill()
            await server.start()
            await asyncio.sleep(max(0.0, turn_at + ttl + 1 - loop.time()))
            assert loop.time() - read_at < ttl - 1, "the restart took too long for this test's clock"
            assert (await http.get(f"/sessions/{sid}")).status_code == 200, \
                "expired a TTL after its turn, not after its read"
            read_at = loop.time()  # (that read counted too)
            await asyncio.sleep(max(0.0, read_at + ttl + 1.5 - loop.time()))
            r = await http.get(f"/sessions/{sid}")
            assert r.status_code == 410 and "expired" in r.json()["error"]["message"], r.text


async def test_a_sessions_sampling_policy_seed_and_turn_sampling_survive_a_restart(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """The create record keeps the policy and seed, the turn record each turn's sampling:
    after a kill the session still pins and derives, and its first turn's record is intact."""
    qwen3 = tokenizer_dirs["qwen3"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count to ten."}]
    async with running_sim("sglang", str(qwen3)) as engine, httpx.AsyncClient() as sim:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log", "--sampling-policy", "client") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            sid = (await http.post("/sessions", json={"sampling_policy": "pinned", "seed": 17,
                                                      "sampling": {"temperature": 1.0}})).json()["session_id"]
            url = f"/sessions/{sid}/v1/chat/completions"
            r = await http.post(url, json={"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0.0})
            assert r.status_code == 200, r.text
            before = (await http.get(f"/sessions/{sid}/trajectory")).json()["branches"][0]["turns"][0]["extra"]
            server.kill()
            await server.start()
            view = (await http.get(f"/sessions/{sid}")).json()
            assert (view["sampling_policy"], view["seed"], view["sampling"]) == ("pinned", 17, {"temperature": 1.0})
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "Again."}]
            r = await http.post(url, json={"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0.0})
            assert r.status_code == 200, r.text
            turns = (await http.get(f"/sessions/{sid}/trajectory")).json()["branches"][0]["turns"]
            log = (await sim.get(f"{engine}/sim/requests")).json()
    assert turns[0]["extra"]["sampling"] == before["sampling"]
    assert before["sampling"]["seeds"] == [derive_seed(17, 0, 0, 0)]
    assert [(q["sampling_params"]["temperature"], q["sampling_params"]["sampling_seed"]) for q in log] == [
        (1.0, derive_seed(17, 0, 0, 0)), (1.0, derive_seed(17, 0, 1, 0))]
    assert turns[1]["extra"]["sampling"]["client"]["temperature"] == 0.0


async def test_sampling_support_and_its_pinned_sampling_survive_a_restart(
    tokenizer_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The supports of a committed turn come back byte for byte in its samples; the
    session still asks for them and (its `client` policy kept) still refuses a turn that
    changes its top_p."""
    qwen3 = tokenizer_dirs["qwen3"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "fix it"}], "max_tokens": 24}
    async with running_sim("sglang", str(qwen3)) as engine:
        async with serving(qwen3, engine, tmp_path / "j", tmp_path / "log") as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            sid = (await http.post("/sessions", json={"sampling_support": 8, "sampling_policy": "client",
                                                      "sampling": {"top_k": 4, "temperature": 1.0}})).json()["session_id"]
            first = await http.post(f"/sessions/{sid}/v1/chat/completions", json=chat)
            assert first.status_code == 200, first.text
            before = (await http.get(f"/sessions/{sid}/samples", params={"format": "json"})).content
            server.kill()
            await server.start()
            after = (await http.get(f"/sessions/{sid}/samples", params={"format": "json"})).content
            refused = await http.post(f"/sessions/{sid}/v1/chat/completions", json={**chat, "top_p": 0.5})
            more = {**chat, "messages": [*chat["messages"], first.json()["choices"][0]["message"],
                                         {"role": "user", "content": "again"}]}
            assert (await http.post(f"/sessions/{sid}/v1/chat/completions", json=more)).status_code == 200
            (s,) = load_samples_json((await http.get(f"/sessions/{sid}/samples", params={"format": "json"})).content)
    assert after == before and b'"sampling_support"' in before
    assert refused.status_code == 400 and "top_p" in refused.text
    assert s.sampling_support is not None
    sampled = [i for i in range(len(s)) if s.loss_mask[i]]
    assert sampled and all(int(s.token_ids[i]) in s.sampling_support.row(i).tolist() for i in sampled)
