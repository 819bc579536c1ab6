"""The streaming seam: a turn streams as dialect-neutral events (`api/stream_events.py`); the
chat-completions encoder turns them into chunks the `openai` SDK accumulates back into
exactly the committed message."""

from __future__ import annotations

import json
from typing import Any

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from session_server.api.dialects.openai_chat import ChatStreamEncoder
from session_server.turn.pipeline import TurnOutput
from session_server.turn.stream_events import (
    ContentDelta,
    ToolArgumentsDelta,
    ToolCallStarted,
    TurnCommitted,
    TurnFailed,
    TurnStarted,
    replay,
)

MESSAGE = {
    "role": "assistant",
    "content": "Two files.",
    "reasoning_content": "Look first.",
    "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "read", "arguments": '{"path": "b.py"}'}},
    ],
}


def output(message: dict[str, Any] = MESSAGE) -> TurnOutput:
    return TurnOutput(request_id="r1", message=message, finish_reason="tool_calls", prompt_tokens=10,
                      completion_tokens=3, cached_tokens=0, sampled_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3],
                      top_logprobs=None, turn_index=0, branch_id=0)


def chunks(frames: list[bytes]) -> list[dict[str, Any]]:
    assert frames[-1] == b"data: [DONE]\n\n"
    return [json.loads(f[6:]) for f in frames[:-1]]


def test_replay_ends_with_the_commit_and_concatenates_to_the_message() -> None:
    events = replay(output())
    assert isinstance(events[0], TurnStarted) and isinstance(events[-1], TurnCommitted)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == MESSAGE["content"]
    starts = [e for e in events if isinstance(e, ToolCallStarted)]
    assert [(e.index, e.id, e.name) for e in starts] == [(0, "call_a", "read"), (1, "call_b", "read")]
    args = {i: "".join(e.text for e in events if isinstance(e, ToolArgumentsDelta) and e.index == i) for i in (0, 1)}
    assert args == {0: '{"path": "a.py"}', 1: '{"path": "b.py"}'}


def test_openai_sdk_accumulates_the_chunks_into_the_committed_message() -> None:
    enc = ChatStreamEncoder(model="m", logprobs=False, top_k=0, tokenizer=None)
    frames = [f for ev in replay(output()) for f in enc.encode(ev)]
    state = ChatCompletionStreamState()
    for c in chunks(frames):
        if c["choices"]:
            state.handle_chunk(ChatCompletionChunk.model_validate(c))
    msg = state.get_final_completion().choices[0].message
    assert msg.content == MESSAGE["content"]
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls or []] == [
        (tc["id"], tc["function"]["name"], tc["function"]["arguments"]) for tc in MESSAGE["tool_calls"]]
    usage = chunks(frames)[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_a_failed_turn_ends_the_stream_with_an_error_chunk() -> None:
    enc = ChatStreamEncoder(model="m", logprobs=False, top_k=0, tokenizer=None)
    frames = enc.encode(TurnStarted("r1", 10)) + enc.encode(TurnFailed("upstream_invalid", "bad chunk", 502))
    body = chunks(frames)
    assert body[-1] == {"error": {"type": "upstream_invalid", "message": "bad chunk", "code": 502}}
