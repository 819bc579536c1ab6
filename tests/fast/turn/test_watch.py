"""A turn the client does not stream, watched by a viewer (`GET /sessions/{sid}/live`):
on an engine whose stream frames are deltas (vLLM) the watcher gets the engine's tokens
as they are sampled, while the client's answer and the committed trajectory are an
unwatched turn's; a stream that fails (a lie in a chunk, a malformed frame) is sent again
unstreamed, so watching never fails a turn. SGLang's default cumulative frames are not
watched live (O(L^2)); an SGLang server declared incremental (`sglang_incremental_streams`)
is watched as vLLM is. A viewer opened mid-turn gets the turn so far; viewers are capped
and a delta is decoded once for all of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from session_server.context import Settings

from ..stack import Stack, live_stack, until_in_flight

U1 = [{"role": "user", "content": "The tests fail after the config change. Fix it."}]
BODY = {"messages": U1, "max_tokens": 60}


async def _watched_turn(st: Stack, sid: str) -> tuple[Any, list[dict[str, Any]]]:
    """One non-streamed turn while a watcher reads the live events: (the answer, the events)."""
    events: list[dict[str, Any]] = []
    async with st.http.stream("GET", f"/sessions/{sid}/live") as live:
        lines = live.aiter_lines()

        async def read() -> None:
            async for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["event"] == "end":
                        return

        reader = asyncio.create_task(read())
        while not events:  # subscribed (hello) before the turn starts
            await asyncio.sleep(0.01)
        answer = await st.chat(sid, BODY)
        await asyncio.wait_for(reader, 10)
    return answer, events


# engines whose stream frames are deltas: vLLM's always; SGLang's when started with
# --incremental-streaming-output and named in the setting that says so
DELTA_ENGINES = [
    pytest.param("vllm", {}, Settings(), id="vllm"),
    pytest.param("sglang", {"incremental_streaming_output": True}, Settings(sglang_incremental_streams=["*"]),
                 id="sglang-incremental"),
]


@pytest.mark.parametrize(("protocol", "sim", "settings"), DELTA_ENGINES)
async def test_a_watched_non_streamed_turn_shows_its_tokens_and_commits_as_an_unwatched_one(
        qwen3_dir: Path, protocol: str, sim: dict[str, Any], settings: Settings) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=5, script=[{"content": "step " * 40}] * 2,
                          settings=settings, **sim) as st:
        ref_sid = await st.session()
        ref = await st.chat(ref_sid, BODY)
        sid = await st.session()
        answer, events = await _watched_turn(st, sid)
        assert answer.status_code == 200 and answer.json()["choices"] == ref.json()["choices"]
        line, ref_line = (await st.trajectory(sid))["branches"][0], (await st.trajectory(ref_sid))["branches"][0]
        for key in ("token_ids", "loss_mask", "logprobs"):
            assert line[key] == ref_line[key], key
        kinds = [e["event"] for e in events]
        assert kinds[:2] == ["hello", "begin"] and kinds[-1] == "end" and events[-1]["committed"] is True
        assert events[1]["streams"] is False
        shown = [i for e in events if e["event"] == "tokens" for i in e["ids"]]
        (turn,) = line["turns"]
        assert kinds.count("tokens") > 1  # as sampled, not one lump at the end
        assert shown == line["token_ids"][turn["output_start"]:turn["output_end"]]


@pytest.mark.parametrize(("protocol", "sim", "settings"), DELTA_ENGINES)
@pytest.mark.parametrize("fault", ["stream_oov_id", "stream_negative_id", "stream_nan_logprob",
                                   "stream_positive_logprob"])
async def test_a_failed_watched_stream_falls_back_and_the_turn_answers_as_unwatched(
        qwen3_dir: Path, fault: str, protocol: str, sim: dict[str, Any], settings: Settings) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=2, script=[{"content": "step " * 40}] * 2,
                          settings=settings, **sim) as st:
        ref_sid = await st.session()
        ref = await st.chat(ref_sid, BODY)
        assert ref.status_code == 200, ref.text
        sid = await st.session()
        await st.fault(fault)  # the frames lie; vLLM's answer is its frames joined
        answer, events = await _watched_turn(st, sid)
        assert answer.status_code == 200, answer.text  # as an unwatched, non-streamed turn
        assert answer.json()["choices"] == ref.json()["choices"]
        line, ref_line = (await st.trajectory(sid))["branches"][0], (await st.trajectory(ref_sid))["branches"][0]
        for key in ("token_ids", "loss_mask", "logprobs"):
            assert line[key] == ref_line[key], key
        assert events[-1] == {"event": "end", "committed": True}
        kinds = [e["event"] for e in events]
        assert "unshown" in kinds or "restart" in kinds, kinds  # the fault hit the watched stream
        assert kinds[-2:] != ["tokens", "end"], kinds  # nothing shown after it: the resend is unstreamed


async def test_a_cumulative_sglang_wrongly_declared_incremental_still_answers_its_watched_turns(
        qwen3_dir: Path) -> None:
    """`sglang_incremental_streams=["*"]` over a server that streams cumulative frames:
    the declaration is checked against the server (`/get_server_info`), so a watched
    non-streamed turn answers as an unwatched one (never a 502) and the watcher sees no
    token twice."""
    async with live_stack(qwen3_dir, "sglang", latency_ms=2, script=[{"content": "step " * 40}] * 2,
                          settings=Settings(sglang_incremental_streams=["*"])) as st:
        ref_sid = await st.session()
        ref = await st.chat(ref_sid, BODY)
        sid = await st.session()
        answer, events = await _watched_turn(st, sid)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"] == ref.json()["choices"]
        line, ref_line = (await st.trajectory(sid))["branches"][0], (await st.trajectory(ref_sid))["branches"][0]
        assert line["token_ids"] == ref_line["token_ids"] and line["logprobs"] == ref_line["logprobs"]
        (turn,) = line["turns"]
        shown = [i for e in events if e["event"] == "tokens" for i in e["ids"]]
        assert len(shown) <= turn["output_end"] - turn["output_start"], shown  # no prefix sent again
        assert events[-1] == {"event": "end", "committed": True}


@pytest.mark.parametrize("sim", [{}, {"incremental_streaming_output": True}], ids=["cumulative", "not-declared"])
async def test_cumulative_streams_are_not_watched_live(qwen3_dir: Path, sim: dict[str, Any]) -> None:
    """SGLang's default frames repeat every earlier token: watching that way would move
    O(L^2), so a watched non-streamed turn goes to SGLang unstreamed and shows at `end`;
    so does one of a server whose deltas the settings do not declare (opt-in)."""
    async with live_stack(qwen3_dir, latency_ms=10, script=[{"content": "step " * 40}], **sim) as st:
        sid = await st.session()
        late: list[dict[str, Any]] = []
        chat = asyncio.create_task(_watched_turn(st, sid))
        await until_in_flight(st, sid)
        await _events(st, sid, late, until="hello")  # a viewer opened mid-turn
        answer, events = await chat
        assert answer.status_code == 200, answer.text
        kinds = [e["event"] for e in events]
        assert kinds == ["hello", "begin", "end"], kinds  # nothing streamed: shown at commit
        assert late[0]["busy"] and late[0]["turn"]["known"] is False and late[0]["turn"]["ids"] == [], late


async def _events(st: Stack, sid: str, out: list[dict[str, Any]], until: str = "end") -> None:
    """Read `sid`'s live events into `out` until one of kind `until`."""
    async with st.http.stream("GET", f"/sessions/{sid}/live") as live:
        assert live.status_code == 200
        async for line in live.aiter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if out[-1]["event"] == until:
                    return


