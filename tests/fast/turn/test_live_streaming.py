"""`stream: true` streams the turn as the engine samples it.

The first content delta reaches the agent before the engine has finished; the
concatenated deltas are the committed message and the trajectory keeps the engine's
exact ids and logprobs; a turn that fails validation ends its stream with an error
event and commits nothing; a replayed streamed request gets the same bytes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from ..stack import live_stack


async def _stream_chat(url: str, sid: str, **kw: Any) -> tuple[list[tuple[float, Any]], Any]:
    """(timestamped chunks, the SDK's final message) of one streamed chat turn."""
    oai = AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0)
    got: list[tuple[float, Any]] = []
    stream = await oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Fix the failing test."}], max_tokens=400,
        stream=True, **kw)
    async for chunk in stream:
        got.append((time.monotonic(), chunk))
    await oai.close()
    return got, None


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_first_delta_arrives_before_the_engine_finishes(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=3) as st:
        sid = await st.session()
        chunks, _ = await _stream_chat(st.url, sid, logprobs=True)
        log = await st.engine_log()
        traj = await st.trajectory(sid)
    texts = [(t, _text(c)) for t, c in chunks if c.choices]
    texts = [(t, x) for t, x in texts if x[0] or x[1]]
    assert len(texts) > 1, "no text deltas"
    engine_done = log[-1]["finished_s"]  # the simulator runs in this process: same clock
    assert texts[0][0] < engine_done, "the first text delta waited for the whole generation"
    assert sum(t < engine_done for t, _ in texts) > 1
    message = traj["branches"][0]["turns"][-1]["assistant_message"]
    assert "".join(x[0] for _, x in texts) == (message.get("reasoning_content") or "")
    assert "".join(x[1] for _, x in texts) == (message.get("content") or "")
    assert log[-1]["finish_reason"] == "stop"
    ids, lps = _sampled(traj)  # the engine's exact values (logprobs are stored as float32)
    assert ids == log[-1]["output_ids"]
    assert lps == [float(np.float32(x)) for x in log[-1]["logprobs"]]


def _text(chunk: Any) -> tuple[str, str]:
    """(reasoning, content) of one chunk's delta."""
    delta = chunk.choices[0].delta
    return str((delta.model_extra or {}).get("reasoning_content") or ""), str(delta.content or "")


def _sampled(traj: dict[str, Any]) -> tuple[list[int], list[float]]:
    branch = traj["branches"][0]
    t = branch["turns"][-1]
    return (branch["token_ids"][t["output_start"]:t["output_end"]],
            branch["logprobs"][t["output_start"]:t["output_end"]])


async def test_a_turn_failing_validation_ends_with_an_error_event_and_commits_nothing(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "sglang", latency_ms=2) as st:
        sid = await st.session()
        await st.fault("nan_logprob")
        async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions",
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 32, "stream": True}) as r:
            assert r.status_code == 200
            body = (await r.aread()).decode()
        traj = await st.trajectory(sid)
    assert '"error"' in body and body.rstrip().endswith("data: [DONE]")
    assert traj["branches"][0]["turns"] == []


async def test_replay_of_a_streamed_turn_returns_identical_bytes(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "vllm", latency_ms=1) as st:
        sid = await st.session()
        req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "stream": True}
        headers = {"Idempotency-Key": "k1"}
        first = await st.http.post(f"/sessions/{sid}/v1/chat/completions", json=req, headers=headers)
        again = await st.http.post(f"/sessions/{sid}/v1/chat/completions", json=req, headers=headers)
        traj = await st.trajectory(sid)
    assert first.status_code == again.status_code == 200
    assert first.content == again.content and b"[DONE]" in first.content
    assert len(traj["branches"][0]["turns"]) == 1


