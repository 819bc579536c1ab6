"""Other real architectures and adapters on vLLM's CPU build: a tiny Qwen3-MoE, a random
LoRA adapter on the dense model, and what the CPU build refuses (routed experts)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from .conftest import serve_process
from .helpers import new_session, own_turns, trajectory, turn_exchanges, wait_until
from .recorder import PACE_MS, Recorder, recording_proxy
from .vllm_engine import ENGINE_FLAGS, build_tiny_lora, build_tiny_qwen3_moe, vllm_server

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]


def _exact(rec: Recorder, line: np.ndarray, lps: np.ndarray, turn: dict[str, Any]) -> None:
    ids: list[int] = []
    engine_lps: list[float] = []
    for ex in turn_exchanges(rec, line, turn):
        assert ex.request["token_ids"] == line[: turn["output_start"]].tolist() + ids
        seg_ids, seg_lps = ex.sampled()
        ids += seg_ids
        engine_lps += seg_lps
    assert line[turn["output_start"]:turn["output_end"]].tolist() == ids
    np.testing.assert_array_equal(lps[turn["output_start"]:turn["output_end"]],
                                  np.asarray(engine_lps, dtype=np.float32).astype(np.float64))


async def _episode(http: httpx.AsyncClient, sid: str, turns: int = 2, max_tokens: int = 24) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Begin."}]
    for k in range(turns):
        r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                            json={"model": "m", "messages": messages, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"More {k}."}]


async def test_a_moe_model_episode_is_token_exact(tmp_path: Path) -> None:
    model = build_tiny_qwen3_moe(tmp_path / "tiny-qwen3-moe")
    with vllm_server(model, tmp_path, extra=ENGINE_FLAGS) as engine:
        async with recording_proxy(engine.url) as rec, serve_process(rec.url, model, tmp_path / "serve.log") as url, \
                httpx.AsyncClient(base_url=url, timeout=600) as http:
            sid = await new_session(http)
            await _episode(http, sid)
            line, mask, lps, turns = own_turns(await trajectory(http, sid))
    assert len(turns) == 2
    for turn in turns:
        _exact(rec, line, lps, turn)
    assert int(mask.sum()) == sum(t["output_end"] - t["output_start"] for t in turns)


async def test_routed_experts_need_a_gpu_build(tmp_path: Path) -> None:
    """vLLM's CPU build refuses `--enable-return-routed-experts`: routed experts come from
    its V2 model runner, which needs Triton. Routing replay stays proven on the simulator
    and the captured wire facts (docs/engines.md) until this test starts failing."""
    model = build_tiny_qwen3_moe(tmp_path / "tiny-qwen3-moe")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        with pytest.raises(RuntimeError) as refused, \
                vllm_server(model, tmp_path, extra=("--enable-return-routed-experts",)):
            pass
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    assert "Model Runner V2 requires Triton" in str(refused.value)


@pytest.fixture(scope="module")
async def lora_stack(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
        tuple[str, Recorder, str]]:
    root = tmp_path_factory.mktemp("lora")
    adapter = build_tiny_lora(root / "tiny-lora", qwen3_dir)
    flags = (*ENGINE_FLAGS, "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"tiny-lora={adapter}")
    with vllm_server(qwen3_dir, root, extra=flags) as engine:
        async with recording_proxy(engine.url) as rec, serve_process(rec.url, qwen3_dir, root / "serve.log") as url:
            yield url, rec, engine.url


async def test_a_lora_session_samples_from_its_adapter_exactly(lora_stack: tuple[str, Recorder, str]) -> None:
    url, rec, _ = lora_stack
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        sid = await new_session(http, lora="tiny-lora")
        await _episode(http, sid)
        line, _, lps, turns = own_turns(await trajectory(http, sid))
    for turn in turns:
        exchanges = turn_exchanges(rec, line, turn)
        assert exchanges and all(e.request["model"] == "tiny-lora" for e in exchanges)
        _exact(rec, line, lps, turn)


async def test_a_lora_pause_resubmits_only_that_adapter_exactly(lora_stack: tuple[str, Recorder, str]) -> None:
    """`POST /control/pause {"mode": "abort", "lora"}` aborts that adapter's request at the
    engine (by vLLM's own id), holds it at the gate, and resubmits prompt + partial. Random
    weights can sample an end of turn before the pause: such a try is tried again."""
    url, rec, _ = lora_stack
    misses: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for _ in range(3):
            sid = await new_session(http, lora="tiny-lora")
            sent = len(rec.generations())

            async def dispatched(n: int = sent) -> bool:  # at the engine, not answered yet
                return any(not e.done for e in rec.generations()[n:])

            with rec.paced(PACE_MS):  # 4 s or more at the engine: the pause lands mid-turn on any machine
                chat = asyncio.create_task(http.post(f"/sessions/{sid}/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": f"Long answer ({sid})."}],
                    "max_tokens": 400}))
                await wait_until(dispatched, 60, "the LoRA turn to run")
                await asyncio.sleep(0.8)
                paused = await http.post("/control/pause", json={"mode": "abort", "lora": "tiny-lora"})
            assert paused.status_code == 200 and paused.json()["ok"], paused.text
            await asyncio.sleep(0.3)
            assert (await http.post("/control/resume", json={"lora": "tiny-lora"})).status_code == 200
            r = await chat
            assert r.status_code == 200, r.text
            line, _, lps, (turn,) = own_turns(await trajectory(http, sid))
            first = turn_exchanges(rec, line, turn)[0].reply()["choices"][0]
            n = turn["output_end"] - turn["output_start"]
            if first["finish_reason"] != "abort" or n != 400:  # an end of turn sampled: not the case
                misses.append(f"first request {first['finish_reason']}, {n} tokens in all")
                continue
            break
        else:
            raise AssertionError(f"every try sampled an end of turn: {misses}")
    assert turn["extra"]["control"]["resubmits"] >= 1
    _exact(rec, line, lps, turn)