async def test_a_viewer_opened_mid_turn_gets_the_turn_so_far_in_hello(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=10, script=[{"content": "step " * 40}]) as st:
        sid = await st.session()
        events: list[dict[str, Any]] = []
        reader: asyncio.Task[None] | None = None
        async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions",
                                  json={**BODY, "stream": True}) as turn:  # streamed: nobody watches at its start
            chunks = 0
            async for line in turn.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks == 6 and reader is None:  # a few tokens in: a viewer opens
                    reader = asyncio.create_task(_events(st, sid, events))
        assert reader is not None
        await asyncio.wait_for(reader, 10)
        hello = events[0]
        assert hello["event"] == "hello" and hello["busy"] is True, hello
        line = (await st.trajectory(sid))["branches"][0]
        (done,) = line["turns"]
        t = hello["turn"]
        assert t["branch"] == 0 and t["output_start"] == done["output_start"] and t["known"] is True
        assert 0 < len(t["ids"]) and len(t["texts"]) == len(t["ids"]) == len(t["logprobs"])
        later = [i for e in events if e["event"] == "tokens" for i in e["ids"]]
        assert t["ids"] + later == line["token_ids"][done["output_start"]:done["output_end"]]


async def test_live_viewers_are_capped_per_session_and_per_process(qwen3_dir: Path) -> None:
    from session_server.api import ui_data
    from session_server.ops.harness import live_apps

    async with live_stack(qwen3_dir) as st:
        sid, other = await st.session(), await st.session()
        streams = []
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(ui_data.MAX_VIEWERS_PER_SESSION):
                r = await stack.enter_async_context(st.http.stream("GET", f"/sessions/{sid}/live"))
                assert r.status_code == 200
                streams.append(r)
            over = await st.http.get(f"/sessions/{sid}/live")
            assert over.status_code == 429 and over.json()["error"]["type"] == "too_many_viewers", over.text
            assert over.headers["retry-after"] == "10"
            count = live_apps[st.url].state.live_viewers
            assert count[0] == ui_data.MAX_VIEWERS_PER_SESSION
            count[0] += ui_data.MAX_VIEWERS - ui_data.MAX_VIEWERS_PER_SESSION  # the process is full
            over = await st.http.get(f"/sessions/{other}/live")
            assert over.status_code == 429 and over.json()["error"]["type"] == "too_many_viewers", over.text
            count[0] -= ui_data.MAX_VIEWERS - ui_data.MAX_VIEWERS_PER_SESSION
        for _ in range(200):  # closed streams give their places back
            if count[0] == 0:
                break
            await asyncio.sleep(0.01)
        assert count[0] == 0
        async with st.http.stream("GET", f"/sessions/{sid}/live") as again:
            assert again.status_code == 200


