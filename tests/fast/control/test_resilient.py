"""Abort, accumulate, resubmit against the real simulator over HTTP with the real adapters.

The property: with the deterministic simulated engine, a turn interrupted by any
number of pauses (abort, keep or wait) yields exactly the uninterrupted turn's ids,
logprobs, top logprobs and finish reason.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from session_server.control import ControlPlane, ResilientResult, generate_resilient
from session_server.engines import GenerateRequest
from session_server.errors import PausedTooLong, UpstreamInvalid
from session_server.sim import SimModel, running_sim
from tests.fast.control.conftest import Spy, make_adapter
from trajectory.linear import LinearTrajectory
from trajectory.validate import Expectations, validate_generation

HEX32 = re.compile(r"^[0-9a-f]{32}$")


def _rid(n: int) -> str:
    return f"{n:032x}"


def _expect(model: SimModel, rid: str, prompt: list[int], max_tokens: int, last: Any = None) -> Expectations:
    return Expectations(
        request_id=rid, prompt_len=len(prompt), vocab_size=model.vocab_size, max_tokens=max_tokens,
        stop_token_ids=frozenset(model.eos_ids), last_weight_version=last,
    )


def _same_turn(got: ResilientResult, ref: ResilientResult) -> None:
    assert list(got.output_ids) == list(ref.output_ids)
    assert list(got.logprobs) == list(ref.logprobs)
    assert got.finish_reason == ref.finish_reason
    assert got.matched_stop == ref.matched_stop
    assert got.top_logprobs == ref.top_logprobs
    assert got.completion_tokens == len(got.output_ids)


async def _post(url: str, body: Any = None, **kw: Any) -> int:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, **kw) as r:
        await r.read()
        return r.status


async def _storm(control: ControlPlane, mode: str, pauses: list[tuple[float, float]],
                 lora: str | None = None) -> None:
    for delay_s, hold_s in pauses:
        await asyncio.sleep(delay_s)
        report = await control.pause(mode, lora=lora)
        assert report["ok"], report
        await asyncio.sleep(hold_s)
        assert (await control.resume(lora=lora))["ok"]


# --- the property ----------------------------------------------------------------------------

@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    protocol=st.sampled_from(["sglang", "vllm"]),
    mode=st.sampled_from(["abort", "abort", "keep", "wait"]),
    pauses=st.lists(
        st.tuples(st.floats(0.0, 0.08), st.floats(0.0, 0.03)), min_size=0, max_size=5
    ),
    max_tokens=st.sampled_from([7, 25, 400]),
    top=st.sampled_from([0, 2]),
    topic=st.integers(0, 50),
)
def test_interrupted_turn_equals_uninterrupted(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]], protocol: str, mode: str,
    pauses: list[tuple[float, float]], max_tokens: int, top: int, topic: int,
) -> None:
    prompt = make_prompt(f"task number {topic}: list the files")

    async def scenario() -> None:
        async with running_sim(protocol, qwen3_model, latency_ms=1.5) as url:
            adapter = make_adapter(protocol, url)
            control = ControlPlane(lambda: [adapter], grace_s=0.005)
            try:
                base = GenerateRequest(_rid(1), prompt, max_tokens, top_logprobs=top)
                ref = await generate_resilient(adapter, base, control)
                assert ref.aborts == 0 and ref.segments == 1
                req = GenerateRequest(_rid(2), prompt, max_tokens, top_logprobs=top)
                storm = asyncio.create_task(_storm(control, mode, pauses))
                got = await generate_resilient(adapter, req, control,
                                               expect=_expect(qwen3_model, _rid(2), prompt, max_tokens))
                await storm
                event(f"{mode}: aborts={min(got.aborts, 3)}{'+' if got.aborts >= 3 else ''}")
                _same_turn(got, ref)
                assert got.request_id == _rid(2)
                assert got.prompt_tokens == len(prompt)
                assert got.resubmits == got.aborts  # every abort here leaves budget
                if mode != "abort":
                    assert got.aborts == 0
                assert len(set(got.segment_request_ids)) == got.segments
                validate_generation(got, _expect(qwen3_model, _rid(2), prompt, max_tokens))
            finally:
                await adapter.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_many_aborts_accumulate_and_resubmit(
    protocol: str, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("read the config and fix the error")
    async with running_sim(protocol, qwen3_model, latency_ms=4) as url:
        spy = Spy(make_adapter(protocol, url))
        control = ControlPlane(lambda: [spy], grace_s=0.005)
        try:
            ref = await generate_resilient(spy, GenerateRequest(_rid(1), prompt, 400), control)
            n_ref = len(ref.output_ids)
            assert ref.finish_reason == "stop" and n_ref > 30
            spy.requests.clear()
            spy.results.clear()
            events: list[Any] = []
            task = asyncio.create_task(generate_resilient(
                # the server sends numpy contexts: resubmissions stay numpy
                spy, GenerateRequest(_rid(2), np.asarray(prompt, dtype=np.int32), 400, top_logprobs=1),
                control,
                on_abort=events.append,
                expect=_expect(qwen3_model, _rid(2), prompt, 400),
            ))
            await _storm(control, "abort", [(0.03, 0.02), (0.03, 0.0), (0.03, 0.03)])
            got = await task
        finally:
            await spy.aclose()
    assert list(got.output_ids) == list(ref.output_ids) and list(got.logprobs) == list(ref.logprobs)
    assert got.aborts == 3 and got.resubmits == 3 and got.segments == 4 and len(events) == 3
    assert got.paused_wait_s > 0.0 and got.weight_spans == ((0, n_ref, got.weight_version),)
    # each resubmission: prompt + everything so far, the remaining budget, a new 32-hex id
    sent = 0
    for i, (req, res) in enumerate(zip(spy.requests, spy.results, strict=True)):
        assert list(req.input_ids) == prompt + list(ref.output_ids[:sent])
        assert req.max_tokens == 400 - sent
        assert HEX32.match(req.request_id)
        assert isinstance(req.input_ids, np.ndarray) and req.input_ids.dtype == np.int32
        sent += len(res.output_ids)
        assert res.finish_reason == ("abort" if i < 3 else "stop")
    assert [r.request_id for r in spy.requests][0] == _rid(2)
    assert len({r.request_id for r in spy.requests}) == 4
    assert got.request_id == _rid(2) and got.prompt_tokens == len(prompt)
    assert got.cached_tokens == spy.results[0].cached_tokens
    if protocol == "sglang":
        assert list(got.output_ids_echo) == list(got.output_ids)
    assert got.counters()["aborts"] == 3
    state = control.state()
    assert state["counters"]["aborts"] == 3 and state["counters"]["resubmits"] == 3
    assert control.metrics.registry.get_sample_value("tito_turn_aborts_total") == 3
    assert control.metrics.registry.get_sample_value("tito_turn_resubmits_total") == 3
    assert control.metrics.registry.get_sample_value("tito_turn_paused_wait_seconds_count") >= 1


# --- weight versions ------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_weight_spans_across_a_version_bump(
    protocol: str, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("update the function and run the tests")
    async with running_sim(protocol, qwen3_model, latency_ms=4, weight_version="1") as url:
        spy = Spy(make_adapter(protocol, url))
        control = ControlPlane(lambda: [spy], grace_s=0.005, weight_version=1)
        try:
            ref = await generate_resilient(spy, GenerateRequest(_rid(1), prompt, 400), control)
            spy.requests.clear()
            spy.results.clear()
            task = asyncio.create_task(generate_resilient(
                spy, GenerateRequest(_rid(2), prompt, 400), control,
                expect=_expect(qwen3_model, _rid(2), prompt, 400, last=1),
            ))
            await asyncio.sleep(0.06)
            assert (await control.pause("abort"))["ok"]
            # the weight update itself, while paused
            assert await _post(url + "/sim/weight_version", {"version": "2"}) == 200
            assert control.set_weight_version(2)["cache_salt"] == "wv-2"
            assert (await control.resume())["ok"]
            got = await task
        finally:
            await spy.aclose()
    _same_turn(got, ref)
    k = len(spy.results[0].output_ids)
    n = len(got.output_ids)
    assert 0 < k < n
    v1, v2 = 1, 2  # the trainer's versions; what the engine reports ("1", "2" or spans) agrees
    assert got.weight_spans == ((0, k, v1), (k, n, v2))
    assert got.weight_version == v2 and got.version_mismatches == 0
    assert [r.cache_salt for r in spy.requests] == ["wv-1", "wv-2"]
    # the spans commit as they are
    traj = LinearTrajectory()
    turn = traj.commit_turn(prompt, got.output_ids, got.logprobs, finish_reason=got.finish_reason,
                            weight_spans=got.weight_spans)
    p = len(prompt)
    assert turn.weight_spans == ((p, p + k, v1), (p + k, p + n, v2))


async def test_engine_version_mismatch_is_a_diagnostic(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("look at the output")
    async with running_sim("sglang", qwen3_model, weight_version="1") as url:
        adapter = make_adapter("sglang", url)
        control = ControlPlane(lambda: [adapter], weight_version=3)
        try:
            got = await generate_resilient(adapter, GenerateRequest(_rid(1), prompt, 400), control)
        finally:
            await adapter.aclose()
    assert got.finish_reason == "stop" and got.version_mismatches == 1
    # the trainer's version: a stale engine report is counted, never stamped
    assert got.weight_spans == ((0, len(got.output_ids), 3),)
    state = control.state()
    assert state["counters"]["version_mismatches"] == 1
    assert state["last_version_mismatch"]["reported"] == "1"
    assert state["last_version_mismatch"]["expected"] == 3


# --- per-LoRA pause ---------------------------------------------------------------------------

async def test_lora_pause_blocks_only_that_adapter(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    pa, pb = make_prompt("adapter a: run the task"), make_prompt("adapter b: run the task")
    async with running_sim("sglang", qwen3_model, latency_ms=3) as url:
        adapter = make_adapter("sglang", url)
        control = ControlPlane(lambda: [adapter], grace_s=0.005)
        try:
            ref_a = await generate_resilient(adapter, GenerateRequest(_rid(1), pa, 400, lora="a"), control)
            ref_b = await generate_resilient(adapter, GenerateRequest(_rid(2), pb, 400, lora="b"), control)
            # a turn of "a" in flight is aborted by id; "b" keeps flowing
            ta = asyncio.create_task(generate_resilient(
                adapter, GenerateRequest(_rid(3), pa, 400, lora="a"), control))
            tb = asyncio.create_task(generate_resilient(
                adapter, GenerateRequest(_rid(4), pb, 400, lora="b"), control))
            await asyncio.sleep(0.05)
            report = await control.pause("abort", lora="a")
            assert report["ok"] and report["engines"][adapter.base_url]["aborted"] == 1
            assert control.state()["lora_pauses"]["a"]["mode"] == "abort"
            assert not control.state()["paused"]
            # new turns: "a" waits at the gate, "b" and unadapted turns run to the end
            ta2 = asyncio.create_task(generate_resilient(
                adapter, GenerateRequest(_rid(5), pa, 400, lora="a"), control))
            got_b = await asyncio.wait_for(tb, 5)
            got_plain = await generate_resilient(adapter, GenerateRequest(_rid(6), pb, 400), control)
            assert not ta.done() and not ta2.done()
            assert control.state()["waiting_at_gate"] == 2
            assert (await control.resume(lora="a"))["was_paused"]
            got_a, got_a2 = await asyncio.wait_for(asyncio.gather(ta, ta2), 5)
        finally:
            await adapter.aclose()
    _same_turn(got_b, ref_b)
    _same_turn(got_plain, ref_b)
    _same_turn(got_a, ref_a)
    _same_turn(got_a2, ref_a)
    assert got_b.aborts == 0 and got_b.paused_wait_s == 0.0
    assert got_a.aborts == 1 and got_a.paused_wait_s > 0
    assert got_a2.aborts == 0 and got_a2.paused_wait_s > 0


# --- budget and empty aborts --------------------------------------------------------------------

class _LateAbort(Spy):
    """An abort that lands after the last budgeted token: the engine says abort, not length."""

    async def generate(self, request: GenerateRequest) -> Any:
        from dataclasses import replace

        result = await super().generate(request)
        if result.finish_reason == "length":
            return replace(result, finish_reason="abort", abort_message="Abort in running batch.")
        return result


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_budget_exhausted_across_aborts_ends_with_length(
    protocol: str, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("check the list then answer")
    budget = 20
    async with running_sim(protocol, qwen3_model, latency_ms=4) as url:
        inner = make_adapter(protocol, url)
        spy = _LateAbort(inner)
        control = ControlPlane(lambda: [spy], grace_s=0.005)
        try:
            ref = await generate_resilient(inner, GenerateRequest(_rid(1), prompt, budget), control)
            assert ref.finish_reason == "length"
            task = asyncio.create_task(generate_resilient(
                spy, GenerateRequest(_rid(2), prompt, budget), control,
                expect=_expect(qwen3_model, _rid(2), prompt, budget)))
            await _storm(control, "abort", [(0.03, 0.01)])
            got = await task
        finally:
            await inner.aclose()
    _same_turn(got, ref)
    assert got.finish_reason == "length" and got.completion_tokens == budget
    assert got.aborts == 2 and got.resubmits == 1  # the storm's abort, then the late one
    assert sum(r.max_tokens for r in spy.requests[:1]) == budget
    assert spy.requests[1].max_tokens == budget - len(spy.results[0].output_ids)
    validate_generation(got, _expect(qwen3_model, _rid(2), prompt, budget))


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_abort_with_no_tokens_retries_without_accumulating(
    protocol: str, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("search for the retry logic")
    async with running_sim(protocol, qwen3_model, latency_ms=2) as url:
        spy = Spy(make_adapter(protocol, url))
        control = ControlPlane(lambda: [spy], grace_s=0.005)
        try:
            ref = await generate_resilient(spy, GenerateRequest(_rid(1), prompt, 400), control)
            spy.requests.clear()
            spy.results.clear()
            # paused at the engine behind our back: the request is held there, not at our gate
            await spy.pause("keep")
            task = asyncio.create_task(generate_resilient(spy, GenerateRequest(_rid(2), prompt, 400), control))
            await asyncio.sleep(0.05)
            await spy.pause("abort")  # aborts the held request before it produced anything
            await asyncio.sleep(0.05)
            await spy.resume()
            got = await asyncio.wait_for(task, 5)
        finally:
            await spy.aclose()
    _same_turn(got, ref)
    assert len(spy.results) == 2 and len(spy.results[0].output_ids) == 0
    assert spy.results[0].finish_reason == "abort"
    assert got.aborts == 1 and got.empty_aborts == 1 and got.resubmits == 1
    assert list(spy.requests[1].input_ids) == prompt and spy.requests[1].max_tokens == 400
    assert got.weight_spans == ((0, len(got.output_ids), got.weight_version),)


# --- deadline and bad partials ---------------------------------------------------------------------

async def test_paused_past_the_deadline_raises_paused_too_long(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("run the shell")
    async with running_sim("vllm", qwen3_model, latency_ms=1) as url:
        adapter = make_adapter("vllm", url)
        control = ControlPlane(lambda: [adapter], grace_s=0.0)
        try:
            await control.pause("wait")
            t0 = time.monotonic()
            with pytest.raises(PausedTooLong) as info:
                await generate_resilient(adapter, GenerateRequest(_rid(1), prompt, 50, timeout_s=0.2), control)
            waited = time.monotonic() - t0
            assert info.value.status == 503 and info.value.type == "paused"
            assert 0.19 <= waited < 1.0
            assert control.state()["counters"]["paused_too_long"] == 1
            assert control.state()["waiting_at_gate"] == 0
            # an explicit deadline works the same; after resume the turn goes through
            with pytest.raises(PausedTooLong):
                await generate_resilient(adapter, GenerateRequest(_rid(2), prompt, 50), control,
                                         deadline=time.monotonic() + 0.05)
            await control.resume()
            got = await generate_resilient(adapter, GenerateRequest(_rid(3), prompt, 50), control)
            assert got.finish_reason in ("stop", "length") and got.paused_wait_s == 0.0
        finally:
            await adapter.aclose()


async def test_bad_values_in_a_partial_are_rejected(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("fix the parse error")
    async with running_sim("sglang", qwen3_model, latency_ms=4) as url:
        adapter = make_adapter("sglang", url)
        control = ControlPlane(lambda: [adapter], grace_s=0.005)
        try:
            assert await _post(url + "/sim/faults", {"kind": "nan_logprob", "count": 1}) == 200
            task = asyncio.create_task(generate_resilient(
                adapter, GenerateRequest(_rid(1), prompt, 400), control,
                expect=_expect(qwen3_model, _rid(1), prompt, 400)))
            await _storm(control, "abort", [(0.04, 0.01)])
            with pytest.raises(UpstreamInvalid, match="aborted segment .* logprobs"):
                await task
        finally:
            await adapter.aclose()


async def test_a_finished_turn_leaves_no_cycle_for_the_cyclic_gc(qwen3_model: SimModel,
                                                                make_prompt: Callable[[str], list[int]]) -> None:
    """Freed by reference counting alone: a turn's state kept in a cycle (bound methods
    on the turn, say) waits for a GC pass, and under load those passes took milliseconds
    of the event loop each (bench/README.md)."""
    import gc

    from session_server.control import resilient

    async with running_sim("sglang", qwen3_model) as url:
        adapter = make_adapter("sglang", url)
        control = ControlPlane(lambda: [adapter], grace_s=0.005)
        try:
            await generate_resilient(adapter, GenerateRequest(f"{1:032x}", make_prompt("warm up"), 8), control)
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                got = await generate_resilient(adapter, GenerateRequest(f"{2:032x}", make_prompt("a turn"), 8),
                                               control)
                assert len(got.output_ids) > 0
                del got
                gc.collect()
                turns = [o for o in gc.garbage if isinstance(o, resilient._Turn)]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            assert turns == []
        finally:
            await adapter.aclose()
