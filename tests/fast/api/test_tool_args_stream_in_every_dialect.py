"""Tool-call arguments stream while the engine samples them, in every dialect,
through the real SDKs' streaming helpers against the streaming simulated engine.

Each test scripts the simulated model (`/sim/script`) to call a tool with a long argument
and asserts: several argument deltas arrived before the engine finished (really
incremental), the accumulated arguments equal the committed message's, the streamed call
id is the stored one (and the next turn, answering that id, extends the same branch with
no id renamed), and the stored sampled ids and logprobs equal the engine's log."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from ..stack import Stack, live_stack

TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "Write a file.",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}, "text": {"type": "string"}}}}}]
ARGS = {"path": "src/é.py", "text": "print('hello')\n" * 40 + "✓ done"}
# the sim writes `json.dumps(args)` (`\u00e9`), the committed canonical text `é`: the id test
# keeps to ASCII so that its next turn differs from the sampled one by nothing else
ASCII_ARGS = {"path": "src/app.py", "text": "print('hello')\n" * 40 + "done"}
USER = "Write the file."


async def _script(st: Stack, *turns: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{st.engines[0]}/sim/script", json={"turns": list(turns)})
        assert r.status_code == 200, r.text


async def _stored(st: Stack, sid: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the last committed assistant message, its turn record), checked against the engine log."""
    traj = await st.trajectory(sid)
    log = await st.engine_log()
    branch = traj["branches"][-1]
    turn = branch["turns"][-1]
    a, b = turn["output_start"], turn["output_end"]
    assert branch["token_ids"][a:b] == log[-1]["output_ids"]
    assert branch["logprobs"][a:b] == [float(np.float32(x)) for x in log[-1]["logprobs"]]
    return turn["assistant_message"], turn


async def test_tool_args_chat_completions_stream_incrementally(qwen3_dir: Path) -> None:
    from openai import AsyncOpenAI

    async with live_stack(qwen3_dir, "vllm", latency_ms=2) as st:
        await _script(st, {"content": "Writing it.", "tool_calls": [{"name": "write_file", "arguments": ASCII_ARGS}]},
                      {"content": "Done."})
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": USER}]
        stamps: list[float] = []
        call_id, name, args = "", "", ""
        stream = await oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=2000,  # type: ignore[arg-type]
                                                   stream=True)
        async for chunk in stream:
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                call_id, name = tc.id or call_id, (tc.function.name if tc.function else None) or name
                if tc.function and tc.function.arguments:
                    stamps.append(time.monotonic())
                    args += tc.function.arguments
        log = await st.engine_log()
        message, turn = await _stored(st, sid)
        stored = message["tool_calls"][0]
        assert sum(t < log[-1]["finished_s"] for t in stamps) > 1, "arguments waited for the whole turn"
        assert (call_id, name, args) == (stored["id"], "write_file", stored["function"]["arguments"])
        assert json.loads(args) == ASCII_ARGS and "stream_tool_divergence" not in turn["extra"]
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["turns"] == 1
        # the next turn answers the streamed id: the trajectory extends, no id renamed
        msgs += [{"role": "assistant", "content": message["content"],
                  "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "ok"}]
        nxt = await oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=200)  # type: ignore[arg-type]
        await oai.close()
        traj = await st.trajectory(sid)
    assert nxt.choices[0].message.content == "Done."
    assert len(traj["branches"]) == 1 and len(traj["branches"][0]["turns"]) == 2
    assert "tool_call_id_renames" not in traj["branches"][0]["turns"][1]["extra"]  # the stored id is the streamed one


async def test_tool_args_anthropic_input_json_deltas(qwen3_dir: Path) -> None:
    from anthropic import AsyncAnthropic

    async with live_stack(qwen3_dir, "vllm", latency_ms=2) as st:
        await _script(st, {"tool_calls": [{"name": "write_file", "arguments": ARGS}]})
        sid = await st.session()
        client = AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=0)
        tools = [{"name": "write_file", "description": "Write a file.",
                  "input_schema": TOOLS[0]["function"]["parameters"]}]
        stamps: list[float] = []
        async with client.messages.stream(model="m", max_tokens=2000, tools=tools,  # type: ignore[arg-type]
                                          messages=[{"role": "user", "content": USER}]) as s:
            async for ev in s:
                if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                    stamps.append(time.monotonic())
            final = await s.get_final_message()
        log = await st.engine_log()
        message, _ = await _stored(st, sid)
    use = [b for b in final.content if b.type == "tool_use"]
    stored = message["tool_calls"][0]
    assert sum(t < log[-1]["finished_s"] for t in stamps) > 1
    assert len(use) == 1 and use[0].id == stored["id"] and use[0].name == "write_file"
    assert use[0].input == json.loads(stored["function"]["arguments"]) == ARGS
    assert final.stop_reason == "tool_use"


