"""Gaps of live streaming, end to end through HTTP on the simulated engine:

- a stream that fails validation (the engine's streamed ids disagree with its final
  answer, a chunk with a bad id or logprob, streamed text the final parse does not
  extend) ends with the dialect's error event and commits nothing, in every dialect;
- the fallback whole-parse path (a family `incremental.markup_for` does not cover)
  streams text while the engine runs;
- a streamed request survives a transient connect error before anything was shown;
- a streamed request that carries a retry marker keeps its turn for the replay grace
  when its client leaves: the SDK's retry gets the whole stream and one commit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ..stack import Stack, live_stack

USER = [{"role": "user", "content": "Fix the failing test."}]


def _request(dialect: str) -> tuple[str, dict[str, Any]]:
    """(route suffix, streamed body) of one turn in `dialect`."""
    if dialect == "chat":
        return "chat/completions", {"model": "m", "messages": USER, "max_tokens": 48, "stream": True,
                                    "logprobs": True}
    if dialect == "anthropic":
        return "messages", {"model": "m", "messages": USER, "max_tokens": 48, "stream": True}
    return "responses", {"model": "m", "input": "Fix the failing test.", "max_output_tokens": 48, "stream": True}


def _events(body: str) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each SSE frame (`[DONE]` as the string)."""
    out: list[tuple[str | None, Any]] = []
    for frame in body.split("\n\n"):
        name, data = None, None
        for line in frame.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                raw = line[5:].strip()
                data = raw if raw == "[DONE]" else json.loads(raw)
        if data is not None:
            out.append((name, data))
    return out


def _failed(dialect: str, events: list[tuple[str | None, Any]]) -> str:
    """The error message the stream ended with, in the dialect's own shape."""
    if dialect == "chat":
        assert events[-1][1] == "[DONE]"
        err = events[-2][1]
        assert set(err) == {"error"}, err
        return str(err["error"]["message"])
    if dialect == "anthropic":
        name, data = events[-1]
        assert name == "error" and data["type"] == "error", events[-1]
        return str(data["error"]["message"])
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed", events[-1]
    assert any(n == "error" for n, _ in events)
    return str(data["response"]["error"]["message"])


async def _stream_fails(st: Stack, sid: str, dialect: str) -> tuple[str, list[tuple[str | None, Any]]]:
    route, body = _request(dialect)
    async with st.http.stream("POST", f"/sessions/{sid}/v1/{route}", json=body) as r:
        assert r.status_code == 200
        events = _events((await r.aread()).decode())
    return _failed(dialect, events), events


async def _nothing_committed(st: Stack, sid: str) -> None:
    """No turn, and the next (non-streamed) turn still extends the old trajectory."""
    view = (await st.http.get(f"/sessions/{sid}")).json()
    assert view["turns"] == 0 and not view["busy"] and len(view["branches"]) == 1
    r = await st.chat(sid, {"model": "m", "messages": USER, "max_tokens": 16})
    assert r.status_code == 200, r.text
    traj = (await st.trajectory(sid))["branches"]
    assert len(traj) == 1 and len(traj[0]["turns"]) == 1


DIALECTS = ["chat", "anthropic", "responses"]