async def test_n_viewers_of_a_turn_cost_one_decode_per_token(qwen3_dir: Path) -> None:
    from session_server.ops.harness import live_apps

    async with live_stack(qwen3_dir, "vllm", latency_ms=2, script=[{"content": "step " * 40}] * 2) as st:
        tokenizer = live_apps[st.url].state.ctx.tokenizer
        real = tokenizer.decode
        calls: list[int] = []

        def counted(ids: Any, *a: Any, **kw: Any) -> Any:
            calls.append(1)
            return real(ids, *a, **kw)

        tokenizer.decode = counted
        try:
            cost = []
            for n in (1, 4):
                sid = await st.session()
                events: list[list[dict[str, Any]]] = [[] for _ in range(n)]
                readers = [asyncio.create_task(_events(st, sid, out)) for out in events]
                while not all(events):  # every viewer subscribed (hello)
                    await asyncio.sleep(0.01)
                calls.clear()
                answer = await st.chat(sid, BODY)
                assert answer.status_code == 200
                await asyncio.wait_for(asyncio.gather(*readers), 10)
                cost.append(len(calls))
                assert all(len(out) == len(events[0]) for out in events)
                assert sum(len(e["ids"]) for e in events[0] if e["event"] == "tokens") > 10
        finally:
            del tokenizer.decode
        assert cost[0] == cost[1], cost  # four viewers decode what one does


async def test_the_live_route_of_no_such_session_is_a_404_at_once(qwen3_dir: Path) -> None:
    """What the fuzz suite leaves out (the stream is endless): a session that does not
    exist, or whose id is malformed, answers at once with the usual error body."""
    async with live_stack(qwen3_dir, "vllm") as st:
        for sid in ("0" * 16 + "." + "f" * 32, "not-a-session"):
            r = await asyncio.wait_for(st.http.get(f"/sessions/{sid}/live"), 10)
            assert r.status_code == 404 and "error" in r.json(), r.text