async def test_tool_args_responses_function_call_arguments_deltas(qwen3_dir: Path) -> None:
    from openai import AsyncOpenAI

    async with live_stack(qwen3_dir, "sglang", latency_ms=2) as st:
        await _script(st, {"tool_calls": [{"name": "write_file", "arguments": ARGS}]})
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", "name": "write_file", "description": "Write a file.",
                  "parameters": TOOLS[0]["function"]["parameters"]}]
        stamps: list[float] = []
        deltas = ""
        async with oai.responses.stream(model="m", input=USER, tools=tools, max_output_tokens=2000) as s:  # type: ignore[arg-type]
            async for ev in s:
                if ev.type == "response.function_call_arguments.delta":
                    stamps.append(time.monotonic())
                    deltas += ev.delta
            final = await s.get_final_response()
        await oai.close()
        log = await st.engine_log()
        message, _ = await _stored(st, sid)
    calls = [o for o in final.output if o.type == "function_call"]
    stored = message["tool_calls"][0]
    assert sum(t < log[-1]["finished_s"] for t in stamps) > 1
    assert len(calls) == 1 and calls[0].call_id == stored["id"]
    assert deltas == calls[0].arguments == stored["function"]["arguments"] and json.loads(deltas) == ARGS


async def test_tool_args_truncated_mid_call_commits_and_counts_divergence(qwen3_dir: Path) -> None:
    """max_tokens cuts the call mid-arguments: the streamed call cannot parse, the turn is
    still committed (the tokens are the truth), the stream sends the content as parsed
    (the raw markup) and the divergence is recorded and counted."""
    async with live_stack(qwen3_dir, "vllm", latency_ms=1) as st:
        await _script(st, {"content": "Writing it.", "tool_calls": [{"name": "write_file", "arguments": ARGS}]})
        sid = await st.session()
        body = {"model": "m", "messages": [{"role": "user", "content": USER}], "tools": TOOLS, "max_tokens": 60,
                "stream": True}
        content, args, started = "", "", []
        async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices") or []:
                    content += choice["delta"].get("content") or ""
                    for tc in choice["delta"].get("tool_calls") or []:
                        if tc.get("id"):
                            started.append(tc["id"])
                        args += tc["function"].get("arguments") or ""
        message, turn = await _stored(st, sid)
        metrics = (await st.http.get("/metrics")).text
    assert started and args, "the call did not start streaming before the cut"
    assert turn["finish_reason"] == "length" and "tool_calls" not in message
    assert turn["extra"]["stream_tool_divergence"] is True
    assert content == message["content"] and "<tool_call>" in content
    assert "tito_stream_tool_divergence_total 1.0" in metrics


@pytest.mark.parametrize("path,body,last", [
    ("v1/messages", {"max_tokens": 60, "tools": [{"name": "write_file", "input_schema": {"type": "object"}}]},
     "message_stop"),
    ("v1/responses", {"max_output_tokens": 60, "tools": [{"type": "function", "name": "write_file",
                                                           "parameters": {"type": "object"}}]},
     "response.incomplete"),
])
async def test_tool_args_truncated_mid_call_other_dialects_end_cleanly(qwen3_dir: Path, path: str,
                                                                           body: dict[str, Any], last: str) -> None:
    """The divergence path in the Anthropic and Responses encoders: a started tool block
    whose turn commits without the call still ends with the dialect's terminal event."""
    async with live_stack(qwen3_dir, "sglang", latency_ms=1) as st:
        await _script(st, {"content": "Writing it.", "tool_calls": [{"name": "write_file", "arguments": ARGS}]})
        sid = await st.session()
        key = "messages" if path == "v1/messages" else "input"
        r = await st.http.post(f"/sessions/{sid}/{path}", json={"model": "m", key: [{"role": "user", "content": USER}],
                                                                 "stream": True, **body})
        message, turn = await _stored(st, sid)
    events = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert r.status_code == 200 and "error" not in events and events[-1] == last, events
    assert turn["extra"]["stream_tool_divergence"] is True and "tool_calls" not in message
