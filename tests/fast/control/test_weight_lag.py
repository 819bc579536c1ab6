"""The staleness bound per turn (`max_weight_lag`, control/lag.py).

Against the real simulator over HTTP with the real adapters: a turn whose tokens
would span more than K weight versions ends at the update (finish `abort`, flagged,
its partial tokens kept with their versions) instead of being resubmitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from session_server.control import ControlPlane, ResilientResult, generate_resilient
from session_server.engines import GenerateRequest
from session_server.loopback import serving_aiohttp
from session_server.sim import SimModel, running_sim
from session_server.sim.server import SimEngine
from tests.fast.control.conftest import Spy, make_adapter
from trajectory.validate import Expectations, validate_generation


def _rid(n: int) -> str:
    return f"{n:032x}"


def _expect(model: SimModel, rid: str, prompt: list[int], max_tokens: int) -> Expectations:
    return Expectations(request_id=rid, prompt_len=len(prompt), vocab_size=model.vocab_size,
                        max_tokens=max_tokens, stop_token_ids=frozenset(model.eos_ids))


async def _update(control: ControlPlane, url: str, version: int, mode: str = "abort", hold_s: float = 0.0) -> None:
    """One weight update as a trainer does it: pause, update (engine + plane), resume."""
    assert (await control.pause(mode))["ok"]
    async with aiohttp.ClientSession() as s, s.post(url + "/sim/weight_version", json={"version": str(version)}) as r:
        assert r.status == 200
    control.set_weight_version(version)
    await asyncio.sleep(hold_s)
    assert (await control.resume())["ok"]


def _versions(got: ResilientResult) -> list[str]:
    return [str(v) for _, _, v in got.weight_spans]


# --- keep: a frozen request is cut at the update, before the engine resumes ---------------------


async def test_keep_pause_cuts_the_frozen_request_before_resume(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("update the function and run the tests")
    engine = SimEngine("sglang", qwen3_model, latency_ms=4, weight_version="1")
    async with serving_aiohttp(engine.make_app(), handler_cancellation=True) as url:
        spy = Spy(make_adapter("sglang", url))
        control = ControlPlane(lambda: [spy], grace_s=0.005, weight_version=1)
        try:
            task = asyncio.create_task(generate_resilient(
                spy, GenerateRequest(_rid(2), prompt, 400, max_weight_lag=1), control,
                expect=_expect(qwen3_model, _rid(2), prompt, 400)))
            await asyncio.sleep(0.06)
            assert (await control.pause("keep"))["ok"]
            produced = engine.running[_rid(2)].produced  # frozen: no token until resume
            assert produced > 0
            engine.weight_version = "2"
            control.set_weight_version(2)
            assert (await control.resume())["ok"]
            got = await task
        finally:
            await spy.aclose()
    # the abort landed while the engine was frozen: not one token under version 2
    assert len(got.output_ids) == produced
    assert got.finish_reason == "abort" and got.stale_bound is not None
    assert got.weight_spans == ((0, produced, 1),)  # its dispatch version, not the engine's "2"
    assert got.stale_bound == {"max_weight_lag": 1, "versions": [1], "next_version": 2}
    assert engine.aborted_rids == [_rid(2)] and len(spy.requests) == 1
    assert control.metrics.registry.get_sample_value("tito_turns_ended_stale_total") == 1


async def test_keep_pause_within_the_bound_runs_on(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("update the function and run the tests")
    async with running_sim("sglang", qwen3_model, latency_ms=4, weight_version="1") as url:
        spy = Spy(make_adapter("sglang", url))
        control = ControlPlane(lambda: [spy], grace_s=0.005, weight_version=1)
        try:
            ref = await generate_resilient(spy, GenerateRequest(_rid(1), prompt, 400), control)
            task = asyncio.create_task(generate_resilient(
                spy, GenerateRequest(_rid(2), prompt, 400, max_weight_lag=2), control))
            await asyncio.sleep(0.06)
            await _update(control, url, 2, mode="keep")
            got = await task
        finally:
            await spy.aclose()
    assert list(got.output_ids) == list(ref.output_ids) and got.stale_bound is None
    assert got.aborts == 0


# --- the property ---------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    protocol=st.sampled_from(["sglang", "vllm"]),
    bound=st.sampled_from([None, 1, 2, 3]),
    updates=st.lists(
        st.tuples(st.floats(0.0, 0.06), st.sampled_from(["abort", "abort", "keep", "wait"]), st.booleans()),
        min_size=0, max_size=5,
    ),
    topic=st.integers(0, 50),
)
def test_turn_never_spans_more_than_k_versions(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]], protocol: str, bound: int | None,
    updates: list[tuple[float, str, bool]], topic: int,
) -> None:
    """Random pauses, some with a weight update: the committed turn's spans hold at most K
    versions, its tokens are exactly what the engine sampled (its log, segment by segment)
    and a prefix of the uninterrupted turn; unbounded turns are never ended."""
    prompt = make_prompt(f"task number {topic}: list the files")
    budget = 300

    async def scenario() -> None:
        async with running_sim(protocol, qwen3_model, latency_ms=1.5, weight_version="0") as url:
            spy = Spy(make_adapter(protocol, url))
            control = ControlPlane(lambda: [spy], grace_s=0.005, weight_version=0)
            try:
                ref = await generate_resilient(spy, GenerateRequest(_rid(1), prompt, budget), control)
                spy.results.clear()
                task = asyncio.create_task(generate_resilient(
                    spy, GenerateRequest(_rid(2), prompt, budget, max_weight_lag=bound), control,
                    expect=_expect(qwen3_model, _rid(2), prompt, budget)))
                version = 0
                for delay_s, mode, bump in updates:
                    await asyncio.sleep(delay_s)
                    if bump:
                        version += 1
                        await _update(control, url, version, mode)
                    else:
                        assert (await control.pause(mode))["ok"]
                        assert (await control.resume())["ok"]
                got = await task
            finally:
                await spy.aclose()
        distinct = set(_versions(got))
        event(f"K={bound} versions={len(distinct)} finish={got.finish_reason}")
        if bound is not None:
            assert len(distinct) <= bound
        assert list(got.output_ids) == [t for r in spy.results for t in r.output_ids]
        assert list(got.output_ids) == list(ref.output_ids)[:len(got.output_ids)]
        assert list(got.logprobs) == list(ref.logprobs)[:len(got.logprobs)]
        if got.stale_bound is None:
            assert got.finish_reason == ref.finish_reason and len(got.output_ids) == len(ref.output_ids)
        else:
            assert bound is not None and got.finish_reason == "abort" and got.output_ids
            assert got.stale_bound["max_weight_lag"] == bound
            flagged = {str(v) for v in got.stale_bound["versions"]}  # may hold a frozen segment's new version
            assert distinct <= flagged and len(flagged) == bound
            assert str(got.stale_bound["next_version"]) not in flagged
        validate_generation(got, _expect(qwen3_model, _rid(2), prompt, budget))

    asyncio.run(scenario())


def test_flag_lists_versions_in_first_use_order() -> None:
    from session_server.control.lag import LagBound

    lag = LagBound(2)
    lag.keep(3, "3", None)
    assert not lag.ends_before(5, 3) and not lag.ends_before(5, 4) and not lag.ends_before(0, 9)
    lag.keep(4)
    assert lag.ends_before(5, 5) and not lag.ends_before(5, "4")
    assert lag.flag(5) == {"max_weight_lag": 2, "versions": [3, 4], "next_version": 5}
    assert not LagBound(None).ends_before(10, 99)