@pytest.mark.parametrize(("fault", "what"), [("stream_diverges", "tokens"), ("stream_logprob_diverges", "logprobs")])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_streamed_values_that_disagree_with_the_final_answer_fail_the_turn(
        qwen3_dir: Path, dialect: str, fault: str, what: str) -> None:
    """SGLang frames are cumulative: its final frame can contradict what the stream showed
    (vLLM's final answer is its chunks joined, so it cannot)."""
    async with live_stack(qwen3_dir, "sglang", latency_ms=1) as st:
        sid = await st.session()
        await st.fault(fault)
        message, _ = await _stream_fails(st, sid, dialect)
        assert f"streamed {what} differ" in message
        await _nothing_committed(st, sid)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_streamed_text_the_final_parse_does_not_extend_fails_the_turn(
        qwen3_dir: Path, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`TextStreamer.tail` refuses a final message whose fields do not start with what was
    streamed (a parser disagreement: simulated by changing the validated message)."""
    import dataclasses

    from session_server.turn import pipeline as turns

    real = turns.validate

    async def lying(*a: Any, **kw: Any) -> Any:
        checked = await real(*a, **kw)
        msg = dict(checked.message)
        for name in ("content", "reasoning_content"):
            if msg.get(name):
                msg[name] = "!" + str(msg[name])
        return dataclasses.replace(checked, message=msg)

    monkeypatch.setattr(turns, "validate", lying)
    async with live_stack(qwen3_dir, "sglang", latency_ms=3) as st:
        sid = await st.session()
        message, _ = await _stream_fails(st, sid, dialect)
        assert "is not a prefix of the parsed message" in message
        monkeypatch.setattr(turns, "validate", real)
        await _nothing_committed(st, sid)


@pytest.mark.parametrize(("protocol", "fault"), [
    ("sglang", "stream_nan_logprob"), ("sglang", "stream_positive_logprob"), ("sglang", "stream_oov_id"),
    ("sglang", "stream_negative_id"), ("vllm", "stream_nan_logprob"), ("vllm", "stream_oov_id"),
])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_chunk_with_a_bad_id_or_logprob_fails_the_turn_unshown(
        qwen3_dir: Path, protocol: str, fault: str, dialect: str) -> None:
    """The bad chunk is refused as it arrives: never shown to the agent (no logprob frame
    carries it), the stream ends with the error event, nothing is committed."""
    async with live_stack(qwen3_dir, protocol, latency_ms=1) as st:
        sid = await st.session()
        await st.fault(fault)
        message, events = await _stream_fails(st, sid, dialect)
        assert "stream chunk rejected" in message, message
        await _nothing_committed(st, sid)
    shown = [c for _, d in events if isinstance(d, dict) and d.get("choices")
             for c in ((d["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert all(c["logprob"] is not None and c["logprob"] <= 0 for c in shown)


async def test_the_fallback_parse_streams_text_before_the_engine_finishes(tokenizer_dirs: dict[str, Path]) -> None:
    """Llama 3.x has no incremental markup (`markup_for` is None): its text deltas come
    from the whole-parse fallback, still while the engine samples."""
    import time

    from openai import AsyncOpenAI

    from session_server.turn.incremental import markup_for
    from trajectory.codec import load_codec

    llama = tokenizer_dirs["llama3.1"]
    assert markup_for(load_codec(str(llama)), tools=False, template_kwargs=None) is None
    async with live_stack(llama, "sglang", latency_ms=4) as st:
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        stamps: list[tuple[float, str]] = []
        finished_at = None
        stream = await oai.chat.completions.create(model="m", messages=USER, max_tokens=200, stream=True)  # type: ignore[arg-type]
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append((time.monotonic(), chunk.choices[0].delta.content))
            if chunk.choices and chunk.choices[0].finish_reason and finished_at is None:
                finished_at = time.monotonic()
        await oai.close()
        log = await st.engine_log()
        message = (await st.trajectory(sid))["branches"][0]["turns"][-1]["assistant_message"]
    assert finished_at is not None and len(stamps) > 2
    engine_done = log[-1]["finished_s"]  # the simulator runs in this process: same clock
    assert sum(t < engine_done for t, _ in stamps) > 1, "the fallback parse waited for the whole generation"
    assert "".join(x for _, x in stamps) == message["content"]


def test_think_close_ids_are_encoded_once_per_tokenizer(qwen3_dir: Path) -> None:
    """Every streamed turn needs `</think>` as ids (`TextStreamer`'s what-if): one encode
    per tokenizer, not one per turn; the ids are the tokenizer's own."""
    from transformers import AutoTokenizer

    from session_server.turn.text_stream import think_close_ids

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    want = tok.encode("</think>", add_special_tokens=False)
    calls: list[str] = []

    class Counting:
        def encode(self, text: str, **kw: Any) -> list[int]:
            calls.append(text)
            return list(tok.encode(text, **kw))

    counting = Counting()
    assert [think_close_ids(counting) for _ in range(5)] == [want] * 5
    assert calls == ["</think>"]

    class Broken:
        def encode(self, text: str, **kw: Any) -> list[int]:  # cannot say: no what-if, remembered too
            calls.append(text)
            raise ValueError("no such text")

    broken = Broken()
    assert think_close_ids(broken) == [] and think_close_ids(broken) == []
    assert calls == ["</think>", "</think>"]


def _closed_port() -> int:
    """A port nothing listens on: connecting to it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_streamed_turn_survives_a_refused_connection_before_any_token(
        qwen3_dir: Path, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's first streamed `/generate` connection is refused (nothing sent, nothing
    shown): it is retried as a non-streamed request is, the stream goes on and commits once;
    the single engine is not marked down."""
    from session_server.engines.http import EngineHTTP

    dead = f"http://127.0.0.1:{_closed_port()}"
    refused: list[str] = []
    real_session = EngineHTTP.session

    class RefusedOnce:
        def __init__(self, session: Any, base: str) -> None:
            self._s, self._base = session, base

        def post(self, url: str, **kw: Any) -> Any:
            if not refused and url.endswith("/generate"):
                refused.append(url)
                url = dead + url.removeprefix(self._base)
            return self._s.post(url, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._s, name)

    monkeypatch.setattr(EngineHTTP, "session", lambda self: RefusedOnce(real_session(self), self.base_url))
    async with live_stack(qwen3_dir, protocol, latency_ms=1) as st:
        sid = await st.session()
        route, body = _request("chat")
        async with st.http.stream("POST", f"/sessions/{sid}/v1/{route}", json=body) as r:
            events = _events((await r.aread()).decode())
        traj = (await st.trajectory(sid))["branches"][0]
        again = await st.chat(sid, {"model": "m", "messages": USER, "max_tokens": 8})
    assert refused, "the refusal was not injected"
    assert events[-1][1] == "[DONE]" and not any("error" in d for _, d in events if isinstance(d, dict))
    content = "".join((d["choices"][0]["delta"].get("content") or "") for _, d in events
                      if isinstance(d, dict) and d.get("choices"))
    assert len(traj["turns"]) == 1 and content == (traj["turns"][0]["assistant_message"].get("content") or "")
    assert again.status_code == 200, again.text  # the engine was not marked down


# ~150 tokens at 5 ms each: a turn still sampling well after its client hung up
LONG = {"content": " ".join(f"step {i}: the fix renames the import and reruns the failing test." for i in range(10))}


async def _leave_after_first_text(st: Stack, sid: str, raw: bytes, headers: dict[str, str]) -> bytes:
    """Stream a chat, hang up once a text delta has arrived; the bytes read until then."""
    got = b""
    async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions", content=raw,
                              headers={"Content-Type": "application/json", **headers}) as r:
        assert r.status_code == 200
        async for part in r.aiter_raw():
            got += part
            if b'"content":"' in got.replace(b'"content":""', b""):
                break
    return got  # leaving the block closes the connection mid-stream


async def _turns_when_idle(st: Stack, sid: str) -> int:
    import asyncio

    for _ in range(500):
        view = (await st.http.get(f"/sessions/{sid}")).json()
        if not view["busy"]:
            return int(view["turns"])
        await asyncio.sleep(0.01)
    raise AssertionError("the turn never ended")


@pytest.mark.parametrize("marker", ["x-stainless-retry-count", "idempotency-key"])
async def test_a_streamed_turn_whose_client_leaves_is_kept_for_the_retry(qwen3_dir: Path, marker: str) -> None:
    """With a retry marker, a client that hangs up mid-stream leaves its turn running for
    the replay grace; its retry (same body) follows the stream live: every frame from the
    first (byte for byte what the first attempt was sent), then the rest as sampled; the
    session gets one commit."""
    import time

    import orjson

    first, retry = ({"x-stainless-retry-count": "0"}, {"x-stainless-retry-count": "1"}) \
        if marker == "x-stainless-retry-count" else ({"Idempotency-Key": "k-1"}, {"Idempotency-Key": "k-1"})
    raw = orjson.dumps({"model": "m", "messages": USER, "max_tokens": 200, "stream": True})
    async with live_stack(qwen3_dir, "sglang", latency_ms=5) as st:
        sid = await st.session()
        await st.script(sid, LONG)  # the retry arrives while the turn still samples
        seen = await _leave_after_first_text(st, sid, raw, first)
        got, stamps = b"", []
        async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions", content=raw,
                                  headers={"Content-Type": "application/json", **retry}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            async for part in r.aiter_raw():
                got += part
                stamps.append(time.monotonic())
        turns = await _turns_when_idle(st, sid)
        traj = (await st.trajectory(sid))["branches"]
        log = await st.engine_log()
    assert got.startswith(seen) and got.rstrip().endswith(b"data: [DONE]")
    assert turns == 1 and len(traj) == 1 and len(log) == 1  # one generation, one commit
    assert stamps[0] < log[0]["finished_s"], "the retry waited for the commit instead of following the stream"
    events = _events(got.decode())
    content = "".join((d["choices"][0]["delta"].get("content") or "") for _, d in events
                      if isinstance(d, dict) and d.get("choices"))
    assert content == (traj[0]["turns"][0]["assistant_message"].get("content") or "")


async def test_a_streamed_turn_whose_client_leaves_without_a_retry_is_cancelled_after_the_grace(
        qwen3_dir: Path) -> None:
    """A marker but no retry within the grace: the turn is cancelled then (nothing committed);
    without a marker it is cancelled at once (test_live_streaming.py)."""
    import orjson

    from session_server.context import Settings

    raw = orjson.dumps({"model": "m", "messages": USER, "max_tokens": 400, "stream": True})
    async with live_stack(qwen3_dir, "sglang", latency_ms=5, settings=Settings(replay_grace_s=0.2)) as st:
        sid = await st.session()
        await st.script(sid, LONG)
        await _leave_after_first_text(st, sid, raw, {"x-stainless-retry-count": "0"})
        turns = await _turns_when_idle(st, sid)
        aborted = await st.aborted_rids()
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert turns == 0 and aborted and view["turns_discarded"] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_output_text_logprobs(qwen3_dir: Path, stream: bool) -> None:
    """`include: ["message.output_text.logprobs"]` (+ `top_logprobs`): the output_text's
    tokens with their exact logprobs (the trajectory's), as the openai SDK types read them;
    streamed, in `output_text.done` and `response.completed`. Not asked: `[]`."""
    import httpx
    import numpy as np
    from openai import AsyncOpenAI

    script = {"turns": [{"reasoning_content": "The test imports a missing name.",
                         "content": "Fixed ✓: the import now names `parse_args`; 测试通过 🎉"}] * 3}
    async with live_stack(qwen3_dir, "sglang", latency_ms=1) as st:
        async with httpx.AsyncClient() as c:
            assert (await c.post(f"{st.engines[0]}/sim/script", json=script)).status_code == 200
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": "m", "input": "Fix the failing test.", "max_output_tokens": 200}
        done_lps: list[Any] = []
        if stream:
            async with oai.responses.stream(**kw, include=["message.output_text.logprobs"], top_logprobs=2) as s:
                async for ev in s:
                    if ev.type == "response.output_text.done":
                        done_lps = list(ev.logprobs)
                resp = await s.get_final_response()
        else:
            resp = await oai.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2)
        plain = await oai.responses.create(**kw, previous_response_id=resp.id)
        await oai.close()
        branch = (await st.trajectory(sid))["branches"][0]
    text = next(p for item in resp.output if item.type == "message" for p in item.content)
    assert text.type == "output_text" and text.logprobs
    ascii_only = lambda t: "".join(ch for ch in t if ch.isascii()).strip()  # noqa: E731 (a character split across tokens is U+FFFD per token)
    assert ascii_only("".join(lp.token for lp in text.logprobs)) == ascii_only(text.text)
    assert all(len(lp.top_logprobs) <= 2 and bytes(lp.bytes).decode() == lp.token for lp in text.logprobs)
    turn = branch["turns"][0]
    sampled = [float(np.float32(x)) for x in branch["logprobs"][turn["output_start"]:turn["output_end"]]]
    got = [lp.logprob for lp in text.logprobs]
    assert any(sampled[i:i + len(got)] == got for i in range(len(sampled) - len(got) + 1))
    if stream:
        assert [lp.logprob for lp in done_lps] == got
    assert resp.top_logprobs == 2
    plain_text = next(p for item in plain.output if item.type == "message" for p in item.content)
    assert plain_text.logprobs == []


