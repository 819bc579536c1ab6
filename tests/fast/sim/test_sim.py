"""Simulator tests: determinism, autoregressive consistency, DP + cache, faults, pause, streaming."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np
import pytest

from session_server.engines import GenerateRequest, SGLangAdapter, VLLMAdapter, parse_sglang_stream
from session_server.errors import UpstreamHTTPError, UpstreamTransportError
from session_server.sim import FAULT_KINDS, PrefixCache, ScriptedPolicy, running_sim
from session_server.sim.toy import TOY_EOT, toy_decode, toy_encode, toy_model, toy_prompt

# the simulated model calls the tools its prompt offers (sim/offered.py): one, as a template prints it
TOOLS_TEXT = '<tools>\n{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", ' \
    '"properties": {"path": {"type": "string"}}, "required": ["path"]}}}\n</tools>'
PROMPT = toy_prompt(("system", TOOLS_TEXT), ("user", "list the files"))


def _rid(n: int) -> str:
    return f"{n:032x}"


def _adapter(protocol: str, url: str) -> SGLangAdapter | VLLMAdapter:
    return SGLangAdapter(url, retries=0) if protocol == "sglang" else VLLMAdapter(url, retries=0)


async def _post(url: str, body: Any = None, **kw: Any) -> Any:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, **kw) as r:
        return r.status, await r.read()


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


def _run(policy: ScriptedPolicy, ctx: list[int], n: int) -> tuple[list[int], list[float]]:
    c = policy.start(ctx)
    ids = [c.token(i) for i in range(n)]
    return ids, [c.logprob(i, t) for i, t in enumerate(ids)]


def test_policy_is_deterministic_and_seeded() -> None:
    a = _run(ScriptedPolicy(toy_model(), seed=1), PROMPT, 300)
    b = _run(ScriptedPolicy(toy_model(), seed=1), PROMPT, 300)
    c = _run(ScriptedPolicy(toy_model(), seed=2), PROMPT, 300)
    assert a == b and a != c
    assert all(-5 < lp <= 0 for lp in a[1])


def test_script_reasoning_tool_calls_then_answer() -> None:
    p = ScriptedPolicy(toy_model(), seed=0)
    ctx = list(PROMPT)
    kinds = []
    for _turn in range(5):
        c = p.start(ctx)
        ids = c.planned
        assert ids[-1] == TOY_EOT
        text = toy_decode(ids)
        assert text.startswith("<think>\n")
        kinds.append("tool" if "<tool_call>" in text else "final")
        ctx = ctx + ids + toy_encode("\n") + toy_prompt(("tool", "result"))
    assert kinds[0] == "tool" and "final" in kinds
    first_final = kinds.index("final")
    assert set(kinds[:first_final]) == {"tool"} and 1 <= first_final <= 3


def test_autoregressive_consistency() -> None:
    p = ScriptedPolicy(toy_model(), seed=5)
    full_ids, full_lps = _run(p, PROMPT, 120)
    for cut in (1, 17, 60):
        rest_ids, rest_lps = _run(p, PROMPT + full_ids[:cut], 120 - cut)
        assert rest_ids == full_ids[cut:] and rest_lps == full_lps[cut:]


def test_noncanonical_same_text_other_ids() -> None:
    canon = ScriptedPolicy(toy_model(), seed=4).start(PROMPT).planned
    odd = ScriptedPolicy(toy_model(), seed=4, noncanonical=True).start(PROMPT).planned
    assert toy_decode(canon) == toy_decode(odd) and len(odd) > len(canon)
    assert toy_encode(toy_decode(odd)[:-len("<|im_end|>")]) + [TOY_EOT] == canon


def test_prefix_cache_lru() -> None:
    c = PrefixCache(capacity_tokens=10, page_size=1)
    assert c.match([1, 2, 3]) == 0
    c.insert([1, 2, 3, 4])
    assert c.match([1, 2, 3, 4]) == 3 and c.match([1, 2, 9]) == 2
    c.insert([7, 8, 9, 10, 11, 12, 13])  # 11 pages > 10: the LRU leaf (4) goes first
    assert c.match([1, 2, 3, 4, 5]) == 3
    paged = PrefixCache(capacity_tokens=64, page_size=4)
    paged.insert(list(range(10)))
    assert paged.match(list(range(10))) == 8


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_dp_pinning_and_per_rank_cache(protocol: str) -> None:
    async with running_sim(protocol, "toy", dp=2, page_size=1) as url:
        a = _adapter(protocol, url)
        try:
            r0 = await a.generate(GenerateRequest(_rid(1), PROMPT, 500, dp_rank=0))
            again0 = await a.generate(GenerateRequest(_rid(2), PROMPT, 500, dp_rank=0))
            other = await a.generate(GenerateRequest(_rid(3), PROMPT, 500, dp_rank=1))
            assert r0.cached_tokens == 0 and again0.cached_tokens == len(PROMPT) - 1
            assert other.cached_tokens == 0
            follow = PROMPT + list(r0.output_ids) + toy_prompt(("tool", "ok"))
            nxt = await a.generate(GenerateRequest(_rid(4), follow, 50, dp_rank=0))
            assert nxt.cached_tokens == len(PROMPT) + len(r0.output_ids)
            assert list(again0.output_ids) == list(r0.output_ids) == list(other.output_ids)
            # unpinned: round robin
            for i in range(4):
                await a.generate(GenerateRequest(_rid(10 + i), PROMPT, 3))
            log = await _get_json(url + "/sim/requests")
            assert [e["dp_rank"] for e in log[:4]] == [0, 0, 1, 0]
            assert sorted(e["dp_rank"] for e in log[4:]) == [0, 0, 1, 1]
        finally:
            await a.aclose()


EXPECT = {
    "http_500": UpstreamHTTPError,
    "http_400": UpstreamHTTPError,
    "disconnect": UpstreamTransportError,
}


def _routed_ids(r: Any) -> np.ndarray:
    """The answer's routed experts (4 layers x top-2 of 16 by default), any wire shape."""
    from session_server.routed import decode_payload

    assert r.routed_experts is not None
    return decode_payload(r.routed_experts)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("kind", [k for k in FAULT_KINDS if k != "stall" and not k.startswith("hold_")])
