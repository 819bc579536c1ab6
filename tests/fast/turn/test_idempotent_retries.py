"""A request an SDK replays (same session, same body, `x-stainless-retry-count`
> 0 or a known `Idempotency-Key`) never becomes a second turn: in flight it waits for the
original and gets its response; after commit it gets the stored response.

Real HTTP against our server and the simulated engine; the engine's request log and the
trajectory are the ground truth for "one turn".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from session_server.api.dialects import Rendered
from session_server.context import Settings
from session_server.metrics import Metrics
from session_server.turn.replay import Ident, Replay, ReplayLog, RunFresh
from trajectory.export import branch_line

from ..stack import CHAT, Stack, live_stack, metric_value

RETRY = "x-stainless-retry-count"
EXAMPLES = int(os.environ.get("TITO_RETRY_EXAMPLES", "12"))


def _turns(traj: dict[str, Any]) -> int:
    return sum(len(b["turns"]) for b in traj["branches"])


async def _metrics(st_: Stack) -> str:
    return (await st_.http.get("/metrics")).text


async def _until_busy(st_: Stack, sid: str) -> None:
    """Until the session has a turn in flight (bounded)."""
    for _ in range(500):
        if (await st_.http.get(f"/sessions/{sid}")).json()["busy"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the turn never started")


async def _until_idle(st_: Stack, sid: str) -> None:
    for _ in range(1000):
        if not (await st_.http.get(f"/sessions/{sid}")).json()["busy"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the turn never ended")


@pytest.mark.parametrize("stream", [False, True])
async def test_replay_after_commit_gets_the_stored_response(qwen3_dir: Path, stream: bool) -> None:
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        body = {**CHAT, "stream": stream, "logprobs": True}
        first = await st_.chat(sid, body, headers={RETRY: "0"})
        await asyncio.sleep(1.1)  # a re-render would show in `created` (whole seconds)
        again = await st_.chat(sid, body, headers={RETRY: "1"})
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
        metrics = await _metrics(st_)
    assert first.status_code == again.status_code == 200, again.text
    assert again.content == first.content  # the same bytes: body, or every SSE frame
    assert again.headers["content-type"] == first.headers["content-type"]
    assert len(traj["branches"]) == 1 and _turns(traj) == 1  # never a second turn, never a rollback branch
    assert len(log) == 1
    assert metric_value(metrics, "tito_replays_total", source="stored") == 1


async def test_an_identical_request_after_the_trajectory_moved_on_is_a_new_turn_and_its_retry_replays_it(
    qwen3_dir: Path,
) -> None:
    """A retry count says "a retry", not "of which request": an agent that resends a body it
    sent before (to sample the same prompt again) after the session moved on, whose first
    attempt never reached the server, arrives with count 1. It must not get the older
    identical request's response; its own genuine retry still gets its replay."""
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        first = await st_.chat(sid, CHAT, headers={RETRY: "0"})
        reply = first.json()["choices"][0]["message"]
        follow_up = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": reply["content"]},
                                          {"role": "user", "content": "And now the docs."}]}
        moved = await st_.chat(sid, follow_up, headers={RETRY: "0"})  # the trajectory moves on
        resent = await st_.chat(sid, CHAT, headers={RETRY: "1"})  # attempt 0 lost before the server
        retried = await st_.chat(sid, CHAT, headers={RETRY: "2"})  # a genuine retry of `resent`
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
    assert first.status_code == moved.status_code == resent.status_code == retried.status_code == 200
    assert resent.json()["id"] != first.json()["id"]  # its own turn, not the old response
    assert retried.content == resent.content  # the retry of it: the replay
    assert _turns(traj) == 3 and len(log) == 3  # first, moved, resent (a rollback): no fourth


async def test_a_retry_after_a_side_request_committed_is_still_a_replay(qwen3_dir: Path) -> None:
    """A harness's side request (another history: its own branch) may commit between an
    original and the original's retry (they no longer 409 each other). The original's
    client still has no answer and its turn is not built on: the retry is its replay,
    not a second turn."""
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        first = await st_.chat(sid, CHAT, headers={RETRY: "0"})
        side = {**CHAT, "messages": [{"role": "user", "content": "Generate a short title."}]}
        titled = await st_.chat(sid, side, headers={RETRY: "0"})
        retried = await st_.chat(sid, CHAT, headers={RETRY: "1"})
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
    assert first.status_code == titled.status_code == retried.status_code == 200
    assert retried.content == first.content
    assert _turns(traj) == 2 and len(log) == 2


