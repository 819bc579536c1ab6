"""GLM-4.5/4.6 XML tool calls stream their arguments while the engine samples
them, through the real `openai` SDK against the streaming simulated engine with the GLM
tokenizer: several argument deltas arrive before the engine finished, the accumulated
arguments equal the committed message's, and the streamed call id is the stored one."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..stack import live_stack
from .test_tool_args_stream_in_every_dialect import ASCII_ARGS, TOOLS, USER, _script, _stored


async def test_glm_tool_args_chat_completions_stream_incrementally(tokenizer_dirs: dict[str, Path]) -> None:
    from openai import AsyncOpenAI

    args = {**ASCII_ARGS, "lines": 40}  # a raw string streams live, the number waits for its end
    async with live_stack(tokenizer_dirs["glm4moe"], "vllm", latency_ms=2) as st:
        await _script(st, {"content": "Writing it.", "tool_calls": [{"name": "write_file", "arguments": args}]})
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": USER}]
        stamps: list[float] = []
        call_id, name, arguments, content = "", "", "", ""
        stream = await oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=2000,  # type: ignore[arg-type]
                                                   stream=True)
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            content += (delta.content or "") if delta else ""
            for tc in (delta.tool_calls or []) if delta else []:
                call_id, name = tc.id or call_id, (tc.function.name if tc.function else None) or name
                if tc.function and tc.function.arguments:
                    stamps.append(time.monotonic())
                    arguments += tc.function.arguments
        await oai.close()
        log = await st.engine_log()
        message, turn = await _stored(st, sid)
    stored = message["tool_calls"][0]
    assert sum(t < log[-1]["finished_s"] for t in stamps) > 1, "arguments waited for the whole turn"
    assert (call_id, name, arguments) == (stored["id"], "write_file", stored["function"]["arguments"])
    assert json.loads(arguments) == args and "stream_tool_divergence" not in turn["extra"]
    assert content == message["content"] == "Writing it."  # GLM content (stripped) comes at the end


async def test_glm_tool_args_anthropic_text_after_streamed_tool_use(tokenizer_dirs: dict[str, Path]) -> None:
    """The Messages stream of a GLM call after content: the `tool_use` block streams its
    `input_json_delta`s live, the content (held to the end) follows it as a text block,
    and the SDK's final message has both, matching the stored turn."""
    from anthropic import AsyncAnthropic

    async with live_stack(tokenizer_dirs["glm4moe"], "sglang", latency_ms=2) as st:
        await _script(st, {"content": "Writing it.", "tool_calls": [{"name": "write_file", "arguments": ASCII_ARGS}]})
        sid = await st.session()
        client = AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=0)
        tools = [{"name": "write_file", "input_schema": TOOLS[0]["function"]["parameters"]}]
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
    text = [b.text for b in final.content if b.type == "text"]
    assert sum(t < log[-1]["finished_s"] for t in stamps) > 1
    assert len(use) == 1 and use[0].id == message["tool_calls"][0]["id"] and use[0].input == ASCII_ARGS
    assert text == [message["content"]] == ["Writing it."] and final.stop_reason == "tool_use"
