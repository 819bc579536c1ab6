"""The Anthropic Messages dialect, driven by the real `anthropic` SDK
against the server and simulated engines (SGLang and vLLM wire protocols).

The engine's request log is the ground truth, as in e2e/test_openai_client_episodes.py: the trajectory's
prompts, sampled ids, logprobs and mask equal what the engine received and produced,
whichever dialect (or mix of dialects) the agent spoke."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from anthropic import AsyncAnthropic  # noqa: E402
from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from session_server.api.dialects.anthropic_messages import (  # noqa: E402
    ANTHROPIC_MESSAGES,
    MessagesStreamEncoder,
    message_body,
    stop_reason,
)
from session_server.context import Settings  # noqa: E402
from session_server.ops.demo import TOOLS, run_tool  # noqa: E402
from session_server.turn.pipeline import TurnOutput  # noqa: E402
from session_server.turn.stream_events import (  # noqa: E402
    ContentDelta,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallStarted,
    TurnCommitted,
    TurnFailed,
    TurnStarted,
)

from ..e2e.test_openai_client_episodes import assert_trajectory_matches_engine  # noqa: E402
from ..stack import live_stack  # noqa: E402

PROTOCOLS = ["sglang", "vllm"]
# the demo's tools (the ones the simulated agent's script calls) in Anthropic's form
A_TOOLS: list[dict[str, Any]] = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]
USER = {"role": "user", "content": "Fix the failing test."}


def client_for(url: str, sid: str, api_key: str = "x") -> AsyncAnthropic:
    # the SDK appends /v1/messages to its base URL: the session's root, without /v1
    return AsyncAnthropic(base_url=f"{url}/sessions/{sid}", api_key=api_key, max_retries=0)


def tool_results(content: list[Any]) -> dict[str, Any]:
    """The user turn answering every tool_use block of an assistant turn."""
    blocks = [{"type": "tool_result", "tool_use_id": b.id, "content": run_tool(b.name, json.dumps(b.input))}
              for b in content if b.type == "tool_use"]
    return {"role": "user", "content": blocks}


async def non_streaming_loop(client: AsyncAnthropic, max_turns: int = 6, **kw: Any) -> list[Any]:
    """tool_use -> tool_result -> ... -> answer; returns each turn's Message."""
    messages: list[Any] = [USER]
    out = []
    for _ in range(max_turns):
        msg = await client.messages.create(model="m", max_tokens=256, messages=messages, tools=A_TOOLS, **kw)
        out.append(msg)
        messages.append(msg.to_param())  # the assistant message exactly as returned
        if msg.stop_reason != "tool_use":
            break
        messages.append(tool_results(msg.content))
    return out


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_tool_loop_non_streaming_trajectory_equals_engine_io(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as st:
        sid = await st.session()
        client = client_for(st.url, sid)
        turns = await non_streaming_loop(client)
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert [m.stop_reason for m in turns[:-1]] == ["tool_use"] * (len(turns) - 1)
    assert turns[-1].stop_reason == "end_turn" and len(turns) >= 2
    for m in turns:
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
        kinds = [b.type for b in m.content]
        assert kinds[0] == "thinking" and m.content[0].signature  # Qwen3 reasons first
        assert kinds == sorted(kinds, key=["thinking", "text", "tool_use"].index)
    # every turn attached to the history the SDK sent back: one branch, no fork
    assert len(traj["branches"]) == 1
    branch = traj["branches"][0]
    assert len(branch["turns"]) == len(turns)
    assert_trajectory_matches_engine(branch, log, f"anthropic/{protocol}")
    for m, t in zip(turns, branch["turns"], strict=True):  # usage: Anthropic's split of the input
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == t["output_start"]
        assert m.usage.output_tokens == t["output_end"] - t["output_start"]
    stored = [m for m in branch["messages"] if m["role"] == "assistant"]
    assert [[tc["id"] for tc in m.get("tool_calls") or []] for m in stored] == \
        [[b.id for b in m.content if b.type == "tool_use"] for m in turns]


def _as_events(frames: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in frames:
        head, data = f.decode().rstrip("\n").split("\n")
        name, payload = head.removeprefix("event: "), json.loads(data.removeprefix("data: "))
        assert payload["type"] == name
        out.append((name, payload))
    return out


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_tool_loop_streaming_both_sdk_ways(qwen3_dir: Path, protocol: str) -> None:
    """`messages.stream()` (the SDK accumulates the events) and `create(stream=True)` (raw
    events) alternate in one tool loop; both give what a body gives, and the loop stays
    one branch equal to the engine's I/O."""
    async with live_stack(qwen3_dir, protocol) as st:
        sid = await st.session()
        client = client_for(st.url, sid)
        messages: list[Any] = [USER]
        finals = []
        for turn in range(6):
            kw: dict[str, Any] = {"model": "m", "max_tokens": 256, "messages": messages, "tools": A_TOOLS}
            if turn % 2 == 0:
                async with client.messages.stream(**kw) as stream:
                    text = "".join([t async for t in stream.text_stream])
                    msg = await stream.get_final_message()
                assert text == "".join(b.text for b in msg.content if b.type == "text")
            else:
                raw = await client.messages.create(**kw, stream=True)
                names, msg, bufs = [], None, {}
                async for ev in raw:  # the SDK's own accumulator over the raw events
                    names.append(ev.type)
                    msg = accumulate_event(event=ev, current_snapshot=msg, json_bufs=bufs)
                assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == [
                    "message_delta", "message_stop"]
            finals.append(msg)
            messages.append(msg.to_param())
            if msg.stop_reason != "tool_use":
                break
            messages.append(tool_results(msg.content))
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert finals[-1].stop_reason == "end_turn" and len(finals) >= 2
    assert all(m.content[0].type == "thinking" and m.content[0].signature for m in finals)
    assert len(traj["branches"]) == 1 and len(traj["branches"][0]["turns"]) == len(finals)
    assert_trajectory_matches_engine(traj["branches"][0], log, f"anthropic-stream/{protocol}")


async def test_stream_event_sequence_and_signature_match_the_body(qwen3_dir: Path) -> None:
    """The raw SSE frames: message_start, ping, each block's start/deltas/stop (thinking
    closes with its signature_delta, tool input as input_json_delta), message_delta with
    the stop reason and usage, message_stop; the same turn as a body (a retry of the stored
    turn is not available yet, so both are built from the committed output)."""
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        body = {"model": "m", "max_tokens": 256, "messages": [USER], "tools": A_TOOLS, "stream": True}
        r = await st.http.post(f"/sessions/{sid}/v1/messages", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f + b"\n\n" for f in r.content.split(b"\n\n") if f]
    events = _as_events(frames)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    blocks: dict[int, dict[str, Any]] = {}
    for name, ev in events:
        if name == "content_block_start":
            blocks[ev["index"]] = dict(ev["content_block"], partial="")
        elif name == "content_block_delta":
            b, d = blocks[ev["index"]], ev["delta"]
            if d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            elif d["type"] == "text_delta":
                b["text"] += d["text"]
            else:
                assert d["type"] == "input_json_delta"
                b["partial"] += d["partial_json"]
    kinds = [blocks[i]["type"] for i in sorted(blocks)]
    assert kinds[0] == "thinking" and "tool_use" in kinds
    assert names.count("content_block_start") == names.count("content_block_stop") == len(blocks)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] > 0
    thinking = blocks[0]
    from session_server.api.dialects.anthropic_messages import content_blocks
    assert thinking["signature"] == content_blocks({"reasoning_content": thinking["thinking"]})[0]["signature"]
    for b in blocks.values():
        if b["type"] == "tool_use":
            assert isinstance(json.loads(b["partial"]), dict)


async def test_thinking_enabled_and_disabled_render_the_qwen3_switch(qwen3_dir: Path) -> None:
    """`thinking` -> the template's `enable_thinking`: disabled renders Qwen3's empty think
    block into the prompt; enabled returns a thinking block whose signature the SDK sends
    back unchanged, and the next turn attaches (one branch)."""
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    async with live_stack(qwen3_dir) as st:
        off = await st.session()
        c_off = client_for(st.url, off)
        await c_off.messages.create(model="m", max_tokens=64, messages=[USER], thinking={"type": "disabled"})
        await c_off.close()
        on = await st.session()
        c_on = client_for(st.url, on)
        turns = await non_streaming_loop(c_on, thinking={"type": "enabled", "budget_tokens": 1024})
        await c_on.close()
        log = await st.engine_log()
        traj = await st.trajectory(on)
    prompt_off = tok.decode(log[0]["input_ids"])
    assert prompt_off.endswith("<think>\n\n</think>\n\n"), prompt_off[-60:]
    assert not tok.decode(log[1]["input_ids"]).endswith("</think>\n\n")
    assert all(m.content[0].type == "thinking" and m.content[0].thinking for m in turns)
    assert len(traj["branches"]) == 1 and len(traj["branches"][0]["turns"]) == len(turns) >= 2


async def test_count_tokens_is_the_next_turns_committed_prompt_length(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = client_for(st.url, sid)
        kw: dict[str, Any] = {"model": "m", "messages": [USER], "tools": A_TOOLS,
                              "system": [{"type": "text", "text": "You fix tests."}]}
        counts = [(await client.messages.count_tokens(**kw)).input_tokens]
        first = await client.messages.create(max_tokens=256, **kw)
        kw["messages"] = [USER, first.to_param(), tool_results(first.content)]
        counts.append((await client.messages.count_tokens(**kw)).input_tokens)
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["turns"] == 1 and view["diagnostics"] == []  # counting is not a turn
        await client.messages.create(max_tokens=256, **kw)
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    starts = [t["output_start"] for t in traj["branches"][0]["turns"]]
    assert counts == starts == [len(r["input_ids"]) for r in log]


async def test_max_tokens_and_stop_sequences(qwen3_dir: Path) -> None:
    """A length cut is `max_tokens`; `stop_sequences` reach the engine as its stop strings;
    a matched stop string is reported as `stop_sequence` (the engine's `matched`)."""
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = client_for(st.url, sid)
        msg = await client.messages.create(model="m", max_tokens=3, messages=[USER], stop_sequences=["STOP", "END"])
        await client.close()
        log = await st.engine_log()
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None and msg.usage.output_tokens == 3
    assert log[0]["sampling_params"]["stop"] == ["STOP", "END"]
    assert stop_reason(_out({"role": "assistant", "content": "a"}, "stop", matched="END"), ("STOP", "END")) == (
        "stop_sequence", "END")
    assert stop_reason(_out({"role": "assistant", "content": "a"}, "stop", matched=151645), ("END",)) == (
        "end_turn", None)  # a stop token (EOS) is the natural end


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_session_mixes_chat_completions_and_messages(qwen3_dir: Path, protocol: str) -> None:
    """Turn 1 through chat completions, turn 2 through messages (the assistant turn carried
    over as thinking + tool_use blocks), turn 3 through chat completions again: one
    trajectory, one branch, equal to the engine's I/O."""
    async with live_stack(qwen3_dir, protocol) as st:
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        ant = client_for(st.url, sid)
        chat: list[dict[str, Any]] = [USER]
        r1 = await oai.chat.completions.create(model="m", messages=chat, tools=TOOLS, max_tokens=256)  # type: ignore[arg-type]
        m1 = r1.choices[0].message.model_dump(exclude_none=True)
        assert m1.get("tool_calls"), "the scripted agent calls a tool first"
        blocks: list[dict[str, Any]] = []
        if m1.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": m1["reasoning_content"], "signature": "from-another-dialect"})
        if m1.get("content"):
            blocks.append({"type": "text", "text": m1["content"]})
        blocks += [{"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                    "input": json.loads(tc["function"]["arguments"])} for tc in m1["tool_calls"]]
        results = [{"type": "tool_result", "tool_use_id": tc["id"],
                    "content": [{"type": "text", "text": run_tool(tc["function"]["name"], tc["function"]["arguments"])}]}
                   for tc in m1["tool_calls"]]
        a_msgs: list[Any] = [USER, {"role": "assistant", "content": blocks}, {"role": "user", "content": results}]
        m2 = await ant.messages.create(model="m", max_tokens=256, messages=a_msgs, tools=A_TOOLS)
        # back to chat completions: the Anthropic turn as the OpenAI message it stands for
        chat += [m1, *({"role": "tool", "tool_call_id": r["tool_use_id"], "content": r["content"][0]["text"]}
                       for r in results)]
        m2_chat: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in m2.content if b.type == "text")}
        thinking = [b.thinking for b in m2.content if b.type == "thinking"]
        if thinking:
            m2_chat["reasoning_content"] = "".join(thinking)
        calls = [b for b in m2.content if b.type == "tool_use"]
        if calls:
            m2_chat["tool_calls"] = [{"id": b.id, "type": "function",
                                      "function": {"name": b.name, "arguments": json.dumps(b.input)}} for b in calls]
        chat.append(m2_chat)
        chat += [{"role": "tool", "tool_call_id": b.id, "content": run_tool(b.name, json.dumps(b.input))} for b in calls]
        if not calls:
            chat.append({"role": "user", "content": "Thanks. Anything else?"})
        await oai.chat.completions.create(model="m", messages=chat, tools=TOOLS, max_tokens=256)  # type: ignore[arg-type]
        await oai.close()
        await ant.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert len(traj["branches"]) == 1 and len(traj["branches"][0]["turns"]) == 3
    assert_trajectory_matches_engine(traj["branches"][0], log, f"mixed/{protocol}")


async def test_errors_come_back_in_anthropic_shape(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = client_for(st.url, sid)
        bad: list[dict[str, Any]] = [
            {"max_tokens": 0, "messages": [USER]},  # at least 1 here
            {"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
            {"max_tokens": 8, "messages": [USER, {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "xyz"}]}, USER]},
            {"max_tokens": 8, "messages": [{"role": "developer", "content": "x"}]},
            {"max_tokens": 8, "messages": [USER], "tool_choice": {"type": "sometimes"}},
            # a server tool is left out of the prompt; forcing it is a 400
            {"max_tokens": 8, "messages": [USER], "tools": [{"type": "web_search_20250305", "name": "web_search"}],
             "tool_choice": {"type": "tool", "name": "web_search"}},
        ]
        for body in bad:
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(model="m", **body)
            err = info.value.body
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
            assert err["error"]["message"]
        for raw in (b"{not json", b'{"messages": [{"role": "user", "content": "x"}]}'):  # the SDK needs max_tokens
            r = await st.http.post(f"/sessions/{sid}/v1/messages", content=raw)
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
        missing = client_for(st.url, "nope")
        with pytest.raises(anthropic.NotFoundError) as nf:
            await missing.messages.create(model="m", max_tokens=8, messages=[USER])
        assert nf.value.body == {"type": "error", "error": {
            "type": "not_found_error", "message": "unknown session 'nope'", "code": "session_not_found"}}
        with pytest.raises(anthropic.NotFoundError):
            await missing.messages.count_tokens(model="m", messages=[USER])
        await client.close()
        await missing.close()
        # other routes keep our envelope
        r = await st.http.post("/sessions/nope/v1/chat/completions", json={"messages": [USER]})
        assert r.json() == {"error": {"type": "session_not_found", "message": "unknown session 'nope'"}}
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert view["turns"] == 0  # nothing refused was committed


async def test_session_token_as_x_api_key_when_auth_is_on(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(admin_token="admin-secret")) as st:
        r = await st.http.post("/sessions", json={}, headers={"Authorization": "Bearer admin-secret"})
        created = r.json()
        sid = created["session_id"]
        ok = client_for(st.url, sid, api_key=created["api_key"])  # the SDK sends x-api-key
        msg = await ok.messages.create(model="m", max_tokens=64, messages=[USER])
        assert msg.type == "message"
        await ok.close()
        wrong = client_for(st.url, sid, api_key="nope")
        with pytest.raises(anthropic.AuthenticationError) as info:
            await wrong.messages.create(model="m", max_tokens=64, messages=[USER])
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
        await wrong.close()


# -- the encoder without a server: live-like events -------------------------------------


def _out(message: dict[str, Any], finish: str, matched: Any = None) -> TurnOutput:
    return TurnOutput(request_id="r1", message=message, finish_reason=finish, prompt_tokens=10,
                      completion_tokens=3, cached_tokens=4, sampled_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3],
                      top_logprobs=None, turn_index=0, branch_id=0, matched_stop=matched)


MESSAGE = {
    "role": "assistant", "content": "Two files.", "reasoning_content": "Look first.",
    "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "read", "arguments": '{"path": "b.py"}'}},
    ],
}