async def test_an_answer_built_on_through_a_fork_is_never_replayed_to_a_later_identical_request(
    qwen3_dir: Path,
) -> None:
    """The agent continues from an answer but its request forks (here: other tools, which
    render into the system prompt), so no branch holds the answered turn's record with a
    turn after it. The client evidently had that answer: a later identical request whose
    first attempt was lost (count 1) is a new turn, not the old response."""
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        first = await st_.chat(sid, CHAT, headers={RETRY: "0"})
        reply = first.json()["choices"][0]["message"]
        follow_up = {**CHAT, "tools": [tool],
                     "messages": [*CHAT["messages"], {"role": "assistant", "content": reply["content"]},
                                  {"role": "user", "content": "And now the docs."}]}
        forked = await st_.chat(sid, follow_up, headers={RETRY: "0"})
        resent = await st_.chat(sid, CHAT, headers={RETRY: "1"})
        traj = await st_.trajectory(sid)
    assert first.status_code == forked.status_code == resent.status_code == 200
    assert any(b["reason"] == "tools_changed" for b in traj["branches"]), [b["reason"] for b in traj["branches"]]
    assert resent.json()["id"] != first.json()["id"]
    assert _turns(traj) == 3


async def test_replay_in_flight_waits_for_the_original(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, request_latency_ms=400) as st_:
        sid = await st_.session()
        original = asyncio.create_task(st_.chat(sid, CHAT, headers={RETRY: "0"}))
        await _until_busy(st_, sid)
        replay = await st_.chat(sid, CHAT, headers={RETRY: "1"})  # no 409: it waits
        first = await original
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
        metrics = await _metrics(st_)
    assert first.status_code == replay.status_code == 200, replay.text
    assert replay.content == first.content
    assert _turns(traj) == 1 and len(log) == 1
    assert metric_value(metrics, "tito_replays_total", source="in_flight") == 1


