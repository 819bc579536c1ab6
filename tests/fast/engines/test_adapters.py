"""HTTP-level adapter tests against the simulator (and a closed port)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest

from session_server.engines import (
    GenerateRequest,
    SamplingParams,
    SGLangAdapter,
    VLLMAdapter,
    make_adapter,
    parse_engine_spec,
    raise_nofile_limit,
    retry_transient,
)
from session_server.engines.sglang import build_sglang_payload
from session_server.errors import (
    UpstreamHTTPError,
    UpstreamTimeout,
    UpstreamTransportError,
)
from session_server.sim import running_sim
from session_server.sim.toy import TOY_EOT, toy_prompt

PROMPT = toy_prompt(("system", "be brief"), ("user", "fix the tests"))


def _rid(n: int) -> str:
    return f"{n:032x}"


def _adapter(protocol: str, url: str, **kw: Any) -> SGLangAdapter | VLLMAdapter:
    return SGLangAdapter(url, **kw) if protocol == "sglang" else VLLMAdapter(url, **kw)


async def _post(url: str, body: Any) -> Any:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return await r.json()


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_happy_path(protocol: str) -> None:
    async with running_sim(protocol, "toy", seed=3, dp=2) as url:
        a = _adapter(protocol, url)
        try:
            req = GenerateRequest(_rid(1), PROMPT, 400, SamplingParams(temperature=1.0, seed=7),
                                  top_logprobs=2, dp_rank=1, cache_salt="salt")
            r = await a.generate(req)
            assert r.finish_reason == "stop" and r.output_ids[-1] == TOY_EOT
            assert len(r.output_ids) == len(r.logprobs) == r.completion_tokens
            assert r.prompt_tokens == len(PROMPT) and r.cached_tokens == 0
            assert r.request_id == _rid(1)
            assert list(r.output_ids_echo or []) == list(r.output_ids)
            assert all(-5 < lp <= 0 for lp in r.logprobs)
            assert r.top_logprobs is not None and len(r.top_logprobs[0]) == 2
            if protocol == "sglang":
                assert r.matched_stop == TOY_EOT and r.weight_version == "default"
            log = await _get(url + "/sim/requests")
            assert log[-1]["dp_rank"] == 1 and log[-1]["input_ids"] == PROMPT
            assert await a.health()
        finally:
            await a.aclose()


async def test_vllm_completions_fallback_and_stop_token() -> None:
    async with running_sim("vllm", "toy") as url:
        a = VLLMAdapter(url, endpoint="completions")
        try:
            first = await a.generate(GenerateRequest(_rid(2), PROMPT, 400))
            stop_at = first.output_ids[3]
            r = await a.generate(GenerateRequest(
                _rid(3), PROMPT, 400, SamplingParams(stop_token_ids=(stop_at,))))
            assert r.finish_reason == "stop" and r.matched_stop == stop_at
            assert r.output_ids[-1] == stop_at and list(r.output_ids) == list(first.output_ids[:4])
            assert r.request_id == _rid(3)
            log = await _get(url + "/sim/requests")
            assert log[-1]["path"] == "/v1/completions"
        finally:
            await a.aclose()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_http_5xx_and_4xx(protocol: str) -> None:
    async with running_sim(protocol, "toy") as url:
        a = _adapter(protocol, url)
        try:
            await _post(url + "/sim/faults", {"kind": "http_500", "count": 1})
            with pytest.raises(UpstreamHTTPError) as info:
                await a.generate(GenerateRequest(_rid(4), PROMPT, 50))
            assert info.value.http_status == 500 and "simulated fault" in info.value.message
            await _post(url + "/sim/faults", {"kind": "http_400", "count": 1})
            with pytest.raises(UpstreamHTTPError) as info:
                await a.generate(GenerateRequest(_rid(5), PROMPT, 50))
            assert info.value.http_status == 400
            r = await a.generate(GenerateRequest(_rid(6), PROMPT, 50))
            assert r.completion_tokens > 0
        finally:
            await a.aclose()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_closed_port_is_transient_transport_error(protocol: str) -> None:
    a = _adapter(protocol, f"http://127.0.0.1:{_free_port()}", retries=1)
    if isinstance(a, VLLMAdapter):
        a.model, a.endpoint = "m", "generate"
    try:
        with pytest.raises(UpstreamTransportError) as info:
            await a.generate(GenerateRequest(_rid(7), PROMPT, 5))
        assert info.value.transient
        assert not await a.health()
    finally:
        await a.aclose()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_timeout_and_disconnect(protocol: str) -> None:
    async with running_sim(protocol, "toy") as url:
        a = _adapter(protocol, url, retries=3)
        try:
            await _post(url + "/sim/faults", {"kind": "stall", "count": 1})
            with pytest.raises(UpstreamTimeout):
                await a.generate(GenerateRequest(_rid(8), PROMPT, 5, timeout_s=0.3))
            await _post(url + "/sim/faults", {"kind": "disconnect", "count": 1})
            with pytest.raises(UpstreamTransportError) as info:
                await a.generate(GenerateRequest(_rid(9), PROMPT, 5))
            assert not info.value.transient  # the request was sent: never retried
            log = await _get(url + "/sim/requests")
            assert [e["fault"] for e in log] == ["stall", "disconnect"]
        finally:
            await a.aclose()


async def test_retries_connect_errors_until_the_engine_is_up() -> None:
    port = _free_port()
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise UpstreamTransportError("refused", transient=True)
        return "ok"

    assert await retry_transient(flaky, retries=2, base_delay_s=0.001) == "ok" and calls == 3
    calls = 0
    with pytest.raises(UpstreamTransportError):
        await retry_transient(flaky, retries=1, base_delay_s=0.001)
    assert calls == 2

    async def not_transient() -> str:
        nonlocal calls
        calls += 1
        raise UpstreamTransportError("reset", transient=False)

    calls = 0
    with pytest.raises(UpstreamTransportError):
        await retry_transient(not_transient, retries=5, base_delay_s=0.001)
    assert calls == 1

    # end to end: the engine starts listening while the adapter is backing off
    from aiohttp import web

    from session_server.sim import SimEngine
    from session_server.sim.toy import toy_model

    a = SGLangAdapter(f"http://127.0.0.1:{port}", retries=8)
    runner = web.AppRunner(SimEngine("sglang", toy_model()).make_app())

    async def start_later() -> None:
        await asyncio.sleep(0.15)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    starter = asyncio.create_task(start_later())
    try:
        r = await a.generate(GenerateRequest(_rid(10), PROMPT, 20))
        assert r.completion_tokens == 20
    finally:
        await starter
        await a.aclose()
        await runner.cleanup()


async def test_concurrency_cap_bounds_engine_requests() -> None:
    async with running_sim("sglang", "toy", latency_ms=2) as url:
        a = SGLangAdapter(url, max_concurrency=4)
        peak = 0
        try:
            async def watch() -> None:
                nonlocal peak
                while True:
                    load = await _get(url + "/get_load")
                    peak = max(peak, sum(x["num_reqs"] for x in load))
                    await asyncio.sleep(0.005)

            w = asyncio.create_task(watch())
            results = await asyncio.gather(*(
                a.generate(GenerateRequest(_rid(100 + i), PROMPT, 10)) for i in range(16)))
            w.cancel()
            assert all(r.completion_tokens == 10 for r in results)
            assert 1 <= peak <= 4
        finally:
            await a.aclose()


async def test_make_adapter_detects_and_forces() -> None:
    assert parse_engine_spec("vllm=http://h:1/") == ("vllm", "http://h:1")
    assert parse_engine_spec("http://h:1") == (None, "http://h:1")
    with pytest.raises(ValueError):
        parse_engine_spec("tgi=http://h:1")
    for protocol, cls in (("sglang", SGLangAdapter), ("vllm", VLLMAdapter)):
        async with running_sim(protocol, "toy") as url:
            a = await make_adapter(url)
            assert isinstance(a, cls)
            await a.aclose()
            forced = await make_adapter(f"{protocol}={url}")
            assert isinstance(forced, cls) and forced.base_url == url
            await forced.aclose()
    async with running_sim("vllm", "toy") as url:
        v = VLLMAdapter(url)
        assert await v.discover() == "generate" and v.model == "toy-chatml"
        await v.aclose()
    async with running_sim("sglang", "toy") as url:
        v = VLLMAdapter(url)
        with pytest.raises(UpstreamHTTPError):  # the simulated SGLang has no /v1/models
            await v.discover()
        await v.aclose()
    with pytest.raises(UpstreamTransportError):
        await make_adapter(f"http://127.0.0.1:{_free_port()}")


async def test_sglang_control_plane() -> None:
    async with running_sim("sglang", "toy", dp=3) as url:
        a = SGLangAdapter(url)
        try:
            assert (await a.model_info())["simulated"] is True
            assert await a.dp_size() == 3
            assert len(await a.get_load()) == 3
            await a.flush_cache()
            await a.pause("in_place")
            await a.resume()
            await a.abort(None)
        finally:
            await a.aclose()


def test_payload_fields() -> None:
    req = GenerateRequest(_rid(1), [1, 2], 9, SamplingParams(temperature=0.5, stop=("x",)),
                          top_logprobs=3, dp_rank=0, lora="l", cache_salt="s",
                          return_routed_experts=True)
    p = build_sglang_payload(req)
    assert p["sampling_params"] == {"max_new_tokens": 9, "skip_special_tokens": False,
                                    "spaces_between_special_tokens": False, "no_stop_trim": True,
                                    "temperature": 0.5, "stop": ["x"]}
    assert (p["rid"], p["top_logprobs_num"], p["data_parallel_rank"], p["lora_path"],
            p["extra_key"], p["return_routed_experts"], p["return_logprob"]) == (
        _rid(1), 3, 0, "l", "s", True, True)


def test_raise_nofile_limit() -> None:
    soft, hard = raise_nofile_limit()
    assert soft >= 1024 or soft == hard


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("processes", [0, 1])
async def test_routed_experts_nobody_asked_for_are_dropped_where_the_reply_is_parsed(
        protocol: str, processes: int) -> None:
    """An engine that sends routed experts with every reply (vLLM started with them on;
    the simulator's padding): a request that did not ask gets none, parsed in the worker
    process (a large reply) or on the threads, less its size; one that asked gets them
    as sent. Once a kind of request is known to answer large, the worker makes the
    request itself, and the result is the same."""
    from session_server.engines.reply_decoder import ReplyDecoder
    from session_server.offload import CpuOffload
    from session_server.routed import Unrequested, wire_size

    threads = CpuOffload(workers=1)
    decoder = ReplyDecoder(threads, processes=processes)
    await decoder.start()
    try:
        async with running_sim(protocol, "toy", padding="floats") as url:
            a = _adapter(protocol, url, offload=decoder.run, remote=decoder if processes else None)
            try:
                plain = [await a.generate(GenerateRequest(_rid(k), PROMPT, 4, sampling=SamplingParams(seed=1)))
                         for k in (1, 2)]
                asked = [await a.generate(GenerateRequest(_rid(k), PROMPT, 4, return_routed_experts=True,
                                                          sampling=SamplingParams(seed=1))) for k in (3, 4)]
            finally:
                await a.aclose()
    finally:
        await decoder.aclose()
        threads.shutdown()
    assert decoder.fetched == (2 if processes else 0), "the second of each kind was fetched by the worker"
    for got in asked:
        assert isinstance(got.routed_experts, bytes) and got.routed_experts.startswith(b"[[0.0,")
    # only its size is left (the turn's `routed_experts_bytes`, as before)
    for got in plain:
        assert got.routed_experts == Unrequested(len(asked[0].routed_experts)) and len(got.output_ids) == 4
    same = ("output_ids", "logprobs", "finish_reason", "prompt_tokens", "completion_tokens")
    assert [getattr(plain[0], f) for f in same] == [getattr(plain[1], f) for f in same]
    assert [getattr(asked[0], f) for f in same] == [getattr(asked[1], f) for f in same]
    assert asked[0].routed_experts == asked[1].routed_experts
    assert wire_size(plain[1].routed_experts) == wire_size(asked[1].routed_experts)