def _accumulate(frames: list[bytes]) -> Any:
    """The SDK's own accumulator over our frames (what `messages.stream()` does)."""
    from anthropic._models import construct_type
    from anthropic.types import RawMessageStreamEvent

    snapshot, bufs = None, {}
    for name, data in _as_events(frames):
        if name in ("ping", "error"):
            continue
        ev = construct_type(type_=RawMessageStreamEvent, value=data)
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def test_replayed_stream_accumulates_to_the_body() -> None:
    out = _out(MESSAGE, "tool_calls")
    frames = ANTHROPIC_MESSAGES.stream(out, ANTHROPIC_MESSAGES.parse(b'{"max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}'), None)
    streamed = _accumulate(frames)
    body = json.loads(message_body(out, model=None, stops=()))
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == body["content"]
    assert streamed.stop_reason == body["stop_reason"] == "tool_use"
    assert streamed.usage.input_tokens == 6 and streamed.usage.cache_read_input_tokens == 4
    # the body maps back to exactly the committed message (what attach matches)
    back = ANTHROPIC_MESSAGES.parse(json.dumps({"max_tokens": 9, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": body["content"]}]}).encode())
    assistant = back.messages[-1]
    assert assistant["reasoning_content"] == MESSAGE["reasoning_content"]
    assert assistant["content"] == MESSAGE["content"]
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in assistant["tool_calls"]] == [
        ("call_a", {"path": "a.py"}), ("call_b", {"path": "b.py"})]


def test_live_events_interleaved_open_new_blocks_and_errors_end_the_stream() -> None:
    """Live deltas in small pieces, reasoning split by content: each change of kind opens a
    block; the accumulated thinking joins back to the reasoning; a failure is an `error`
    event in Anthropic's shape."""
    enc = MessagesStreamEncoder(model="m", stops=())
    events = [TurnStarted("r2", 10), ReasoningDelta("Lo"), ReasoningDelta("ok "), ContentDelta("Hi"),
              ReasoningDelta("more."), ToolCallStarted(0, "call_x", "read"), ToolArgumentsDelta(0, '{"pa'),
              ToolArgumentsDelta(0, 'th": "a"}'), TurnCommitted(_out({}, "tool_calls"))]
    frames = [f for ev in events for f in enc.encode(ev)]
    snap = _accumulate(frames)
    assert [b.type for b in snap.content] == ["thinking", "text", "thinking", "tool_use"]
    assert snap.content[0].thinking == "Look " and snap.content[2].thinking == "more."
    assert snap.content[3].input == {"path": "a"} and snap.content[3].id == "call_x"
    assert all(b.signature for b in snap.content if b.type == "thinking")
    failed = MessagesStreamEncoder(model="m", stops=())
    frames = [*failed.encode(TurnStarted("r3", 5)), *failed.encode(ContentDelta("par")),
              *failed.encode(TurnFailed("upstream_invalid", "bad chunk", 502))]
    name, data = _as_events(frames)[-1]
    assert name == "error" and data == {"type": "error", "error": {"type": "api_error", "message": "bad chunk"}}


def test_replay_of_a_text_only_turn() -> None:
    frames = ANTHROPIC_MESSAGES.stream(_out({"role": "assistant", "content": "Done."}, "stop"),
                                       ANTHROPIC_MESSAGES.parse(b'{"max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}'), None)
    names = [n for n, _ in _as_events(frames)]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]


def test_count_tokens_body_needs_no_max_tokens() -> None:
    req = ANTHROPIC_MESSAGES.parse_count(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    assert req.max_tokens is None and req.messages == [{"role": "user", "content": "x"}]
    with pytest.raises(Exception, match="max_tokens"):
        ANTHROPIC_MESSAGES.parse(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')


def test_a_messages_request_maps_to_chat_messages_and_sampling() -> None:
    body = {
        "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "ok", "is_error": True},
                {"type": "text", "text": "next"}]},
        ],
        "tools": A_TOOLS[:1], "tool_choice": {"type": "tool", "name": "read_file"},
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["X"],
        "thinking": {"type": "enabled", "budget_tokens": 2048}, "metadata": {"user_id": "u"},
    }
    req = ANTHROPIC_MESSAGES.parse(json.dumps(body).encode())
    assert req.messages == [
        {"role": "system", "content": "AB"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        {"role": "user", "content": "next"},
    ]
    assert req.tools == [{"type": "function", "function": {
        "name": "read_file", "parameters": A_TOOLS[0]["input_schema"], "description": A_TOOLS[0]["description"]}}]
    assert req.tool_choice is not None and req.tool_choice.function.name == "read_file"  # type: ignore[union-attr]
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.stop) == (50, 0.5, 0.9, 5, ["X"])
    assert req.chat_template_kwargs == {"enable_thinking": True}
    for choice, want in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert ANTHROPIC_MESSAGES.parse(json.dumps({**body, "tool_choice": {"type": choice}}).encode()).tool_choice == want