async def test_idempotency_key_names_one_request(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        key = {"Idempotency-Key": "req-1"}
        first = await st_.chat(sid, CHAT, headers=key)
        other = {**CHAT, "messages": [{"role": "user", "content": "Something else."}]}
        reused = await st_.chat(sid, other, headers=key)
        again = await st_.chat(sid, CHAT, headers=key)  # no retry count needed: the key says it
        traj = await st_.trajectory(sid)
    assert first.status_code == 200
    assert reused.status_code == 422, reused.text
    assert reused.json()["error"]["type"] == "idempotency_key_reused"
    assert "Idempotency-Key" in reused.json()["error"]["message"]
    assert again.status_code == 200 and again.content == first.content
    assert _turns(traj) == 1


@pytest.mark.parametrize("headers", [{}, {RETRY: "0"}, {RETRY: "soon"}])
async def test_without_a_retry_claim_a_resend_is_a_deliberate_retry(qwen3_dir: Path, headers: dict[str, str]) -> None:
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        assert (await st_.chat(sid, CHAT, headers=headers)).status_code == 200
        assert (await st_.chat(sid, CHAT, headers=headers)).status_code == 200
        traj = await st_.trajectory(sid)
    assert len(traj["branches"]) == 2 and _turns(traj) == 2  # today's behaviour: a new turn on a new branch


async def test_a_retry_of_a_request_never_seen_runs_it(qwen3_dir: Path) -> None:
    """Evicted, or never recorded: a replay with nothing to replay is a new request."""
    async with live_stack(qwen3_dir, settings=Settings(replay_per_session=0)) as st_:
        sid = await st_.session()
        r1 = await st_.chat(sid, CHAT, headers={RETRY: "0"})
        r2 = await st_.chat(sid, CHAT, headers={RETRY: "1"})  # stored 0 per session: evicted at once
        traj = await st_.trajectory(sid)
        metrics = await _metrics(st_)
    assert r1.status_code == r2.status_code == 200
    assert len(traj["branches"]) == 2  # the documented rule: a resend, so a rollback
    assert metric_value(metrics, "tito_replays_evicted_total") >= 1


async def test_a_failed_original_is_retried_fresh(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        await st_.fault("http_400")
        failed = await st_.chat(sid, CHAT, headers={RETRY: "0"})
        retried = await st_.chat(sid, CHAT, headers={RETRY: "1"})
        traj = await st_.trajectory(sid)
    assert failed.status_code >= 400
    assert retried.status_code == 200, retried.text
    assert _turns(traj) == 1


async def test_an_abandoned_turn_is_cancelled_after_the_grace(qwen3_dir: Path) -> None:
    """The client of a recorded request hangs up and no retry comes: the turn is cancelled
    once `replay_grace_s` has passed; nothing is committed."""
    async with live_stack(qwen3_dir, settings=Settings(replay_grace_s=0.2)) as st_:
        sid = await st_.session()
        await st_.fault("stall")
        writer = await _raw_chat(st_, sid, CHAT, {RETRY: "0"})
        await _until_busy(st_, sid)
        writer.close()
        await _until_idle(st_, sid)
        view = (await st_.http.get(f"/sessions/{sid}")).json()
    assert view["turns"] == 0 and view["turns_discarded"] == 1


async def test_openai_sdk_timeouts_and_retries_commit_one_turn(qwen3_dir: Path) -> None:
    """The real SDK times out (0.4 s) on a turn that takes longer (1.2 s) and retries
    (`x-stainless-retry-count` 1, 2): its retries adopt the first turn; the SDK gets it."""
    async with live_stack(qwen3_dir, request_latency_ms=1200) as st_:
        sid = await st_.session()
        client = AsyncOpenAI(base_url=f"{st_.url}/sessions/{sid}/v1", api_key="x", timeout=0.4, max_retries=3)
        try:
            resp = await client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=64)
        finally:
            await client.close()
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
        metrics = await _metrics(st_)
    assert resp.choices[0].message is not None
    assert _turns(traj) == 1 and len(log) == 1
    replays = metric_value(metrics, "tito_replays_total", source="in_flight") + metric_value(
        metrics, "tito_replays_total", source="stored")
    assert replays >= 1


async def test_stored_responses_are_bounded_per_session_and_in_bytes() -> None:
    """The memory rule: the last `per_session` responses of a session, `max_bytes` over all
    sessions (oldest first); a removed session's records go with it."""
    log = ReplayLog(Metrics(), per_session=2, max_bytes=250, grace_s=0.0)
    produced: list[int] = []

    async def turn(sid: str, k: int, count: int = 0) -> Rendered:
        ident = Ident(sid, "openai_chat", bytes([k]), None, count)

        async def produce() -> Rendered:
            produced.append(k)
            return Rendered("application/json", body=bytes([k]) * 100)

        decision = await log.decide(ident)
        if isinstance(decision, Replay):
            return decision.rendered
        assert isinstance(decision, RunFresh)
        return await decision.keep(produce())

    for k in range(3):
        await turn("a", k)
    assert log.stored_bytes == 200  # 2 per session: request 0 evicted
    await turn("a", 2, count=1)
    assert produced == [0, 1, 2]  # a replay of a stored one: no new turn
    await turn("a", 0, count=1)
    assert produced == [0, 1, 2, 0]  # evicted: produced again (a new turn)
    await turn("b", 9)
    assert log.stored_bytes <= 250  # the byte budget evicts the oldest of any session
    log.forget("b")
    log.forget("a")
    assert log.stored_bytes == 0


async def test_an_original_cancelled_before_it_started_leaves_no_entry_a_retry_waits_on() -> None:
    """The turn's task is cancelled before its first step (its `keep` never ran): the
    retry runs afresh at once instead of waiting for an original that will never end."""
    log = ReplayLog(Metrics(), per_session=2, max_bytes=1 << 20, grace_s=0.0)
    first = await log.decide(Ident("s", "openai_chat", b"d", None, 0))
    assert isinstance(first, RunFresh) and first.recorded

    async def produce() -> Rendered:
        return Rendered("application/json", body=b"{}")

    turn = produce()
    task = asyncio.ensure_future(first.keep(turn))
    task.add_done_callback(first.settle)
    task.cancel()  # before the loop ever ran it
    with contextlib.suppress(asyncio.CancelledError):
        await task
    turn.close()
    retry = await asyncio.wait_for(log.decide(Ident("s", "openai_chat", b"d", None, 1)), 2.0)
    assert isinstance(retry, RunFresh)


# --- hypothesis: interleaved duplicates, timeouts and waits -------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(0, 2), st.sampled_from([None, 0.05, 0.15])),
        st.tuples(st.just("replay"), st.integers(0, 2), st.sampled_from([None, 0.05, 0.15])),
        st.tuples(st.just("wait"), st.sampled_from([0.0, 0.05, 0.2]), st.none()),
    ),
    min_size=1, max_size=7,
)


