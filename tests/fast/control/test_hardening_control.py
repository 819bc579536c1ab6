"""Hardening of the weight-update control plane."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_server.control import ControlPlane, ResilientResult, generate_resilient
from session_server.engines import GenerateRequest
from session_server.sim import SimModel, running_sim
from tests.fast.control.conftest import make_adapter
from trajectory.validate import Expectations, validate_generation


def _rid(n: int) -> str:
    return f"{n:032x}"


def _expect(model: SimModel, rid: str, prompt: list[int], max_tokens: int) -> Expectations:
    return Expectations(
        request_id=rid, prompt_len=len(prompt), vocab_size=model.vocab_size, max_tokens=max_tokens,
        stop_token_ids=frozenset(model.eos_ids), last_weight_version=None,
    )


async def _run(protocol: str, model: SimModel, prompt: list[int], max_tokens: int,
               plan: list[int]) -> tuple[ResilientResult, list[str]]:
    async with running_sim(protocol, model, abort_plan=plan) as url:
        adapter = make_adapter(protocol, url)
        control = ControlPlane(lambda: [adapter], grace_s=0.005)
        try:
            got = await generate_resilient(adapter, GenerateRequest(_rid(2), prompt, max_tokens),
                                           control, expect=_expect(model, _rid(2), prompt, max_tokens))
        finally:
            await adapter.aclose()
    return got, []


def test_pause_on_eot_step_finishes_stop(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    """Aborts land on any index, the last (end-of-turn) included: the turn equals the
    uninterrupted one and never samples past its own end-of-turn. Counts how many
    examples were really interrupted, and how many on the end-of-turn step."""
    interrupted: list[bool] = []  # one per interrupted example: was the end-of-turn step hit

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        protocol=st.sampled_from(["sglang", "vllm"]),
        cuts=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4),
        last=st.booleans(),
        topic=st.integers(0, 50),
    )
    def prop(protocol: str, cuts: list[float], last: bool, topic: int) -> None:
        prompt = make_prompt(f"task number {topic}: list the files")
        max_tokens = 400

        async def scenario() -> None:
            ref, _ = await _run(protocol, qwen3_model, prompt, max_tokens, [])
            n = len(ref.output_ids)
            assert ref.finish_reason == "stop" and ref.aborts == 0
            ends = sorted({max(1, min(n, round(c * n))) for c in cuts} | ({n} if last else set()))
            plan, prev = [], 0
            for e in ends:  # segment sizes: abort right after cumulative index e-1
                if e > prev:
                    plan.append(e - prev)
                    prev = e
            got, _ = await _run(protocol, qwen3_model, prompt, max_tokens, plan)
            assert list(got.output_ids) == list(ref.output_ids)
            assert list(got.logprobs) == list(ref.logprobs)
            assert got.finish_reason == "stop"
            on_eot = bool(ends) and ends[-1] == n
            # matched = the end-of-turn id itself when the abort landed on it (vLLM reports none for EOS)
            assert got.matched_stop == (got.output_ids[-1] if on_eot else ref.matched_stop)
            # an abort on the end-of-turn step is no abort: the turn is finished there
            assert got.aborts == len([e for e in ends if e < n])
            assert got.segments == len(plan) + (0 if on_eot else 1)
            validate_generation(got, _expect(qwen3_model, _rid(2), prompt, max_tokens))
            if plan:
                interrupted.append(on_eot)

        asyncio.run(scenario())

    prop()
    assert len(interrupted) >= 10, f"only {len(interrupted)} of 30 examples were interrupted"
    assert sum(interrupted) >= 3, "too few examples aborted on the end-of-turn step"


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_pause_on_eot_step_finishes_stop_exact_last_index(
    protocol: str, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]],
) -> None:
    prompt = make_prompt("read the config and fix the error")
    ref, _ = await _run(protocol, qwen3_model, prompt, 400, [])
    n = len(ref.output_ids)
    got, _ = await _run(protocol, qwen3_model, prompt, 400, [n - 3, 3])
    assert list(got.output_ids) == list(ref.output_ids)
    assert got.output_ids[-1] in qwen3_model.eos_ids
    assert got.finish_reason == "stop" and got.matched_stop == got.output_ids[-1]
    assert got.aborts == 1 and got.segments == 2




def test_weight_version_bounded_and_force_reset() -> None:
    from session_server.errors import BadRequest

    control = ControlPlane(lambda: [])
    with pytest.raises(BadRequest):
        control.set_weight_version(2**63 - 1)  # would lock out every later update
    assert control.weight_version is None
    control.set_weight_version(2**53 - 1)
    with pytest.raises(BadRequest, match="force"):
        control.set_weight_version(3)
    out = control.set_weight_version(3, force=True)
    assert out["forced"] and control.weight_version == 3 and control.cache_salt() == "wv-3"
    control.set_weight_version(4)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_turn_queued_behind_engine_cap_does_not_escape_pause(
    protocol: str, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]],
) -> None:
    """B waits for A's engine slot while a pause + weight update happens: B is sent only
    after resume, with the new version's cache salt (gate/version/salt read after the slot)."""
    from session_server.engines import SGLangAdapter, VLLMAdapter
    from tests.fast.control.conftest import Spy

    prompt = make_prompt("read the config and fix the error")
    async with running_sim(protocol, qwen3_model, latency_ms=5) as url:
        cls: Any = SGLangAdapter if protocol == "sglang" else VLLMAdapter
        spy = Spy(cls(url, retries=0, max_concurrency=1))
        control = ControlPlane(lambda: [spy], grace_s=0.005, weight_version=1)
        try:
            a = asyncio.create_task(generate_resilient(spy, GenerateRequest(_rid(1), prompt, 400), control))
            await asyncio.sleep(0.05)
            b = asyncio.create_task(generate_resilient(spy, GenerateRequest(_rid(2), prompt, 40), control))
            await asyncio.sleep(0.05)  # B now queues for the only slot
            assert not any(r.request_id == _rid(2) for r in spy.requests)
            assert (await control.pause("abort"))["ok"]
            await asyncio.sleep(0.05)  # A's abort frees the slot while paused
            control.set_weight_version(2)
            sent_while_paused = [r.request_id for r in spy.requests if r.request_id == _rid(2)]
            assert (await control.resume())["ok"]
            got_a, got_b = await asyncio.gather(a, b)
        finally:
            await spy.aclose()
    assert sent_while_paused == []
    first_b = next(r for r in spy.requests if r.request_id == _rid(2))
    assert first_b.cache_salt == "wv-2"
    assert got_b.weight_version in (2, None, "default") and got_b.finish_reason in ("stop", "length")
    assert got_a.aborts >= 1