async def test_fault_kinds(protocol: str, kind: str) -> None:
    async with running_sim(protocol, "toy", return_routed_experts=True) as url:
        a = _adapter(protocol, url)
        try:
            clean = await a.generate(GenerateRequest(_rid(1), PROMPT, 400))
            status, _ = await _post(url + "/sim/faults", {"kind": kind, "count": 1})
            assert status == 200
            req = GenerateRequest(_rid(2), PROMPT, 400, return_routed_experts=kind.startswith("routed_"))
            if kind in EXPECT:
                with pytest.raises(EXPECT[kind]):
                    await a.generate(req)
                return
            r = await a.generate(req)
            n = len(clean.output_ids)
            checks = {
                "abort_midway": lambda: r.finish_reason == "abort" and 0 < len(r.output_ids) < n,
                "nan_logprob": lambda: r.logprobs[0] is None,  # NaN is null on the wire
                "oov_id": lambda: r.output_ids[0] >= 274,
                "bool_id": lambda: r.output_ids[0] is True,
                "positive_logprob": lambda: r.logprobs[0] == 0.5,
                "length_mismatch": lambda: len(r.logprobs) == len(r.output_ids) - (
                    0 if protocol == "sglang" else 1) and len(r.logprobs) == n - 1,
                "prompt_tokens_mismatch": lambda: r.prompt_tokens == len(PROMPT) + 1,
                "cached_above_prompt": lambda: r.cached_tokens > r.prompt_tokens,
                "repetition": lambda: (r.finish_reason == "repetition" and 0 < len(r.output_ids) < n)
                if protocol == "vllm" else list(r.output_ids) == list(clean.output_ids),
                "bad_finish": lambda: r.finish_reason == "length"
                and len(r.output_ids) < 400,
                "pass": lambda: list(r.output_ids) == list(clean.output_ids),
                # routing replay: the rows of the whole line, bent
                "routed_extra_row": lambda: _routed_ids(r).size == (len(PROMPT) + n) * 8,
                "routed_missing_row": lambda: _routed_ids(r).size == (len(PROMPT) + n - 2) * 8,
                "routed_layers": lambda: _routed_ids(r).size == (len(PROMPT) + n - 1) * 6,
                "routed_out_of_range": lambda: int(_routed_ids(r).max()) == 16,
            }
            if kind.startswith("stream_"):  # only a streamed answer shows the lie (turn/test_live_streaming_gaps.py)
                assert list(r.output_ids) == list(clean.output_ids) and list(r.logprobs) == list(clean.logprobs)
            else:
                assert checks[kind](), (kind, r)
            again = await a.generate(GenerateRequest(_rid(3), PROMPT, 400))
            assert list(again.output_ids) == list(clean.output_ids)  # count 1: then clean
        finally:
            await a.aclose()