async def test_openapi_declares_the_routes(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        async with httpx.AsyncClient(base_url=st.url) as c:
            doc = (await c.get("/openapi.json")).json()
    assert "/sessions/{sid}/v1/messages" in doc["paths"] and "/sessions/{sid}/v1/messages/count_tokens" in doc["paths"]
    assert "MessagesRequest" in doc["components"]["schemas"]


async def test_server_tools_are_left_out_with_a_warning(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Like the Responses dialect's hosted tools: a harness that always sends a server
    tool (web search) still runs with its client tools; the model never sees it."""
    from session_server.api.dialects.anthropic_messages_request import _tools

    tools = [{"type": "web_search_20250305", "name": "web_search"},
             {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}]
    with caplog.at_level("WARNING"):
        out = _tools(tools)
    assert out == [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                                     "parameters": {"type": "object"}}}]
    assert "web_search_20250305:web_search" in caplog.text
    assert _tools([{"type": "web_search_20250305", "name": "web_search"}]) is None


async def test_head_on_the_session_base_url(qwen3_dir: Path) -> None:
    """Claude Code probes its base URL with HEAD before its first request: 200 for a
    live session, 404 for an unknown one (it used to be a 405)."""
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        ok = await st.http.head(f"/sessions/{sid}")
        missing = await st.http.head("/sessions/nope")
    assert (ok.status_code, ok.content) == (200, b"")
    assert missing.status_code == 404


async def test_claude_code_shaped_title_and_main_requests_together_are_both_served(qwen3_dir: Path) -> None:
    """Claude Code sends its title request (non-streamed, structured output, its own
    system prompt) together with its first main turn (streamed, tools) on one session.
    The one that finds the session busy waits for the other instead of a 409 (the SDK
    here never retries: a 409 fails the test); each commits once, the title on a branch
    of its own, and the main loop's next turn extends the main branch."""
    title_format = {"type": "json_schema", "schema": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}
    async with live_stack(qwen3_dir, "sglang", request_latency_ms=150) as st:
        sid = await st.session()
        client = client_for(st.url, sid)
        main_kw: dict[str, Any] = {"model": "m", "max_tokens": 256, "messages": [USER], "tools": A_TOOLS,
                                   "system": [{"type": "text", "text": "You are an agent."}]}

        async def main_turn() -> Any:
            async with client.messages.stream(**main_kw) as stream:
                return await stream.get_final_message()

        title_req = client.messages.create(
            model="m", max_tokens=64, system=[{"type": "text", "text": "Generate a title for this session."}],
            messages=[{"role": "user", "content": "Fix the failing test."}],
            extra_body={"output_config": {"format": title_format}})
        first, title = await asyncio.gather(main_turn(), title_req)
        assert first.stop_reason == "tool_use", first
        assert "title" in json.loads(title.content[-1].text)
        messages = [USER, first.to_param(), tool_results(first.content)]
        second = await client.messages.create(**{**main_kw, "messages": messages})
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert second.stop_reason in ("tool_use", "end_turn")
    assert len([r for r in log if r["status"] == 200]) == 3, "one engine request per turn, no retry"
    assert sorted(len(b["turns"]) for b in traj["branches"]) == [1, 2]
    from ..e2e.test_harnesses import assert_every_branch_matches_engine

    assert_every_branch_matches_engine(traj, log, "claude-code-shaped")