async def test_a_retry_following_a_stream_that_fails_gets_its_error_event_and_no_second_turn(
        qwen3_dir: Path) -> None:
    """The followed turn fails validation at its end: the retry's stream ends with the
    error event, like the original's would have; no fresh attempt runs behind it."""
    import asyncio

    import orjson

    raw = orjson.dumps({"model": "m", "messages": USER, "max_tokens": 200, "stream": True})
    async with live_stack(qwen3_dir, "sglang", latency_ms=5) as st:
        sid = await st.session()
        await st.script(sid, LONG)  # the retry follows a turn still sampling
        await st.fault("nan_logprob")
        await _leave_after_first_text(st, sid, raw, {"x-stainless-retry-count": "0"})
        r = await st.http.post(f"/sessions/{sid}/v1/chat/completions", content=raw,
                               headers={"Content-Type": "application/json", "x-stainless-retry-count": "1"})
        turns = await _turns_when_idle(st, sid)
        await asyncio.sleep(0.1)  # a fresh attempt would have reached the engine by now
        log = await st.engine_log()
    assert r.status_code == 200
    assert "must be a number" in _failed("chat", _events(r.content.decode()))
    assert turns == 0 and len(log) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_disable_parallel_tool_use_is_a_hint_never_a_silent_drop(
        qwen3_dir: Path, stream: bool) -> None:
    """`tool_choice.disable_parallel_tool_use` cannot be enforced on sampled tokens: a model
    that calls two tools anyway gets both `tool_use` blocks, as the trajectory has them."""
    import httpx
    from anthropic import AsyncAnthropic

    script = {"turns": [{"content": "Checking both.", "tool_calls": [
        {"name": "read", "arguments": {"path": "a.txt"}}, {"name": "read", "arguments": {"path": "b.txt"}}]}]}
    tools = [{"name": "read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    async with live_stack(qwen3_dir, "sglang", latency_ms=1) as st:
        async with httpx.AsyncClient() as c:
            assert (await c.post(f"{st.engines[0]}/sim/script", json=script)).status_code == 200
        sid = await st.session()
        client = AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": "m", "max_tokens": 300, "tools": tools,
                              "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                              "messages": [{"role": "user", "content": "Read a.txt and b.txt."}]}
        if stream:
            async with client.messages.stream(**kw) as s:
                msg = await s.get_final_message()
        else:
            msg = await client.messages.create(**kw)
        await client.close()
        committed = (await st.trajectory(sid))["branches"][0]["turns"][-1]["assistant_message"]
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [{"path": "a.txt"}, {"path": "b.txt"}] and msg.stop_reason == "tool_use"
    assert [u.id for u in uses] == [tc["id"] for tc in committed["tool_calls"]]
