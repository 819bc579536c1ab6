"""A Llama 3.2 model (served by the `renderers`-backed codec, detected from its own
template) replies `{"name": "get_weather", "parameters": "Paris"}`: a call whose
arguments are not a JSON object. The Anthropic Messages dialect answers a well-formed
message (the reply as text, the parse status in the turn record), never a 500 after
the commit; the SDK's retry of the same request (same body, `x-stainless-retry-count`
> 0) is answered from the replay log and commits no second turn.

Real HTTP against our server and the simulated engine; the engine's request log and the
trajectory are the ground truth for "one turn".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.fast.trajectory.renderer_families import BY_NAME, build
from trajectory.codec import RenderersCodec, load_codec

from ..stack import live_stack

anthropic = pytest.importorskip("anthropic")

REPLY = '{"name": "get_weather", "parameters": "Paris"}'
BODY: dict[str, Any] = {
    "model": "m", "max_tokens": 64,
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": [{"name": "get_weather", "description": "Weather of a city.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
}


@pytest.fixture(scope="module")
def llama32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build(BY_NAME["llama-3.2"], tmp_path_factory.mktemp("llama32") / "llama-3_2")
    codec = load_codec(str(path))  # what the server loads: detected from the template
    assert isinstance(codec, RenderersCodec) and codec.family == "llama-3"
    return path


async def _script(engine: str) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{engine}/sim/script", json={"turns": [{"content": REPLY}]})
        assert r.status_code == 200, r.text


def _turns(traj: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for b in traj["branches"] for t in b["turns"]]


async def test_the_sdk_gets_a_message_and_the_turn_is_committed_once(llama32_dir: Path) -> None:
    async with live_stack(llama32_dir) as st:
        await _script(st.engines[0])
        sid = await st.session()
        # the SDK retries a 5xx on its own (twice here), each retry with x-stainless-retry-count
        client = anthropic.AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=2)
        msg = await client.messages.create(**BODY)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == REPLY  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn"
    (turn,) = _turns(traj)
    assert len(traj["branches"]) == 1 and len(log) == 1
    assert turn["extra"]["parse_status"] == "invalid_json"
    assert turn["assistant_message"].get("tool_calls") in (None, [])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_retried_request_is_answered_from_the_replay_log(llama32_dir: Path, stream: bool) -> None:
    body = {**BODY, "stream": stream}
    async with live_stack(llama32_dir) as st:
        await _script(st.engines[0])
        sid = await st.session()
        url = f"/sessions/{sid}/v1/messages"
        first = await st.http.post(url, json=body, headers={"x-stainless-retry-count": "0"})
        again = await st.http.post(url, json=body, headers={"x-stainless-retry-count": "1"})
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert first.status_code == again.status_code == 200, first.text
    assert again.content == first.content
    if not stream:
        content = orjson.loads(first.content)["content"]
        assert content == [{"type": "text", "text": REPLY}]
    else:
        assert b"event: error" not in first.content and b"message_stop" in first.content
        assert b'"tool_use"' not in first.content  # no block whose input is not an object
    assert len(_turns(traj)) == 1 and len(traj["branches"]) == 1 and len(log) == 1


@pytest.mark.parametrize("arguments", ['"Paris"', "[1, 2]", "not json"])
def test_a_call_no_dialect_can_carry_is_refused_before_commit(arguments: str) -> None:
    """The backstop for any codec: the message every dialect renders is checked at
    validate, before commit, so no response can fail after it (502, nothing committed)."""
    from types import SimpleNamespace

    import numpy as np

    from session_server.errors import UpstreamInvalid
    from session_server.turn.commit import _shaped
    from trajectory.codec import ParsedAssistant, ParsedToolCall

    parsed = ParsedAssistant(content="", reasoning_content=None,
                             tool_calls=[ParsedToolCall("call_1", "get_weather", arguments)])
    req, valid = SimpleNamespace(tool_choice=None), SimpleNamespace(ids=np.array([1, 2]))
    with pytest.raises(UpstreamInvalid, match="not a JSON object"):
        _shaped(parsed, req, None, valid)  # type: ignore[arg-type]
    ok = ParsedAssistant(content="", reasoning_content=None,
                         tool_calls=[ParsedToolCall("call_1", "get_weather", '{"city": "Paris"}')])
    assert _shaped(ok, req, None, valid)[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # type: ignore[arg-type]