async def test_errors_before_the_stream_starts_are_http_errors(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "sglang") as st:
        r = await st.http.post("/sessions/nope/v1/chat/completions",
                               json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 404
        sid = await st.session()
        r = await st.http.post(f"/sessions/{sid}/v1/chat/completions", json={"model": "m", "stream": True})
        assert r.status_code == 400
    assert isinstance(r, httpx.Response)


# ~150 tokens: a turn that is still sampling when a test pauses it or its client leaves
LONG = {"content": " ".join(f"step {i}: the fix reads the fixture, renames the import and reruns the test." for i in range(9))}


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_pause_mid_stream_is_invisible(qwen3_dir: Path, protocol: str) -> None:
    """abort -> accumulate -> resubmit while the client reads: the stream just goes on,
    and its deltas are still exactly the committed turn, equal to an uninterrupted one."""
    msgs = [{"role": "user", "content": "Fix the failing test."}]
    async with live_stack(qwen3_dir, protocol, latency_ms=4) as st:
        ref_sid = await st.session()
        await st.script(ref_sid, LONG)
        ref = await st.chat(ref_sid, {"model": "m", "messages": msgs, "max_tokens": 200})
        sid = await st.session()
        await st.script(sid, LONG)  # still sampling when the pause lands
        texts: list[str] = []
        async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions",
                                  json={"model": "m", "messages": msgs, "max_tokens": 200, "stream": True}) as r:
            paused = False
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    d = chunk["choices"][0]["delta"]
                    texts.append((d.get("reasoning_content") or "") + "\x00" + (d.get("content") or ""))
                if len(texts) == 5 and not paused:
                    paused = True
                    assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
                    await asyncio.sleep(0.05)
                    assert (await st.http.post("/control/resume", json={})).status_code == 200
        view = (await st.http.get(f"/sessions/{sid}")).json()
        got = (await st.trajectory(sid))["branches"][0]
        want = (await st.trajectory(ref_sid))["branches"][0]
    assert paused and view["control"]["aborts"] >= 1 and view["control"]["resubmits"] >= 1
    assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]
    message = got["turns"][-1]["assistant_message"]
    assert ref.json()["choices"][0]["message"]["content"] == message["content"]
    assert "".join(t.split("\x00")[0] for t in texts) == (message.get("reasoning_content") or "")
    assert "".join(t.split("\x00")[1] for t in texts) == (message.get("content") or "")


async def test_anthropic_sdk_stream_arrives_before_the_engine_finishes(qwen3_dir: Path) -> None:
    from anthropic import AsyncAnthropic

    async with live_stack(qwen3_dir, "sglang", latency_ms=3) as st:
        sid = await st.session()
        client = AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=0)
        stamps: list[float] = []
        async with client.messages.stream(model="m", max_tokens=400,
                                          messages=[{"role": "user", "content": "Fix the failing test."}]) as s:
            async for ev in s:
                if ev.type == "content_block_delta":
                    stamps.append(time.monotonic())
            msg = await s.get_final_message()
        log = await st.engine_log()
        got = (await st.trajectory(sid))["branches"][0]["turns"][-1]["assistant_message"]
    assert stamps and stamps[0] < log[-1]["finished_s"]
    text = "".join(b.text for b in msg.content if b.type == "text")
    thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
    assert text == (got.get("content") or "") and thinking == (got.get("reasoning_content") or "")


async def test_client_leaving_mid_stream_cancels_the_turn(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "sglang", latency_ms=5) as st:
        sid = await st.session()
        await st.script(sid, LONG)  # still sampling when the client leaves
        writer = await st.raw_chat(sid, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 400, "stream": True})
        reader = writer.transport.get_protocol()._stream_reader  # type: ignore[attr-defined]
        head = await reader.readuntil(b"data: ")  # the response started: headers and a first frame
        assert b"200" in head.split(b"\r\n", 1)[0]
        writer.close()
        for _ in range(200):
            view = (await st.http.get(f"/sessions/{sid}")).json()
            if not view["busy"]:
                break
            await asyncio.sleep(0.01)
        aborted = await st.aborted_rids()
        traj = await st.trajectory(sid)
    assert traj["branches"][0]["turns"] == [] and not view["busy"]
    assert aborted, "the engine request was not aborted"