async def test_unknown_fault_kind_is_rejected() -> None:
    async with running_sim("sglang", "toy") as url:
        status, body = await _post(url + "/sim/faults", {"kind": "gremlins", "count": 1})
        assert status == 400 and b"unknown fault kind" in body


async def _pause(protocol: str, url: str, mode: str) -> None:
    if protocol == "sglang":
        sg_mode = {"keep": "in_place"}.get(mode, mode)
        status, _ = await _post(url + "/pause_generation", {"mode": sg_mode})
    else:
        status, _ = await _post(url + "/pause", params={"mode": mode})
    assert status == 200


async def _resume(protocol: str, url: str) -> None:
    status, _ = await _post(url + ("/continue_generation" if protocol == "sglang" else "/resume"))
    assert status == 200


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("mode", ["abort", "keep", "wait"])
async def test_pause_modes(protocol: str, mode: str) -> None:
    async with running_sim(protocol, "toy", latency_ms=2) as url:
        a = _adapter(protocol, url)
        try:
            ref = await a.generate(GenerateRequest(_rid(1), PROMPT, 60))
            task = asyncio.create_task(a.generate(GenerateRequest(_rid(2), PROMPT, 60)))
            await asyncio.sleep(0.04)
            await _pause(protocol, url, mode)
            held = asyncio.create_task(a.generate(GenerateRequest(_rid(3), PROMPT, 5)))
            await asyncio.sleep(0.05)
            assert not held.done()  # new requests wait while paused
            if mode == "abort":
                r = await task
                assert r.finish_reason == "abort" and 0 < len(r.output_ids) < 60
                assert list(r.output_ids) == list(ref.output_ids[: len(r.output_ids)])
                # resubmit prompt + partial after resume: same tokens as uninterrupted
                await _resume(protocol, url)
                rest = await a.generate(GenerateRequest(
                    _rid(4), PROMPT + list(r.output_ids), 60 - len(r.output_ids)))
                assert list(r.output_ids) + list(rest.output_ids) == list(ref.output_ids)
            elif mode == "keep":
                assert not task.done()
                await _resume(protocol, url)
                r = await task
                assert r.finish_reason == "length" and list(r.output_ids) == list(ref.output_ids)
            else:
                r = await task  # wait: running requests finish while paused
                assert r.finish_reason == "length" and list(r.output_ids) == list(ref.output_ids)
                await _resume(protocol, url)
            assert (await held).completion_tokens == 5
        finally:
            await a.aclose()


async def test_vllm_is_paused_and_bad_mode() -> None:
    async with running_sim("vllm", "toy") as url:
        assert (await _get_json(url + "/is_paused")) == {"is_paused": False}
        status, body = await _post(url + "/pause", params={"mode": "nap"})
        assert status == 400 and b'"error"' in body
        await _pause("vllm", url, "wait")
        assert (await _get_json(url + "/is_paused")) == {"is_paused": True}
        await _resume("vllm", url)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_abort_endpoint(protocol: str) -> None:
    async with running_sim(protocol, "toy", latency_ms=2) as url:
        a = _adapter(protocol, url)
        try:
            task = asyncio.create_task(a.generate(GenerateRequest(_rid(0xABC), PROMPT, 200)))
            await asyncio.sleep(0.03)
            if protocol == "sglang":
                await _post(url + "/abort_request", {"rid": _rid(0xABC)[:20]})  # prefix match
            else:  # vLLM 0.32 aborts by its own id only: the bare one answers 200 and aborts nothing
                await _post(url + "/abort_requests", {"request_ids": [_rid(0xABC)]})
                await asyncio.sleep(0.03)
                assert not task.done()
                await _post(url + "/abort_requests", {"request_ids": ["generate-tokens-" + _rid(0xABC)]})
            r = await task
            assert r.finish_reason == "abort" and len(r.output_ids) < 200
        finally:
            await a.aclose()


