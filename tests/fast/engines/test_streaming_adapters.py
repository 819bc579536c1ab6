"""The adapters stream the engine's own generation (SGLang cumulative or
incremental `/generate` frames, vLLM delta chunks) and end with the same result a
non-streamed request gives."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from session_server.engines import GenerateRequest, SamplingParams, SGLangAdapter, VLLMAdapter
from session_server.engines.base import GenerateResult, TokenDelta
from session_server.engines.sglang import parse_sglang_generate, parse_sglang_stream
from session_server.engines.sglang_replies import SGLangStream
from session_server.errors import UpstreamInvalid
from session_server.sim import running_sim
from session_server.sim.toy import toy_prompt

PROMPT = toy_prompt(("system", "be brief"), ("user", "stream it"))


async def _both(adapter: Any, salt: str) -> tuple[GenerateResult, list[TokenDelta], GenerateResult]:
    """(non-streamed result, streamed deltas, streamed final) of one seeded request."""
    def req(s: str) -> GenerateRequest:
        return GenerateRequest(f"{7:032x}", PROMPT, 300, SamplingParams(temperature=1.0, seed=11),
                               top_logprobs=2, cache_salt=s)

    plain = await adapter.generate(req(salt + "-plain"))
    items = [item async for item in adapter.generate_stream(req(salt + "-stream"))]
    deltas, final = items[:-1], items[-1]
    assert all(isinstance(d, TokenDelta) for d in deltas) and isinstance(final, GenerateResult)
    return plain, deltas, final


@pytest.mark.parametrize(("protocol", "endpoint"), [("sglang", None), ("sglang", "incremental"), ("vllm", "generate"),
                                                   ("vllm", "completions")])
async def test_streamed_result_equals_non_streamed(protocol: str, endpoint: str | None) -> None:
    deltas_only = endpoint == "incremental"  # SGLang started with --incremental-streaming-output, and told so
    sim = {"incremental_streaming_output": True} if deltas_only else {}
    async with running_sim(protocol, "toy", seed=3, latency_ms=1, **sim) as url:
        a = (SGLangAdapter(url, incremental_stream=deltas_only) if protocol == "sglang"
             else VLLMAdapter(url, endpoint=endpoint or "auto"))
        try:
            plain, deltas, final = await _both(a, protocol)
        finally:
            await a.aclose()
    assert len(deltas) > 3  # really streamed: many chunks, not one
    assert dataclasses.replace(final, cached_tokens=None) == dataclasses.replace(plain, cached_tokens=None)
    assert [t for d in deltas for t in d.ids] == list(final.output_ids)
    assert [lp for d in deltas for lp in d.logprobs] == list(final.logprobs)


def test_sglang_incremental_frames_join_to_the_cumulative_result() -> None:
    """The server's incremental streaming option: each frame carries only its new tokens."""
    meta = '"id":"r","prompt_tokens":3,"completion_tokens":%d,"cached_tokens":0'
    frames = [
        '{"output_ids":[5],"meta_info":{%s,"finish_reason":null,"output_token_logprobs":[[-0.5,5,null]]}}'
        % (meta % 1),
        '{"output_ids":[6,2],"meta_info":{%s,"finish_reason":{"type":"stop","matched":2},'
        '"output_token_logprobs":[[-0.25,6,null],[-0.125,2,null]]}}' % (meta % 3),
    ]
    body = "".join(f"data: {f}\n\n" for f in frames) + "data: [DONE]\n\n"
    got = parse_sglang_stream(body, request_id="r")
    whole = parse_sglang_generate(
        ('{"output_ids":[5,6,2],"meta_info":{%s,"finish_reason":{"type":"stop","matched":2},'
         '"output_token_logprobs":[[-0.5,5,null],[-0.25,6,null],[-0.125,2,null]]}}' % (meta % 3)).encode(),
        request_id="r")
    assert got == whole
    with pytest.raises(UpstreamInvalid):
        parse_sglang_stream(f"data: {frames[0]}\n\n", request_id="r")  # cut before [DONE]


def test_sglang_frames_declared_incremental_are_deltas_from_the_first() -> None:
    """Frames of one token each without `completion_tokens`: nothing in them says whether
    they are deltas (a cumulative stream's second frame would hold two tokens). Declared
    incremental (the engine's setting), each is its own tokens; undeclared, they read as
    cumulative frames that repeat the first token."""
    frames = [b'{"output_ids":[%d],"meta_info":{"id":"r","prompt_tokens":3,"finish_reason":%s,'
              b'"output_token_logprobs":[[-0.5,%d,null]]}}' % (t, fin, t)
              for t, fin in ((5, b"null"), (6, b"null"), (2, b'{"type":"stop","matched":2}'))]
    told, guessed = SGLangStream(request_id="r", incremental=True), SGLangStream(request_id="r")
    seen: dict[str, list[int]] = {"told": [], "guessed": []}
    for f in (*frames, b"[DONE]"):
        for name, acc in (("told", told), ("guessed", guessed)):
            d = acc.add(f)
            seen[name] += d.ids if d is not None else []
    assert seen["told"] == [5, 6, 2] and list(told.result().output_ids) == [5, 6, 2]
    assert seen["guessed"] != [5, 6, 2]  # why the setting exists: the frames alone cannot say


def test_sglang_cumulative_frames_wrongly_declared_incremental_fail_at_the_first_repeat() -> None:
    """A server declared incremental that streams cumulative frames: each frame's
    `completion_tokens` is checked against the ids held so far, so the stream fails at
    the first frame that repeats a token (a watched turn is then sent again unstreamed)
    instead of yielding whole prefixes as deltas and failing only at the end."""
    frames = [b'{"output_ids":%s,"meta_info":{"id":"r","prompt_tokens":3,"completion_tokens":%d,'
              b'"finish_reason":null,"output_token_logprobs":%s}}'
              % (json.dumps(ids).encode(), len(ids), json.dumps([[-0.5, t, None] for t in ids]).encode())
              for ids in ([10], [10, 11], [10, 11, 12])]
    acc = SGLangStream(request_id="r", incremental=True)
    first = acc.add(frames[0])
    assert first is not None and first.ids == [10]
    with pytest.raises(UpstreamInvalid, match="completion_tokens"):
        acc.add(frames[1])


@pytest.mark.parametrize("server_incremental", [False, True], ids=["cumulative-server", "incremental-server"])
async def test_sglang_declared_incremental_is_confirmed_against_the_server(server_incremental: bool) -> None:
    """The declaration is checked where the engine is verified: a server whose
    `/get_server_info` says `incremental_streaming_output: false` is read as cumulative
    (with a warning); one that says true keeps the declaration."""
    sim = {"incremental_streaming_output": True} if server_incremental else {}
    async with running_sim("sglang", "toy", seed=3, **sim) as url:
        a = SGLangAdapter(url, incremental_stream=True)
        try:
            await a.prove_protocol()
        finally:
            await a.aclose()
    assert a.capabilities.incremental_stream is server_incremental
