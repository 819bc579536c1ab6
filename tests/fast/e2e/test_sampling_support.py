"""Sampling support capture through real HTTP and the OpenAI SDK, on both simulated wires:
vLLM started with processed logprobs (masked tokens at its -9999.0 floor) and SGLang
(post-temperature, untruncated top logprobs the server truncates by its rule).

A turn cut into segments (the simulator's exact `abort_plan`, or a control-plane
`abort` pause) and resubmitted commits the same supports as the uninterrupted turn,
row for row beside its tokens; what a support session cannot replay is a 400 naming
the field; an engine whose supports break the rules is a 502 with nothing committed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from session_server.client import AsyncSessionClient

from ..stack import Stack, live_stack, until_in_flight

TOP_K, K = 4, 8
SAMPLING = {"top_k": TOP_K, "temperature": 1.0}
MSGS = [{"role": "user", "content": "Fix the failing test in the parser."}]
NEVER = 10_000


def _sim(protocol: str) -> dict[str, Any]:
    return {"logprobs_mode": "processed_logprobs"} if protocol == "vllm" else {}


async def _session(st: Stack) -> str:
    return await st.session(sampling_support=K, sampling=SAMPLING)


async def _sdk_turn(st: Stack, sid: str, **kw: Any) -> Any:
    client = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
    try:
        return await client.chat.completions.create(model="m", messages=MSGS, max_tokens=40, **kw)  # type: ignore[arg-type]
    finally:
        await client.close()


async def _support(st: Stack, sid: str) -> tuple[list[int], list[list[int]]]:
    """The sampled ids of the session's one sample and each one's support (npz samples)."""
    (s,) = await AsyncSessionClient(st.url).samples(sid, format="npz")
    sup = s.sampling_support
    assert sup is not None and len(sup) == len(s)
    at = [i for i in range(len(s)) if s.loss_mask[i]]
    return [int(s.token_ids[i]) for i in at], [sup.row(i).tolist() for i in at]


def _check_rows(ids: list[int], rows: list[list[int]]) -> None:
    assert ids and len(ids) == len(rows)
    for tok, row in zip(ids, rows, strict=True):
        assert tok in row and len(row) == TOP_K  # top_k truncates: k = 8 asked, 4 kept


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_supports_across_aborted_segments_equal_the_uninterrupted_turns(qwen3_dir: Path, protocol: str) -> None:
    # generation 1 whole (the reference); the second turn's cut after 3, then 2 tokens
    async with live_stack(qwen3_dir, protocol, abort_plan=[NEVER, 3, 2], **_sim(protocol)) as st:
        ref, sid = await _session(st), await _session(st)
        assert (await _sdk_turn(st, ref)).choices[0].message is not None
        resp = await _sdk_turn(st, sid, logprobs=True, top_logprobs=2)
        want, got = await _support(st, ref), await _support(st, sid)
        turn = (await st.trajectory(sid))["branches"][0]["turns"][0]
        log = await st.engine_log()
    assert turn["extra"]["control"]["segments"] == 3
    assert [e["finish_reason"] for e in log].count("abort") == 2
    assert got == want
    _check_rows(*got)
    # the client sees the top logprobs it asked for, not the k the support needed
    assert {len(c.top_logprobs) for c in resp.choices[0].logprobs.content} == {2}


async def test_supports_across_control_plane_abort_pauses_equal_the_uninterrupted_turns(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "vllm", latency_ms=4, logprobs_mode="processed_logprobs") as st:
        ref, sid = await _session(st), await _session(st)
        await _sdk_turn(st, ref)
        turn = asyncio.create_task(_sdk_turn(st, sid))
        await until_in_flight(st, sid)
        for _ in range(2):
            await asyncio.sleep(0.03)
            assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
            await asyncio.sleep(0.02)
            assert (await st.http.post("/control/resume", json={})).status_code == 200
        await turn
        view = (await st.http.get(f"/sessions/{sid}")).json()
        want, got = await _support(st, ref), await _support(st, sid)
    assert view["control"]["aborts"] >= 1 and view["control"]["resubmits"] >= 1
    assert got == want
    _check_rows(*got)


@pytest.mark.parametrize(("body", "field"), [
    ({"sampling": {**SAMPLING, "presence_penalty": 0.5}}, "presence_penalty"),
    ({"sampling": {**SAMPLING, "repetition_penalty": 1.1}}, "repetition_penalty"),
    ({"sampling": {"temperature": 1.0}}, "top_k"),
    ({"sampling": {**SAMPLING, "top_k": K + 1}}, "top_k"),
    ({"sampling": {**SAMPLING, "temperature": 0.0}}, "temperature"),
])
async def test_a_session_that_cannot_be_replayed_is_refused_at_creation(
    qwen3_dir: Path, body: dict[str, Any], field: str
) -> None:
    async with live_stack(qwen3_dir, "vllm", logprobs_mode="processed_logprobs") as st:
        r = await st.http.post("/sessions", json={"sampling_support": K, **body})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("kw", "field"), [
    ({"top_p": 0.5}, "top_p"),
    ({"temperature": 0.7}, "temperature"),
    ({"frequency_penalty": 0.2}, "frequency_penalty"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
])
async def test_a_turn_that_changes_the_pinned_sampling_is_refused(qwen3_dir: Path, kw: dict[str, Any], field: str) -> None:
    """Under the `client` sampling policy the client's values would reach the engine: a
    support session refuses any that its supports could not be replayed with."""
    async with live_stack(qwen3_dir, "vllm", logprobs_mode="processed_logprobs") as st:
        sid = await st.session(sampling_support=K, sampling=SAMPLING, sampling_policy="client")
        with pytest.raises(openai.BadRequestError) as err:
            await _sdk_turn(st, sid, **kw)
        ok = await _sdk_turn(st, sid, temperature=1.0)  # the pinned value itself is fine
        log = await st.engine_log()
    assert field in str(err.value)
    assert ok.choices[0].message is not None and len(log) == 1  # the refused turn never reached the engine


@pytest.mark.parametrize("kw", [{"top_p": 0.5}, {"temperature": 0.7}, {"frequency_penalty": 0.2}])
async def test_under_the_pinned_policy_a_clients_own_sampling_never_reaches_a_support_session(
        qwen3_dir: Path, kw: dict[str, Any]) -> None:
    """The `pinned` policy sends the session's values whatever the client asks, so the
    client's are recorded, not refused, and the supports are read with the session's."""
    async with live_stack(qwen3_dir, "vllm", logprobs_mode="processed_logprobs") as st:
        sid = await st.session(sampling_support=K, sampling=SAMPLING, sampling_policy="pinned")
        ok = await _sdk_turn(st, sid, **kw)
        log = await st.engine_log()
        turn = (await st.trajectory(sid))["branches"][0]["turns"][0]
    (name, value), = kw.items()
    assert ok.choices[0].message is not None and len(log) == 1
    assert log[0]["sampling_params"].get(name) == SAMPLING.get(name)  # the session's value (or none)
    assert turn["extra"]["sampling"]["client"][name] == value and name in turn["extra"]["sampling"]["overridden"]


async def test_an_engine_without_processed_logprobs_is_a_502_with_nothing_committed(qwen3_dir: Path) -> None:
    """vLLM on its default raw logprobs returns k finite alternatives: a support larger
    than top_k, which no sampler with that top_k drew from."""
    async with live_stack(qwen3_dir, "vllm") as st:
        sid = await _session(st)
        with pytest.raises(openai.InternalServerError) as err:
            await _sdk_turn(st, sid)
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert err.value.status_code == 502 and "top_k" in str(err.value)
    assert view["turns"] == 0
