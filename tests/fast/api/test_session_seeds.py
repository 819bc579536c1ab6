"""Deterministic seeds through real HTTP and the OpenAI SDK: a session's `seed` gives each
engine request the seed derived from (seed, branch, turn, segment), so the same seed and
prompts draw the same tokens, a retried turn and a segment resubmitted after an abort get
the seed they had, and each turn records the seed of every segment. A client's own seed
stays as it was under the `client` policy and is only recorded under `pinned`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI, InternalServerError

from session_server.engines.base import derive_seed

from ..stack import Stack, live_stack, until_in_flight

MSGS: list[Any] = [{"role": "user", "content": "Refactor the config loader and run the tests."}]
SEED_KEY = {"sglang": "sampling_seed", "vllm": "seed"}
NEVER = 10_000  # an abort_plan entry past any turn's end


def _oai(st: Stack, sid: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)


async def _turns(st: Stack, sid: str) -> list[dict[str, Any]]:
    return [t for b in (await st.trajectory(sid))["branches"] for t in b["turns"]]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_same_session_seed_and_prompts_draw_the_same_tokens_and_another_seed_others(
        qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as st:
        sids = [await st.session(seed=s) for s in (11, 11, 12)]
        for sid in sids:
            await _oai(st, sid).chat.completions.create(model="m", messages=MSGS, max_tokens=200)
        log = await st.engine_log()
        turns = [(await _turns(st, sid))[0] for sid in sids]
    seeds = [r["sampling_params"][SEED_KEY[protocol]] for r in log]
    assert seeds == [derive_seed(11, 0, 0, 0), derive_seed(11, 0, 0, 0), derive_seed(12, 0, 0, 0)]
    assert log[0]["output_ids"] == log[1]["output_ids"]
    assert log[0]["output_ids"] != log[2]["output_ids"]  # the engine honours the seed
    assert [t["extra"]["sampling"]["seeds"] for t in turns] == [[s] for s in seeds]


async def test_each_turn_and_branch_gets_its_own_derived_seed(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(seed=7)
        client = _oai(st, sid)
        first = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=200)
        history = [*MSGS, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "user", "content": "Now add a test."}]
        await client.chat.completions.create(model="m", messages=history, max_tokens=200)
        # the first turn again with another question: a rollback, on branch 1 at turn 0
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Only read it."}],
                                             max_tokens=200)
        log = await st.engine_log()
        traj = await st.trajectory(sid)
    assert [r["sampling_params"]["sampling_seed"] for r in log] == [
        derive_seed(7, 0, 0, 0), derive_seed(7, 0, 1, 0), derive_seed(7, 1, 0, 0)]
    assert [len(b["turns"]) for b in traj["branches"]] == [2, 1]


async def test_a_retried_turn_is_sent_the_seed_of_its_first_try(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(seed=3)
        await st.fault("nan_logprob")  # the first try's output is bad: a 502, nothing committed
        client = _oai(st, sid)
        with pytest.raises(InternalServerError):
            await client.chat.completions.create(model="m", messages=MSGS, max_tokens=200)
        await client.chat.completions.create(model="m", messages=MSGS, max_tokens=200)
        log = await st.engine_log()
        turns = await _turns(st, sid)
    assert [r["sampling_params"]["sampling_seed"] for r in log] == [derive_seed(3, 0, 0, 0)] * 2
    assert log[0]["output_ids"] == log[1]["output_ids"]
    assert len(turns) == 1 and turns[0]["extra"]["sampling"]["seeds"] == [derive_seed(3, 0, 0, 0)]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_segment_resubmitted_after_a_pause_abort_is_sent_its_own_derived_seed(
        qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol, latency_ms=4) as st:
        ref = await st.session(seed=21)
        await st.chat(ref, {"messages": MSGS, "max_tokens": 200})
        sid = await st.session(seed=21)
        chat = asyncio.create_task(_oai(st, sid).chat.completions.create(model="m", messages=MSGS, max_tokens=200))
        await until_in_flight(st, sid)
        await asyncio.sleep(0.05)
        assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
        await asyncio.sleep(0.02)
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        await chat
        log = await st.engine_log()
        turns = [(await _turns(st, s))[0] for s in (ref, sid)]
        sampled = [(await st.trajectory(s))["branches"][0]["token_ids"] for s in (ref, sid)]
    segments = log[1:]
    assert len(segments) >= 2 and segments[0]["finish_reason"] == "abort"
    want = [derive_seed(21, 0, 0, k) for k in range(len(segments))]
    assert [r["sampling_params"][SEED_KEY[protocol]] for r in segments] == want
    assert turns[1]["extra"]["sampling"]["seeds"] == want
    assert sampled[0] == sampled[1]  # the simulator continues the partial's plan (sampler.py)


async def test_client_seed_is_kept_on_every_segment_under_client_and_only_recorded_under_pinned(
        qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, abort_plan=[5, NEVER, 5, NEVER]) as st:
        loose = await st.session(sampling_policy="client", seed=9)
        await _oai(st, loose).chat.completions.create(model="m", messages=MSGS, max_tokens=200, seed=42)
        pinned = await st.session(sampling_policy="pinned", seed=9)
        await _oai(st, pinned).chat.completions.create(model="m", messages=MSGS, max_tokens=200, seed=42)
        log = await st.engine_log()
        recs = [(await _turns(st, s))[0]["extra"]["sampling"] for s in (loose, pinned)]
    seeds = [r["sampling_params"]["sampling_seed"] for r in log]
    assert seeds == [42, 42, derive_seed(9, 0, 0, 0), derive_seed(9, 0, 0, 1)]
    assert recs[0]["seeds"] == [42, 42] and recs[0]["client"]["seed"] == 42
    assert recs[1]["seeds"] == seeds[2:] and recs[1]["client"]["seed"] == 42 and "seed" in recs[1]["overridden"]