async def test_admission_wait_bounded_by_deadline_and_not_held_at_gate(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]],
) -> None:
    import contextlib
    import time

    from session_server.errors import UpstreamTimeout

    prompt = make_prompt("list the files")
    sem = asyncio.Semaphore(1)
    entered: list[bool] = []

    @contextlib.asynccontextmanager
    async def admit(guess: int | None) -> Any:
        async with sem:
            entered.append(control.blocked())
            yield

    async with running_sim("sglang", qwen3_model, latency_ms=1) as url:
        adapter = make_adapter("sglang", url)
        control = ControlPlane(lambda: [adapter], grace_s=0.005)
        try:
            # the slot is taken elsewhere: the wait ends at the turn's deadline with a 504
            await sem.acquire()
            with pytest.raises(UpstreamTimeout, match="prefill admission"):
                await generate_resilient(adapter, GenerateRequest(_rid(1), prompt, 8), control,
                                         admit=admit, deadline=time.monotonic() + 0.1)
            sem.release()
            # paused: the turn waits at the gate without holding admission
            await control.pause("abort")
            task = asyncio.create_task(generate_resilient(
                adapter, GenerateRequest(_rid(2), prompt, 8), control, admit=admit))
            await asyncio.sleep(0.05)
            assert not sem.locked() and entered == []
            await control.resume()
            got = await task
        finally:
            await adapter.aclose()
    assert entered == [False] and len(got.output_ids) > 0