async def _stalled_stream(app: Any, path: str, body: dict[str, Any], unblock: asyncio.Event,
                          got: list[bytes]) -> None:
    """An ASGI client that takes the response's first body chunk, then stops reading (its
    `send` never returns: a socket nobody drains) without disconnecting, until `unblock`."""
    data = json.dumps(body).encode()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": data, "more_body": False}
        await unblock.wait()  # connected all along; it only stops reading
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            got.append(message["body"])
            if len(got) == 1:
                await unblock.wait()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
async def test_a_client_that_stops_reading_is_cut_at_the_stream_bound_and_the_turn_still_commits(
    qwen3_dir: Path, route: str,
) -> None:
    """Its waiting frames stay under `stream_buffer_bytes` (the rest are dropped, not held for
    as long as the connection lives); when it reads again its stream ends with a
    `stream_overflow` error event; the turn committed meanwhile."""
    from session_server.context import Settings
    from session_server.ops.harness import live_apps

    from ..stack import metric_value

    limit = 4096
    async with live_stack(qwen3_dir, settings=Settings(stream_buffer_bytes=limit)) as st:
        sid = await st.session()
        await st.script(sid, LONG)  # its frames are well over the bound in every dialect
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Fix the failing test."}],
                                "max_tokens": 300, "stream": True, "logprobs": True, "top_logprobs": 5}
        if route == "/v1/messages":
            body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
        unblock, got = asyncio.Event(), []
        client = asyncio.create_task(_stalled_stream(live_apps[st.url], f"/sessions/{sid}{route}", body, unblock, got))
        for _ in range(1000):  # the turn commits while the client is stalled
            if (await st.http.get(f"/sessions/{sid}")).json()["turns"] == 1:
                break
            await asyncio.sleep(0.01)
        traj = await st.trajectory(sid)
        overflows = metric_value((await st.http.get("/metrics")).text, "tito_stream_overflows_total")
        unblock.set()
        await asyncio.wait_for(client, 10)  # the cut stream ends by itself
    assert len(traj["branches"][0]["turns"]) == 1
    assert overflows == 1
    received = b"".join(got)
    assert len(received) <= limit + 2048, len(received)  # the first chunk, the bound, the cut frames
    assert received.count(b"read this stream too slowly") == 1, received[-600:]
    if route == "/v1/chat/completions":  # our type in chat's error chunk, then its end
        assert b'"type":"stream_overflow"' in received and received.endswith(b"data: [DONE]\n\n")
    else:  # Anthropic's error event, last
        assert received.rsplit(b"event: ", 1)[1].startswith(b"error\n")


async def test_one_frame_larger_than_the_stream_bound_reaches_a_client_that_reads(qwen3_dir: Path) -> None:
    """The bound is on a backlog, not on one frame: Responses' closing frames repeat the
    whole output and the echoed request (tools, instructions), tens of KB, and a client
    that keeps reading must still get them, not a `stream_overflow`."""
    from session_server.context import Settings

    from ..stack import metric_value

    async with live_stack(qwen3_dir, settings=Settings(stream_buffer_bytes=64 * 1024)) as st:
        sid = await st.session()
        body = {"model": "m", "input": "Fix the failing test.", "max_output_tokens": 64, "stream": True,
                "instructions": "Be brief. " * 4000}  # ~40 KB in each of the opening frames
        async with st.http.stream("POST", f"/sessions/{sid}/v1/responses", json=body) as r:
            assert r.status_code == 200
            received = b"".join([part async for part in r.aiter_bytes()])
        overflows = metric_value((await st.http.get("/metrics")).text, "tito_stream_overflows_total")
    assert b"too slowly" not in received and overflows == 0
    assert b"event: response.completed" in received