class _Loop:
    """A live stack on its own loop in a thread: hypothesis runs sync examples against it."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready, self._stop = threading.Event(), asyncio.Event()
        self.stack: Stack | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(tokenizer_dir),),
                                         name="retries-server", daemon=True)

    async def _main(self, tokenizer_dir: Path) -> None:
        try:
            async with live_stack(tokenizer_dir, request_latency_ms=100,
                                  settings=Settings(replay_grace_s=0.3)) as stack:
                self.stack = stack
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self.error = exc
            self._ready.set()

    def __enter__(self) -> _Loop:
        self._thread.start()
        self._ready.wait(120)
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


@pytest.fixture(scope="module")
def background(tokenizer_dirs: dict[str, Path]) -> Iterator[_Loop]:
    with _Loop(tokenizer_dirs["qwen3"]) as lp:
        yield lp


def _body(k: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"Request number {k}."}], "max_tokens": 16}


async def _episode(st_: Stack, ops: list[tuple[str, Any, Any]]) -> tuple[str, dict[int, list[bytes]]]:
    """Run `ops` on a fresh session; returns it and each request's 200 bodies."""
    sid = await st_.session()
    sent: set[int] = set()
    retries: dict[int, int] = {}
    answers: dict[int, list[bytes]] = {}
    tasks: list[asyncio.Task[None]] = []

    async def post(k: int, count: int, timeout: float | None) -> None:
        url = f"{st_.url}/sessions/{sid}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=timeout if timeout is not None else 30) as c:
            with contextlib.suppress(httpx.TimeoutException):  # a client timeout: it hangs up
                r = await c.post(url, json=_body(k), headers={RETRY: str(count)})
                if r.status_code == 200:
                    answers.setdefault(k, []).append(r.content)
                else:
                    assert r.status_code in (409,), r.text  # busy with another request, never a 5xx

    for op, arg, timeout in ops:
        if op == "wait":
            await asyncio.sleep(arg)
            continue
        if op == "send" and arg in sent:
            op = "replay"  # a fresh resend would be a deliberate retry: not what this tests
        if op == "replay" and arg not in sent:
            op = "send"
        count = 0 if op == "send" else retries.setdefault(arg, 0) + 1
        retries[arg] = count
        sent.add(arg)
        tasks.append(asyncio.create_task(post(arg, count, timeout)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    await _until_idle(st_, sid)
    return sid, answers


def _committed(traj: dict[str, Any], tok: Any) -> list[int]:
    """The request number of every committed turn (from its prompt's last user message)."""
    ks: list[int] = []
    for b in traj["branches"]:
        line = branch_line(traj, b["id"])
        for t in line["turns"][len(line["turns"]) - len(b["turns"]):]:
            prompt = tok.decode(line["token_ids"][t["prompt_start"]:t["output_start"]])
            ks.append(int(re.findall(r"Request number (\d+)\.", prompt)[-1]))
    return ks


def test_hypothesis_interleaved_duplicates_never_commit_twice(background: _Loop, qwen3_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    stack = background.stack
    assert stack is not None

    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(ops=OPS)
    def check(ops: list[tuple[str, Any, Any]]) -> None:
        sid, answers = background.run(_episode(stack, ops))
        traj = background.run(stack.trajectory(sid))
        committed = _committed(traj, tok)
        assert len(committed) == len(set(committed)), f"a request committed twice: {committed} ({ops})"
        for k, bodies in answers.items():
            assert k in committed, (k, ops)
            assert all(b == bodies[0] for b in bodies), f"request {k}: replays got another response ({ops})"

    check()


async def _raw_chat(st_: Stack, sid: str, body: dict[str, Any], headers: dict[str, str]) -> asyncio.StreamWriter:
    host, port = st_.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    data = orjson.dumps(body)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(
        f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {len(data)}\r\n\r\n".encode() + data
    )
    await writer.drain()
    return writer


async def test_anthropic_messages_replay_is_the_stored_response(qwen3_dir: Path) -> None:
    """Every dialect's route goes through the same replay store (`TurnEndpoint.handle`)."""
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hello there."}]}
        url = f"/sessions/{sid}/v1/messages"
        first = await st_.http.post(url, json=body, headers={RETRY: "0"})
        again = await st_.http.post(url, json=body, headers={RETRY: "2"})
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
    assert first.status_code == again.status_code == 200, again.text
    assert again.content == first.content and first.json()["type"] == "message"
    assert len(traj["branches"]) == 1 and _turns(traj) == 1 and len(log) == 1


async def test_responses_replay_is_the_stored_response(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        body = {"model": "m", "max_output_tokens": 64, "input": "Hello there."}
        url = f"/sessions/{sid}/v1/responses"
        first = await st_.http.post(url, json=body, headers={RETRY: "0"})
        again = await st_.http.post(url, json=body, headers={RETRY: "1"})
        stored = await st_.http.get(f"{url}/{first.json()['id']}")
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
    assert first.status_code == again.status_code == stored.status_code == 200, again.text
    assert again.content == first.content and first.json()["object"] == "response"
    assert len(traj["branches"]) == 1 and _turns(traj) == 1 and len(log) == 1


@pytest.mark.parametrize("dialect", ["chat", "messages"])
async def test_a_response_that_fails_after_the_commit_is_never_retried_into_a_second_turn(
        qwen3_dir: Path, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever fails once the turn is committed (here the respond phase itself) is a 500
    `response_failed` with `x-should-retry: false`, so the SDKs stop; a retry sent anyway
    gets the same error from the replay log, and the session keeps its one turn and its
    one engine request."""
    from session_server.api import turn_endpoint

    async def broken(*_a: Any, **_k: Any) -> Rendered:
        raise RuntimeError("respond phase broke")

    monkeypatch.setattr(turn_endpoint, "render", broken)
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        if dialect == "chat":
            url, body = f"/sessions/{sid}/v1/chat/completions", CHAT
        else:
            url, body = f"/sessions/{sid}/v1/messages", {"max_tokens": 8, "messages": CHAT["messages"]}
        first = await st_.http.post(url, json=body, headers={RETRY: "0"})
        again = await st_.http.post(url, json=body, headers={RETRY: "1"})
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
        metrics = await _metrics(st_)
    for r in (first, again):
        assert r.status_code == 500 and r.headers["x-should-retry"] == "false", (r.status_code, r.headers, r.text)
        err = r.json()["error"]
        assert "committed" in err["message"] and "trajectory" in err["message"], err
    err = first.json()["error"]
    assert (err["type"] if dialect == "chat" else err["code"]) == "response_failed", err
    assert _turns(traj) == 1 and len(log) == 1 and len(traj["branches"]) == 1
    assert metric_value(metrics, "tito_replays_total", source="failed") == 1


async def test_the_anthropic_sdk_stops_at_a_response_that_failed_after_the_commit(
        qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's own retry policy (2 retries here) honours `x-should-retry: false`: one
    request, one turn."""
    import anthropic

    from session_server.api import turn_endpoint

    async def broken(*_a: Any, **_k: Any) -> Rendered:
        raise RuntimeError("respond phase broke")

    monkeypatch.setattr(turn_endpoint, "render", broken)
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session()
        client = anthropic.AsyncAnthropic(base_url=f"{st_.url}/sessions/{sid}", api_key="x", max_retries=2)
        with pytest.raises(anthropic.InternalServerError) as exc:
            await client.messages.create(model="m", max_tokens=8, messages=CHAT["messages"])
        await client.close()
        traj = await st_.trajectory(sid)
        log = await st_.engine_log()
    assert "committed" in str(exc.value)
    assert _turns(traj) == 1 and len(log) == 1
