"""Instances that share engines learn each other's load from the engines.

SGLang `/get_load` and vLLM `/metrics` (running + waiting per DP rank) are polled every
`engine_load_poll_s`; the part beyond an instance's own in-flight turns is added to its
count when it places a NEW session, so N instances spread instead of piling onto one
engine, while an existing session keeps its home.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.engines import make_adapter
from session_server.engines.load import sglang_load, vllm_load
from session_server.ops.harness import running_server
from session_server.routing import (
    EnginePool,
    RoutingSignals,
    StickyCost,
    StickyLeastLoaded,
    make_policy,
)
from session_server.sim import running_sim

MSGS = [{"role": "user", "content": "Refactor the config loader and run the tests."}]
HOLD = {"sglang": "in_place", "vllm": "keep"}  # a pause that holds new requests waiting


def test_sglang_get_load_shapes() -> None:
    # the scheduler's num_reqs is running + waiting already (num_waiting_reqs is part of it)
    legacy = [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 900},
              {"dp_rank": 1, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert sglang_load(legacy) == {0: 5, 1: 0}
    v1 = {"loads": [{"dp_rank": 1, "num_running_reqs": 4, "num_waiting_reqs": 1}]}
    assert sglang_load(v1) == {1: 5}
    assert sglang_load({"error": "x"}) == {} and sglang_load([None, {"num_reqs": True}]) == {1: 0}


def test_vllm_metrics_gauges() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 99.0\n'
    )
    assert vllm_load(text) == {0: 5, 1: 1}
    assert vllm_load(text.encode()) == {0: 5, 1: 1}


@pytest.mark.parametrize("policy", [StickyCost(), StickyLeastLoaded()])
def test_placement_adds_engine_reported_load_and_keeps_homes(policy: Any) -> None:
    pool = EnginePool(policy)
    pool.add("e0")
    pool.add("e1")
    t0 = pool.targets["e0/0"]
    t0.in_flight = 1  # one of ours; the engine reports 5: 4 are other instances'
    pool.set_engine_load("e0", {0: 5})
    pool.set_engine_load("e1", {0: 0})
    assert t0.external_load == 4 and pool.targets["e1/0"].external_load == 0
    views = {v.id: v for v in pool.views()}
    assert views["e0/0"].placement_load == 5
    # a new session goes to the engine the others left free, whatever its hash prefers
    for i in range(20):
        signals = RoutingSignals(session_id=f"s{i}", home=None, targets=pool.views(), context_tokens=100)
        assert policy.select(signals) == "e1/0"
    # an existing session keeps its home (its KV is there)
    signals = RoutingSignals(session_id="old", home="e0/0", targets=pool.views(), context_tokens=100)
    assert policy.select(signals) == "e0/0"
    pool.set_engine_load("e0", None)  # unknown (engine did not answer): nothing added
    assert t0.external_load == 0


def test_an_engine_known_as_one_target_counts_every_rank_it_reports() -> None:
    """vLLM does not report its DP size: added without `dp_size` it is one target, and
    its own balancer spreads our requests over its ranks, so all of them count."""
    pool = EnginePool(StickyLeastLoaded())
    pool.add("v")  # one target
    pool.add("s", dp_size=2)  # SGLang: its ranks are our targets
    pool.targets["v/0"].in_flight = 2
    pool.set_engine_load("v", {0: 3, 1: 4})
    assert pool.targets["v/0"].external_load == 5
    pool.set_engine_load("s", {0: 3, 1: 4})
    assert [pool.targets[f"s/{r}"].external_load for r in (0, 1)] == [3, 4]


@pytest.mark.parametrize("name", ["sticky_cost", "sticky_least_loaded", "bounded_load", "cache_aware"])
def test_every_load_aware_policy_counts_other_instances_work(name: str) -> None:
    """Each policy that weighs load weighs the engine-reported part too. 100 requests
    beyond ours on e0 passes even `cache_aware`'s imbalance threshold (SGLang's 64)."""
    pool = EnginePool(make_policy(name))
    pool.add("e0")
    pool.add("e1")
    pool.set_engine_load("e0", {0: 100})
    pool.set_engine_load("e1", {0: 0})
    for i in range(20):
        signals = RoutingSignals(session_id=f"s{i}", home=None, targets=pool.views(), context_tokens=100,
                                 prefix_hashes=(i, i + 1))
        assert pool.policy.select(signals) == "e1/0", (name, i)
    pool.set_engine_load("e0", {0: 0})  # load learning off or the work gone: both are used again
    picks = {pool.policy.select(RoutingSignals(session_id=f"n{i}", home=None, targets=pool.views(),
                                               context_tokens=100, prefix_hashes=(1000 + i,)))
             for i in range(40)}
    assert picks == {"e0/0", "e1/0"}, (name, picks)


@pytest.mark.parametrize("name", ["round_robin", "consistent_hash"])
def test_load_blind_policies_stay_blind(name: str) -> None:
    """By design these two never weigh load; engine reports do not change their picks."""
    def picks(reported: int) -> list[str | None]:
        pool = EnginePool(make_policy(name))
        pool.add("e0")
        pool.add("e1")
        pool.set_engine_load("e0", {0: reported})
        return [pool.policy.select(RoutingSignals(session_id=f"s{i}", home=None, targets=pool.views(),
                                                  context_tokens=100)) for i in range(20)]
    assert picks(100) == picks(0) and set(picks(100)) == {"e0/0", "e1/0"}


def test_sticky_cost_migrates_on_its_own_turns_not_on_polled_reports() -> None:
    """Every instance sees the same polled report: migrating on it would move all of
    their sessions off one engine at once (and back at the next poll). A home that
    others load stays home; one this instance loads still sheds a small context."""
    pool = EnginePool(StickyCost())
    pool.add("e0")
    pool.add("e1")
    pool.set_engine_load("e0", {0: 100})
    small = RoutingSignals(session_id="s", home="e0/0", targets=pool.views(), context_tokens=100)
    assert pool.policy.select(small) == "e0/0"
    pool.set_engine_load("e0", None)
    pool.targets["e0/0"].in_flight = 20  # this instance's own turns
    small = RoutingSignals(session_id="s", home="e0/0", targets=pool.views(), context_tokens=100)
    assert pool.policy.select(small) == "e1/0"
    long = RoutingSignals(session_id="s", home="e0/0", targets=pool.views(), context_tokens=1 << 20)
    assert pool.policy.select(long) == "e0/0"


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_sims_report_waiting_and_running_wire_faithfully(qwen3_dir: Path, protocol: str) -> None:
    async with running_sim(protocol, str(qwen3_dir), seed=3, dp=2, latency_ms=5) as url:
        adapter = await make_adapter(f"{protocol}={url}")
        try:
            assert await adapter.load_by_rank() == {0: 0, 1: 0}  # type: ignore[attr-defined]
            await adapter.pause(HOLD[protocol])
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                path, body = (("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
                              if protocol == "sglang" else
                              ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}))
                calls = [asyncio.create_task(http.post(path, json=body)) for _ in range(3)]
                load: dict[int, int] = {}
                for _ in range(200):
                    load = await adapter.load_by_rank()  # type: ignore[attr-defined]
                    if sum(load.values()) == 3:
                        break
                    await asyncio.sleep(0.01)
                assert load == {0: 2, 1: 1}, load  # held by the pause: waiting, round-robin over ranks
                if protocol == "vllm":
                    text = (await http.get("/metrics")).text
                    assert 'vllm:num_requests_waiting{engine="0",model_name=' in text
                else:
                    raw = (await http.get("/get_load")).json()
                    assert [e["num_waiting_reqs"] for e in raw] == [2, 1] and [e["num_reqs"] for e in raw] == [2, 1]
                await adapter.resume()
                assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
        finally:
            await adapter.aclose()


async def _busy_elsewhere_then_place(qwen3_dir: Path, protocol: str, poll_s: float) -> list[str | None]:
    """Instance A (engine e0 only) has 4 turns waiting on e0; instance B (e0 and e1,
    polling loads every `poll_s`) then places 3 concurrent new sessions: their homes."""
    async with contextlib.AsyncExitStack() as stack:
        e0 = await stack.enter_async_context(running_sim(protocol, str(qwen3_dir), seed=3))
        e1 = await stack.enter_async_context(running_sim(protocol, str(qwen3_dir), seed=4))
        fast = {"engine_load_poll_s": poll_s, "health_check_interval_s": 30.0}
        a_url = await stack.enter_async_context(running_server(AppConfig(
            tokenizer=str(qwen3_dir), engines=[f"{protocol}={e0}"], settings=Settings(engine_load_poll_s=0))))
        b_url = await stack.enter_async_context(running_server(AppConfig(
            tokenizer=str(qwen3_dir), engines=[f"{protocol}={e0}", f"{protocol}={e1}"], settings=Settings(**fast))))
        a = await stack.enter_async_context(httpx.AsyncClient(base_url=a_url, timeout=30))
        b = await stack.enter_async_context(httpx.AsyncClient(base_url=b_url, timeout=30))
        hold = await make_adapter(f"{protocol}={e0}")
        await hold.pause(HOLD[protocol])  # A's turns stay on e0 (waiting) while B places
        try:
            async def chat(http: httpx.AsyncClient, max_tokens: int) -> httpx.Response:
                sid = (await http.post("/sessions", json={})).json()["session_id"]
                return await http.post(f"/sessions/{sid}/v1/chat/completions",
                                       json={"messages": MSGS, "max_tokens": max_tokens})

            a_turns = [asyncio.create_task(chat(a, 8)) for _ in range(4)]
            if poll_s > 0:  # until B has seen them on e0
                for _ in range(500):
                    view = (await b.get("/engines")).json()
                    if view["engines"][0]["reported_load"] == [{"dp_rank": 0, "requests": 4}]:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError(f"B never learned e0's load: {view}")
            else:
                await asyncio.sleep(0.3)
            sids = [(await b.post("/sessions", json={})).json()["session_id"] for _ in range(3)]
            b_turns = [asyncio.create_task(b.post(f"/sessions/{s}/v1/chat/completions",
                                                  json={"messages": MSGS, "max_tokens": 8})) for s in sids]
            await asyncio.wait(b_turns, timeout=3)
            homes = [(await b.get(f"/sessions/{s}")).json()["home"] for s in sids]
        finally:
            await hold.resume()
            await hold.aclose()
        await asyncio.gather(*a_turns, *b_turns)
        return homes


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_new_sessions_avoid_an_engine_other_instances_loaded(qwen3_dir: Path, protocol: str) -> None:
    homes = await _busy_elsewhere_then_place(qwen3_dir, protocol, poll_s=0.02)
    assert homes == ["e1/0"] * 3, homes


async def test_without_load_learning_instances_pile_onto_the_busy_engine(qwen3_dir: Path) -> None:
    """The control: with polling off, B cannot see A's turns and puts some of its new
    sessions on the engine A keeps busy."""
    homes = await _busy_elsewhere_then_place(qwen3_dir, "sglang", poll_s=0)
    assert "e0/0" in homes, homes
