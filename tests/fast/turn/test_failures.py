"""Every failure path answers a clear status, commits nothing, and releases the claim.

"Released" is checked the only way that matters to an agent: the next chat on
the same session is not a 409.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from session_server.context import Settings
from session_server.ops.harness import free_port

from ..stack import CHAT, Stack, live_stack


async def snapshot(st: Stack, sid: str) -> tuple[int, int, int]:
    view = (await st.http.get(f"/sessions/{sid}")).json()
    return view["turns"], view["tokens"], len(view["branches"])


async def assert_released(st: Stack, sid: str) -> None:
    r = await st.chat(sid)
    assert r.status_code == 200, f"claim not released: {r.status_code} {r.text}"


async def test_bad_json_is_400(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        for body in (b"{not json", b"[1, 2]", b'{"messages": []}', b'{"messages": [{"role": "wizard"}]}',
                     b'{"messages": [{"role": "user", "content": "x"}], "n": 2}'):
            r = await st.http.post(f"/sessions/{sid}/v1/chat/completions", content=body,
                                   headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request"
        assert await snapshot(st, sid) == (0, 0, 1)
        await assert_released(st, sid)


async def test_unreconcilable_history_is_400(tokenizer_dirs: dict[str, Path]) -> None:
    """Llama 3.1 renders one tool call per assistant turn: an injected two-call turn cannot be bridged."""
    async with live_stack(tokenizer_dirs["llama3.1"]) as st:
        sid = await st.session()
        first = [{"role": "user", "content": "Go."}]
        r = await st.chat(sid, {"messages": first, "max_tokens": 64})
        assert r.status_code == 200, r.text
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
            for i in range(2)
        ]
        bad = [*first, r.json()["choices"][0]["message"], {"role": "user", "content": "and then?"},
               {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_0", "content": "a"}]
        before = await snapshot(st, sid)
        r2 = await st.chat(sid, {"messages": bad, "max_tokens": 64})
        assert r2.status_code == 400, r2.text
        assert r2.json()["error"]["type"] == "history_mismatch"
        assert await snapshot(st, sid) == before
        await assert_released(st, sid)


@pytest.mark.parametrize(("fault", "status", "etype"), [
    pytest.param("http_500", 502, "upstream_error", id="engine-5xx"),
    pytest.param("http_400", 502, "upstream_error", id="engine-4xx"),
    pytest.param("disconnect", 502, "upstream_unreachable", id="engine-disconnect"),
])
async def test_engine_errors_are_502(qwen3_dir: Path, fault: str, status: int, etype: str) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        await st.fault(fault)
        r = await st.chat(sid)
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == etype
        assert await snapshot(st, sid) == (0, 0, 1)
        await assert_released(st, sid)


async def test_transport_error_to_dead_engine_is_502_and_not_busy(qwen3_dir: Path) -> None:
    dead = f"sglang=http://127.0.0.1:{free_port()}"
    import httpx

    from session_server.app import AppConfig
    from session_server.ops.harness import running_server

    config = AppConfig(tokenizer=str(qwen3_dir), engines=[dead], settings=Settings())
    async with running_server(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        sid = (await http.post("/sessions", json={})).json()["session_id"]
        for _ in range(2):  # the second is 503/502 again, never 409: the claim was released
            r = await http.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT)
            assert r.status_code in (502, 503), r.text
            assert r.json()["error"]["type"] in ("upstream_unreachable", "no_healthy_engine")


async def test_deadline_is_504(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        await st.fault("stall")
        r = await st.chat(sid, {**CHAT, "timeout_s": 0.5})
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "upstream_timeout"
        assert await snapshot(st, sid) == (0, 0, 1)
        await assert_released(st, sid)


BAD_OUTPUTS = ["nan_logprob", "oov_id", "length_mismatch", "bool_id", "positive_logprob",
               "prompt_tokens_mismatch", "cached_above_prompt", "bad_finish"]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("fault", BAD_OUTPUTS)
async def test_bad_engine_output_is_502_and_commits_nothing(qwen3_dir: Path, fault: str, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as st:
        sid = await st.session()
        assert (await st.chat(sid)).status_code == 200
        before = await snapshot(st, sid)
        traj_before = await st.trajectory(sid)
        await st.fault(fault)
        follow = {"messages": [*CHAT["messages"], (await st.trajectory(sid))["branches"][0]["messages"][-1],
                               {"role": "user", "content": "Again."}], "max_tokens": 64}
        r = await st.chat(sid, follow)
        assert r.status_code == 502, f"{fault}: {r.status_code} {r.text}"
        assert r.json()["error"]["type"] == "upstream_invalid", fault
        assert await snapshot(st, sid) == before, fault
        assert await st.trajectory(sid) == traj_before, fault
        r = await st.chat(sid, follow)
        assert r.status_code == 200, f"{fault}: claim not released ({r.text})"


async def test_cancellation_releases_the_claim(qwen3_dir: Path) -> None:
    """A cancelled turn (e.g. shutdown) releases its claim in `finally` and commits nothing."""
    import orjson

    from session_server.api.dialects import OPENAI_CHAT

    async with live_stack(qwen3_dir, latency_ms=20) as st:
        sid = await st.session()
        runner = _runner_of(st)
        task = asyncio.create_task(runner.run(sid, orjson.dumps(CHAT), parse=OPENAI_CHAT.parse))
        await _until_busy(st, sid)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await snapshot(st, sid) == (0, 0, 1)
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["busy"] is False
        await assert_released(st, sid)


async def test_real_client_disconnect_releases_the_claim(qwen3_dir: Path) -> None:
    """The agent's socket closes mid-turn: the claim is released, and the trajectory
    stays consistent (the turn is discarded; see foundation/test_session_lifecycle.py for the abort)."""
    async with live_stack(qwen3_dir, latency_ms=15) as st:
        sid = await st.session()
        writer = await st.raw_chat(sid, CHAT)
        await _until_busy(st, sid)
        writer.close()  # a real disconnect, mid-generation
        await writer.wait_closed()
        for _ in range(400):
            view = (await st.http.get(f"/sessions/{sid}")).json()
            if not view["busy"]:
                break
            await asyncio.sleep(0.025)
        assert view["busy"] is False
        assert view["turns"] in (0, 1)  # committed or discarded, never half
        traj = await st.trajectory(sid)
        b = traj["branches"][-1]
        assert sum(b["loss_mask"]) == sum(t["output_end"] - t["output_start"] for t in b["turns"])
        r = await st.chat(sid, {"messages": [{"role": "user", "content": "New start."}], "max_tokens": 32})
        assert r.status_code == 200, r.text


def _runner_of(st: Stack) -> Any:
    from session_server.ops.harness import live_apps

    return live_apps[st.url].state.runner


async def _until_busy(st: Stack, sid: str) -> None:
    for _ in range(400):
        if (await st.http.get(f"/sessions/{sid}")).json()["busy"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the chat never became in flight")
