"""Hardening of the engine adapters and their HTTP plumbing, live stack."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from session_server.control import ControlPlane, generate_resilient
from session_server.engines import GenerateRequest, SGLangAdapter, VLLMAdapter
from session_server.sim import running_sim

from ..stack import CHAT, live_stack, sim_aborted_rids


async def _until(pred: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await pred():
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_turn_timeout_aborts_engine_request(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=50) as st:
        sid = await st.session()
        r = await st.chat(sid, {**CHAT, "max_tokens": 400, "timeout_s": 0.4})
        assert r.status_code == 504, r.text

        async def seen() -> bool:
            return bool(await st.aborted_rids())

        await _until(seen)
        aborted = await st.aborted_rids()
        assert len(aborted) == 1, "the engine never saw an abort for the timed-out turn"
        assert re.fullmatch(r"[0-9a-f]{32}", aborted[0])  # that segment's own rid, never "all"


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_cancelled_generate_resilient_aborts_engine_request(qwen3_dir: Path, protocol: str) -> None:
    async with running_sim(protocol, str(qwen3_dir), latency_ms=30) as url:
        adapter: Any = SGLangAdapter(url, retries=0) if protocol == "sglang" else VLLMAdapter(url, retries=0)
        control = ControlPlane(lambda: [adapter])
        rid = f"{7:032x}"
        try:
            task = asyncio.create_task(generate_resilient(
                adapter, GenerateRequest(rid, [1, 2, 3, 4], 400), control))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await control.drain_aborts()
            aborted = await sim_aborted_rids(url)
        finally:
            await adapter.aclose()
    assert rid in aborted
    sent = control.metrics.registry.get_sample_value("tito_engine_aborts_sent_total", {"outcome": "sent"})
    assert sent == 1


def test_vllm_repetition_finish_is_accepted_without_match() -> None:
    """Adapter parser + validator: `repetition` is its own finish, valid without a match."""
    import json

    from session_server.engines.vllm import parse_vllm_generate
    from trajectory.validate import Expectations, validate_generation

    rid = f"{9:032x}"
    body = json.dumps({"request_id": rid, "choices": [{
        "index": 0, "token_ids": [5, 6, 5, 6], "finish_reason": "repetition", "stop_reason": None,
        "logprobs": {"content": [{"token_id": t, "logprob": -0.1} for t in (5, 6, 5, 6)]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    result = parse_vllm_generate(body, request_id=rid)
    assert result.finish_reason == "repetition" and result.matched_stop is None
    valid = validate_generation(result, Expectations(
        request_id=rid, prompt_len=3, vocab_size=100, max_tokens=64,
        stop_token_ids=frozenset({99}), last_weight_version=None))
    assert valid.finish_reason == "repetition"


async def test_vllm_repetition_turn_is_stop_for_client_and_recorded(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "vllm") as st:
        sid = await st.session()
        await st.fault("repetition")
        r = await st.chat(sid, {**CHAT, "max_tokens": 400})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        traj = await st.trajectory(sid)
        text = json.dumps(traj)
        assert "\"repetition\"" in text  # recorded as what it was
        turn = traj["branches"][0]["turns"][0]
        assert turn["finish_reason"] == "repetition" and turn["repair_tokens"]  # closed like any non-EOT end


async def test_post_engines_admission_check_verifies_declared_protocol(qwen3_dir: Path) -> None:
    from aiohttp import web

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hello)  # answers every path with 200 JSON
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake = "http://{}:{}".format(*runner.addresses[0][:2])
    try:
        async with live_stack(qwen3_dir, "sglang") as st:
            before = (await st.http.get("/engines")).json()["engines"]
            for proto in ("sglang", "vllm"):
                r = await st.http.post("/engines", json={"url": f"{proto}={fake}"})
                assert r.status_code == 400, r.text
                assert "refused" in r.json()["error"]["message"]
            r = await st.http.post("/engines", json={"url": f"sglangg={st.engines[0]}"})
            assert r.status_code == 400, r.text
            assert "unknown engine protocol" in r.json()["error"]["message"]
            assert (await st.http.get("/engines")).json()["engines"] == before
            r = await st.http.post("/engines", json={"url": f"sglang={st.engines[0]}"})
            assert r.status_code == 200 and r.json()["existing"] is True, r.text  # idempotent
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("url", ["0", "localhost:30000", "ftp://h:1", "http://", "vllm=h:1", "http://h:99999", "http://h:x"])
async def test_post_engines_malformed_url_is_400_not_502(qwen3_dir: Path, url: str) -> None:
    async with live_stack(qwen3_dir, "sglang") as st:
        r = await st.http.post("/engines", json={"url": url})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request", r.text


async def test_post_engines_unreachable_is_added_unhealthy_or_a_502_as_the_readme_says(qwen3_dir: Path) -> None:
    """Nothing listens there. With its protocol named it is added unhealthy (the health
    checks take it in once it is up); without, its protocol cannot be probed: 502
    `upstream_unreachable` (the engine failed to answer), not a 400 (bad input)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens on it
    async with live_stack(qwen3_dir, "sglang") as st:
        probed = await st.http.post("/engines", json={"url": f"http://127.0.0.1:{port}"})
        named = await st.http.post("/engines", json={"url": f"sglang=http://127.0.0.1:{port}"})
    assert probed.status_code == 502 and probed.json()["error"]["type"] == "upstream_unreachable", probed.text
    assert named.status_code == 201 and named.json()["healthy"] is False, named.text
    readme = " ".join((Path(__file__).resolve().parents[3] / "README.md").read_text().split())
    assert "one that does not answer is added unhealthy when its protocol is named" in readme
    assert "else a 502 `upstream_unreachable`" in readme
