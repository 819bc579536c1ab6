"""The simulator matches stop strings as the engines do, and its `hold_*_stop` faults.

vLLM 0.32 and SGLang match a request's stop strings on its own decoded output only (never
the prompt), keep every sampled id through the token that completed the string (only the
text is trimmed: vLLM `include_stop_str_in_output`, SGLang `no_stop_trim`), and name the
string: vLLM `finish_reason: "stop"` with `stop_reason` the string (as vLLM's own
`test_stop_reason.py` asserts), SGLang `{"type": "stop", "matched": "<string>"}`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from session_server.engines import GenerateRequest, SGLangAdapter, VLLMAdapter
from session_server.engines.base import SamplingParams
from session_server.sim import running_sim
from session_server.sim.toy import toy_decode, toy_prompt

PROMPT = toy_prompt(("user", "list the files"))
RID = f"{1:032x}"


def _adapter(protocol: str, url: str) -> SGLangAdapter | VLLMAdapter:
    return SGLangAdapter(url, retries=0) if protocol == "sglang" else VLLMAdapter(url, retries=0)


async def _post(url: str, body: Any) -> Any:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return await r.json()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_stop_string_ends_the_output_on_the_token_that_completes_it(protocol: str) -> None:
    async with running_sim(protocol, "toy") as url:
        a = _adapter(protocol, url)
        try:
            free = await a.generate(GenerateRequest(RID, PROMPT, 60))
            ids = list(free.output_ids)
            text = toy_decode(ids[5:8])
            stop = text[1:]  # starts inside token 5, ends with token 7
            got = await a.generate(GenerateRequest(RID, PROMPT, 60, sampling=SamplingParams(stop=(stop, "zzzz"))))
            n = len(got.output_ids)
            assert got.finish_reason == "stop" and got.matched_stop == stop
            assert list(got.output_ids) == ids[:n]  # every id through the completing one
            assert stop in toy_decode(ids[:n]) and stop not in toy_decode(ids[:n - 1])
            # a stop string in the prompt only never stops the output
            prompt_text = toy_decode(PROMPT)
            again = await a.generate(GenerateRequest(RID, PROMPT, 8, sampling=SamplingParams(stop=(prompt_text[-6:],))))
            assert again.finish_reason == "length" and len(again.output_ids) == 8
        finally:
            await a.aclose()


async def test_sglang_trims_the_text_at_a_stop_string_unless_no_stop_trim() -> None:
    async with running_sim("sglang", "toy") as url:
        free = await _post(f"{url}/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60}})
        stop = toy_decode(free["output_ids"][5:8])[1:]
        sp = {"max_new_tokens": 60, "stop": stop}
        trimmed = await _post(f"{url}/generate", {"input_ids": PROMPT, "sampling_params": sp})
        kept = await _post(f"{url}/generate", {"input_ids": PROMPT, "sampling_params": {**sp, "no_stop_trim": True}})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["output_ids"] == kept["output_ids"]  # the ids are never trimmed
    assert kept["text"].endswith(stop) and not trimmed["text"].endswith(stop)
    assert kept["text"] == trimmed["text"] + stop


async def test_vllm_names_the_stop_string_in_stop_reason_and_keeps_every_id() -> None:
    async with running_sim("vllm", "toy") as url:
        body = {"model": "m", "token_ids": PROMPT, "sampling_params": {"max_tokens": 60}}
        free = (await _post(f"{url}/inference/v1/generate", body))["choices"][0]
        stop = toy_decode(free["token_ids"][5:8])[1:]
        body["sampling_params"] = {"max_tokens": 60, "stop": [stop]}
        choice = (await _post(f"{url}/inference/v1/generate", body))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["token_ids"] == free["token_ids"][: len(choice["token_ids"])]
    assert stop in toy_decode(choice["token_ids"])


@pytest.mark.parametrize("fault", ["hold_on_stop", "hold_before_stop"])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_hold_faults_wait_near_the_stop_step_for_a_pause(protocol: str, fault: str) -> None:
    """Held on the stop step (or the one before), an abort pause ends the request `abort`
    with that step's token (SGLang checks the abort flag before the stop check)."""
    async with running_sim(protocol, "toy") as url:
        a = _adapter(protocol, url)
        try:
            free = await a.generate(GenerateRequest(RID, PROMPT, 60))
            stop = toy_decode(list(free.output_ids)[5:8])[1:]
            req = GenerateRequest(RID, PROMPT, 60, sampling=SamplingParams(stop=(stop,)))
            ref = await a.generate(req)
            await _post(f"{url}/sim/faults", {"kind": fault})
            task = asyncio.create_task(a.generate(req))
            async with aiohttp.ClientSession() as s:
                for _ in range(1000):
                    async with s.get(f"{url}/sim/held") as r:
                        if (await r.json())["held"]:
                            break
                    await asyncio.sleep(0.005)
                else:
                    raise AssertionError("never held")
            assert not task.done()
            await a.pause("abort")
            got = await task
            await a.resume()
            n = len(ref.output_ids) - (0 if fault == "hold_on_stop" else 1)
            assert got.finish_reason == "abort" and list(got.output_ids) == list(ref.output_ids)[:n]
        finally:
            await a.aclose()