async def test_sglang_streaming_is_cumulative() -> None:
    async with running_sim("sglang", "toy") as url:
        body = {"rid": _rid(1), "input_ids": PROMPT, "return_logprob": True, "stream": True,
                "sampling_params": {"max_new_tokens": 12}}
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as resp:
            assert resp.content_type == "text/event-stream"
            text = (await resp.read()).decode()
        frames = [f for f in text.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]" and len(frames) == 13
        import json

        events = [json.loads(f[6:]) for f in frames[:-1]]
        assert [len(e["output_ids"]) for e in events] == list(range(1, 13))
        assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
        assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        r = parse_sglang_stream(text, request_id=_rid(1))
        assert list(r.output_ids) == events[-1]["output_ids"] and r.finish_reason == "length"


async def test_info_endpoints_are_honest() -> None:
    async with running_sim("sglang", "toy", dp=4) as url:
        info = await _get_json(url + "/get_server_info")
        assert info["dp_size"] == 4 and info["simulated"] is True
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200 and await r.read() == b""
            async with s.post(url + "/flush_cache") as r:
                assert r.status == 200 and (await r.text()).startswith("Cache flushed.")
    async with running_sim("vllm", "toy") as url:
        models = await _get_json(url + "/v1/models")
        assert models["data"][0]["simulated"] is True
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            assert "vllm:prefix_cache_hits_total" in await r.text()


@pytest.mark.parametrize("padding", ["floats", "base64"])
async def test_routed_experts_padding_stays_raw(padding: str) -> None:
    async with running_sim("sglang", "toy", padding=padding) as url:
        a = SGLangAdapter(url)
        try:
            r = await a.generate(GenerateRequest(_rid(1), PROMPT, 4, return_routed_experts=True))
            assert r.routed_experts is not None and len(r.routed_experts) > 900_000
            if padding == "floats":
                assert len(r.routed_experts) > 1_300_000 and r.routed_experts.startswith(b"[[0.0,")
        finally:
            await a.aclose()


async def test_real_tokenizer_sim_parses_through_adapters(load_tokenizer: Any) -> None:
    from session_server.sim.sampler import sim_model_from_tokenizer

    tok = load_tokenizer("qwen3")
    model = sim_model_from_tokenizer(tok, name="qwen3-offline")
    msgs = [{"role": "user", "content": "List the files."}]
    prompt = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    for protocol in ("sglang", "vllm"):
        async with running_sim(protocol, model, noncanonical=True) as url:
            a = _adapter(protocol, url)
            try:
                r = await a.generate(GenerateRequest(_rid(1), prompt, 512))
                assert r.finish_reason == "stop" and r.output_ids[-1] in model.eos_ids
                text = tok.decode(list(r.output_ids))
                assert "<think>" in text or "<tool_call>" in text or text
                assert all(isinstance(t, int) and 0 <= t < model.vocab_size for t in r.output_ids)
            finally:
                await a.aclose()


async def test_bad_requests_are_400() -> None:
    async with running_sim("sglang", "toy", dp=2) as url:
        status, _ = await _post(url + "/generate", {"input_ids": [1], "data_parallel_rank": 5})
        assert status == 400
    async with running_sim("vllm", "toy") as url:
        status, _ = await _post(url + "/v1/completions", {"prompt": "text prompt", "max_tokens": 3})
        assert status == 400
        status, _ = await _post(url + "/inference/v1/generate", {"token_ids": [1]},
                                headers={"X-data-parallel-rank": "3"})
        assert status == 400


@pytest.mark.parametrize("family", ["qwen3", "llama3", "llama3.1", "glm4moe"])
def test_every_family_scripts_a_closed_turn(family: str, load_tokenizer: Any) -> None:
    from session_server.sim.sampler import sim_model_from_tokenizer

    tok = load_tokenizer(family)
    model = sim_model_from_tokenizer(tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                     add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    for seed in range(4):
        for noncanonical in (False, True):
            c = ScriptedPolicy(model, seed=seed, noncanonical=noncanonical).start(prompt)
            assert len(c.planned) > 1 and c.planned[-1] in model.eos_ids, (family, seed)


def test_prefix_cache_is_namespaced_by_salt() -> None:
    from session_server.sim.cache import PrefixCache

    cache = PrefixCache(capacity_tokens=1000, page_size=1)
    ids = list(range(50))
    cache.insert(ids, "wv-1")
    assert cache.match(ids + [99], "wv-1") == 50
    assert cache.match(ids + [99], "wv-2") == 0
    assert cache.match(ids + [99]) == 0
